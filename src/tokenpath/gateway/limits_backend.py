"""Where rate windows, token reservations and daily quotas live: the one seam the guard charges.

Two backends answer the same two calls, so the guard, its errors and its headers do not depend
on where the counters are:
- `StoreLimits` (the default): the gateway's SQL store, one transaction per reservation
  (exact across the gateways that share one PostgreSQL database or one SQLite file);
- `tokenpath.gateway.redis_limits.RedisLimits` (`serve --redis-url`): atomic Lua scripts in
  Redis, for several gateways that should not put every request through one SQL row lock.

Keys, tenants and the audit log stay in the SQL store either way.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from tokenpath.errors import ServiceUnavailableError
from tokenpath.gateway.base import Limits
from tokenpath.gateway.limiter import Verdict
from tokenpath.gateway.store import Admitted, GatewayStore


class LimitsBackend(Protocol):
    async def reserve(self, key_prefix: str, tenant: str, key_limits: Limits, tenant_limits: Limits,
                      tokens: int, now: float) -> Admitted:
        """Decide and, when allowed, charge `tokens` to the key and its tenant, atomically."""
        ...

    async def adjust(self, admission_id: int | str, key_prefix: str, tenant: str, key_limits: Limits,
                     tenant_limits: Limits, day: int, reserved: int, tokens: int, now: float) -> Verdict:
        """Re-size an admission reserved on an estimate to the exact count, atomically: growth is
        decided as if `tokens` had been asked for at first; a refusal removes the admission."""
        ...

    async def reconcile(self, admission_id: int | str, key_prefix: str, tenant: str, day: int,
                        reserved: int, used: int) -> None:
        """Replace a reservation by the real use (in its window and in the day it was charged to)."""
        ...

    async def aclose(self) -> None: ...


class StoreLimits:
    """The SQL store's limits. `reserve` and `adjust` run before every request with a stored key,
    on its way to the first token: on the event loop where the store can write at once (SQLite,
    its write lock free: `write_nowait`), else off it (PostgreSQL, a busy or failing SQLite), where
    waits and failures are handled. On two busy cores a request's first thread hop cost ~2.5 ms,
    ten times the transaction on the loop. `reconcile` (once the reply is out) likewise."""

    def __init__(self, store: GatewayStore) -> None:
        self.store = store

    async def reserve(self, key_prefix: str, tenant: str, key_limits: Limits, tenant_limits: Limits,
                      tokens: int, now: float) -> Admitted:
        try:  # fail closed, as RedisLimits does: a limit that cannot be checked is a 503, not a 500
            admitted = self.store.reserve_nowait(key_prefix, tenant, key_limits, tenant_limits, tokens, now)
            if admitted is None:
                admitted = await asyncio.to_thread(self.store.reserve, key_prefix, tenant, key_limits,
                                                   tenant_limits, tokens, now)
            return admitted
        except Exception as exc:  # noqa: BLE001
            raise _unavailable(exc) from None

    async def adjust(self, admission_id: int | str, key_prefix: str, tenant: str, key_limits: Limits,
                     tenant_limits: Limits, day: int, reserved: int, tokens: int, now: float) -> Verdict:
        try:
            args = (int(admission_id), key_prefix, tenant, key_limits, tenant_limits, day, reserved, tokens, now)
            verdict = self.store.adjust_nowait(*args)
            if verdict is None:
                verdict = await asyncio.to_thread(self.store.adjust, *args)
            return verdict
        except Exception as exc:  # noqa: BLE001
            raise _unavailable(exc) from None

    async def reconcile(self, admission_id: int | str, key_prefix: str, tenant: str, day: int,
                        reserved: int, used: int) -> None:
        args = (int(admission_id), key_prefix, tenant, day, reserved, used)
        if not self.store.reconcile_nowait(*args):
            await asyncio.to_thread(self.store.reconcile, *args)

    async def aclose(self) -> None:
        return None  # the store is the guard's, closed with it


def _unavailable(exc: Exception) -> ServiceUnavailableError:
    return ServiceUnavailableError(f"The gateway's store is unreachable ({type(exc).__name__}); rate limits cannot "
                                   "be checked. Retry later.", code="rate_limits_unavailable",
                                   headers={"Retry-After": "1"})
