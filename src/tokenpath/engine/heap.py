"""Hand the C heap's free pages back to the OS between the stages of a model load (glibc only).

A load's stages each leave a high-water mark of freed memory in glibc's heap: the tokenizer's
JSON parse (Gemma 3's 262k-token, 515k-merge tokenizer.json: +356 MiB at its peak, 97 MiB once
built) and the weights' repack buffers. Freed chunks stay resident until trimmed, so without a
trim each stage's leftovers add to the next stage's peak. The server also trims periodically
(server/memory.py); this is the engine's own call at the points where it knows a stage ended.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's malloc_trim from the process's own symbols (libc is loaded already): not through
    ctypes.util.find_library, whose import (shutil, tempfile, bz2, lzma: 0.8 MiB) and `ldconfig -p`
    child every engine process would pay for one function."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def trim_heap() -> None:
    """malloc_trim(0): a few milliseconds; a no-op without glibc (musl, macOS)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
