"""API key material: generation, the stored (salted hash) form, and constant-time verification.

A key is `tp-` followed by 43 url-safe characters (32 random bytes). Only three things about it
are ever stored: its prefix (`tp-` plus the first 8 characters, shown in lists, audit rows and
error messages so an operator can tell keys apart), a random per-key salt, and
SHA-256(salt || key). A key carries 256 bits of entropy, so a fast salted hash is enough: slow
password hashes exist to protect low-entropy secrets, and would add latency to every request.
Keys are verified with `hmac.compare_digest`, so the time taken does not reveal how much matched.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

KEY_PREFIX = "tp-"
PREFIX_CHARS = 8  # random characters kept in the stored, displayable prefix
_KEY_RE = re.compile(r"tp-[A-Za-z0-9_-]{32,128}")


@dataclass(frozen=True)
class NewKey:
    """A freshly generated key: `secret` is shown to the operator once and then forgotten."""

    secret: str
    prefix: str
    salt: str
    digest: str


def generate_key() -> NewKey:
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    return NewKey(secret=secret, prefix=key_prefix(secret), salt=salt, digest=hash_key(secret, salt))


def key_prefix(secret: str) -> str:
    return secret[: len(KEY_PREFIX) + PREFIX_CHARS]


def hash_key(secret: str, salt: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + secret.encode("utf-8")).hexdigest()


def looks_like_key(value: str) -> bool:
    """Shape check before any lookup: a malformed credential is rejected without touching the store."""
    return _KEY_RE.fullmatch(value) is not None


def verify_key(secret: str, salt: str, digest: str) -> bool:
    return hmac.compare_digest(hash_key(secret, salt), digest)
