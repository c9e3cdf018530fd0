"""Network addresses: what counts as loopback, for every command that binds or is reached.

A bottom-layer module of its own (no FastAPI, no pydantic): `tokenpath engine` checks its `--host`
with it before it loads anything, and an engine process imports nothing of the HTTP API.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`localhost`, 127.0.0.0/8 or ::1 (bracketed or not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
