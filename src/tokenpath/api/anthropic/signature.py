"""The `signature` of a `thinking` block: proof that this server wrote that thinking, checked when
the block comes back in a later request's history (Claude Code and the agent SDKs send every
thinking block back, as Anthropic requires them to within a tool loop).

Anthropic's signature is opaque; here it is `tp1.` and an HMAC-SHA256 of the thinking text under
a server key, URL-safe base64. A block whose text or signature was changed is a 400 naming the
block's `signature`, as Anthropic refuses it; a block signed by another server (a conversation
moved from Anthropic, or from a server with another key) is refused the same way. The text
itself is not put back into the prompt (the chat templates drop past turns' reasoning), so the
check is what a client can rely on: a thinking block this server accepts is one it produced.

The key: `thinking_signing_key` in the config when set (several gateways behind one address
must share it), else a random key kept in the data dir (`thinking_signing.key`, 0600), made
once, so signatures outlive a restart.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from tokenpath.config import env_thinking_signing_key, resolve_data_dir
from tokenpath.errors import InvalidRequestError

KEY_FILE = "thinking_signing.key"
log = logging.getLogger("tokenpath.api")
PREFIX = "tp1."


def key_file_key(data_dir: Path) -> bytes:
    """The data dir's key, made (0600) when absent. Two servers (or threads) starting at once
    agree: the key is written whole to a file of this caller's own, then linked into place, which
    succeeds for one of them only; the rest read what it linked. (Creating the key file itself
    exclusively and then writing it let a second caller read it empty in between.)"""
    path = data_dir / KEY_FILE
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(32)
    mine = data_dir / f".{KEY_FILE}.{secrets.token_hex(8)}"
    fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(mine, path)
        except FileExistsError:  # another caller linked its key first
            return path.read_bytes()
        return key
    finally:
        os.unlink(mine)


def signing_key(config: object) -> bytes:
    """The configured key (`env_thinking_signing_key` by default), else the data dir's
    (`config.data_dir`, else $TOKENPATH_DATA_DIR)."""
    configured = getattr(config, "thinking_signing_key", None) or env_thinking_signing_key()
    if configured:
        return str(configured).encode()
    try:
        return key_file_key(resolve_data_dir(getattr(config, "data_dir", None)))
    except OSError as exc:  # a read-only data dir: signatures still work, until this process ends
        log.warning("cannot keep the thinking-signing key in the data dir (%s): using a key for this process "
                    "only; set thinking_signing_key to keep signatures valid across restarts", exc)
        return secrets.token_bytes(32)


def sign(key: bytes, thinking: str) -> str:
    mac = hmac.new(key, b"thinking\0" + thinking.encode(), hashlib.sha256).digest()
    return PREFIX + base64.urlsafe_b64encode(mac).decode().rstrip("=")


def verify(key: bytes, thinking: str, signature: object) -> bool:
    return isinstance(signature, str) and hmac.compare_digest(sign(key, thinking), signature)


def check_history(messages: list, key: Callable[[], bytes]) -> None:
    """Every `thinking` block of the history's assistant turns carries this server's signature of
    its text; the first that does not is a 400 naming it."""
    for i, m in enumerate(messages):
        if m.role != "assistant" or not isinstance(m.content, list):
            continue
        for j, b in enumerate(m.content):
            if not isinstance(b, dict) or b.get("type") != "thinking":
                continue
            at = f"messages.{i}.content.{j}"
            if not isinstance(b.get("thinking"), str):
                raise InvalidRequestError(f"{at}.thinking: must be a string", param=f"{at}.thinking")
            if not verify(key(), b["thinking"], b.get("signature")):
                raise InvalidRequestError(
                    f"{at}.signature: invalid signature in thinking block: it does not match its thinking text "
                    "(a block changed, or written by another server); send thinking blocks back exactly as "
                    "this server returned them", param=f"{at}.signature", code="invalid_signature")
