"""Operator actions on keys and tenants, shared by the CLI and the tests (no HTTP involved)."""

from __future__ import annotations

import time

from tokenpath.gateway.base import Limits
from tokenpath.gateway.keys import generate_key
from tokenpath.gateway.store import GatewayStore, KeyRecord
from tokenpath.protocol.requests import check_priority


def create_key(
    store: GatewayStore,
    tenant: str,
    *,
    models: frozenset[str] | None = None,
    limits: Limits | None = None,
    priority: int = 0,
    expires_at: float | None = None,
    name: str | None = None,
    now: float | None = None,
    admin: bool = False,
) -> tuple[str, KeyRecord]:
    """Create a key (and its tenant, with no limits, when new). Returns the secret, to be shown
    once, and the stored record; the secret itself is not kept anywhere. An `admin` key may also
    call the operator endpoints (/metrics, /reset_prefix_cache)."""
    check_priority(priority)  # (every request of the key carries it across the engine link)
    now = time.time() if now is None else now
    store.put_tenant(tenant, None, None, now, update=False)
    for _ in range(5):  # a prefix collision (48 random bits) is astronomically rare; retry anyway
        new = generate_key()
        if store.find_key(new.prefix) is None:
            record = store.add_key(new, tenant, name=name, models=models, limits=limits or Limits(),
                                   priority=priority, expires_at=expires_at, now=now, admin=admin)
            return new.secret, record
    raise RuntimeError("could not generate a key with an unused prefix")


def set_tenant(store: GatewayStore, tenant: str, *, limits: Limits | None = None,
               models: frozenset[str] | None = None, now: float | None = None) -> None:
    """Create or update a tenant's default limits and models (its keys inherit or tighten them)."""
    store.put_tenant(tenant, limits, models, time.time() if now is None else now, update=True)
