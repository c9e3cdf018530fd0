"""The two digests the engine takes (a LoRA chain's root, a tokenizer's cache key), without hashlib.

`import hashlib` imports `_hashlib`, which maps OpenSSL's libcrypto: 3.8 MiB resident in every
engine process, for two short digests a load takes (issue 42's peak RSS, where an offline
SmolLM2 engine is 175 MiB against llama.cpp's 149). hashlib's own blake2b is `_blake2`'s, and
its sha256 without OpenSSL is `_sha256` (`_sha2` from Python 3.12): the same functions, the same
digests. An interpreter without them gets hashlib's.
"""

from __future__ import annotations

try:
    from _blake2 import blake2b
except ImportError:  # (an interpreter built without it)
    from hashlib import blake2b

try:
    from _sha256 import sha256  # Python <= 3.11
except ImportError:
    try:
        from _sha2 import sha256  # Python >= 3.12
    except ImportError:
        from hashlib import sha256

__all__ = ["blake2b", "sha256"]
