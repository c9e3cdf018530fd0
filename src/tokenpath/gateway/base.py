"""The contract between the HTTP layer and the gateway.

`tokenpath.api` calls a `RequestGuard` at fixed points of every request; `tokenpath.gateway`
implements it with keys, limits, quotas and the audit log. `OpenGuard` is the guard of a process
that has no gateway in front of it (e.g. a bare `tokenpath engine` replica behind a gateway).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Limits:
    """Rate limits and quota of one key or tenant; None means no limit of that kind."""

    rpm: int | None = None  # requests per sliding minute
    tpm: int | None = None  # tokens (prompt + max_tokens at admission, actual use after) per sliding minute
    daily_tokens: int | None = None  # tokens per UTC day (of the gateway's clock)

    def tightened_by(self, other: Limits | None) -> Limits:
        """The stricter of the two for each limit: a key inherits its tenant's defaults or tightens them."""
        if other is None:
            return self

        def low(a: int | None, b: int | None) -> int | None:
            return b if a is None else a if b is None else min(a, b)

        return Limits(low(self.rpm, other.rpm), low(self.tpm, other.tpm), low(self.daily_tokens, other.daily_tokens))

    def any(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.daily_tokens is not None


@dataclass(frozen=True)
class Principal:
    """Who is asking. `key_prefix` is the short non-secret prefix, never the key itself."""

    tenant: str = "anonymous"
    key_prefix: str | None = None
    allowed_models: frozenset[str] | None = None  # None: every model
    priority: int = 0
    max_priority: int = 0  # the best (lowest) priority an x-priority header may ask for
    key_limits: Limits | None = None  # effective limits of the key (already tightened by the tenant's)
    tenant_limits: Limits | None = None  # limits on the sum over all of the tenant's keys
    admin: bool = False  # may call operator endpoints (/metrics, /reset_prefix_cache) when auth is on


@dataclass
class Reservation:
    """Tokens reserved at admission (prompt + max_tokens); reconciled with the real use at the end."""

    principal: Principal
    model: str
    tokens: int
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* for the response
    admission_id: int | str | None = None  # the limits backend's id for it; None: nothing to reconcile
    day: int | None = None  # the UTC day the tokens were charged to (reconciled there, even after midnight)
    reconciled: bool = False  # reconcile is idempotent: a second call returns nothing twice


@dataclass
class AuditRecord:
    request_id: str
    time: float  # wall clock, seconds since epoch
    tenant: str
    key_prefix: str | None
    model: str | None
    endpoint: str
    status: int
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    total_s: float | None = None
    client: str | None = None
    error_type: str | None = None
    prompt_text: str | None = None  # only when the operator turns text logging on
    completion_text: str | None = None
    # JSON from telemetry: every stage's ms, replica, routing policy/reason, trace id (`tokenpath trace`).
    timing: str | None = None
    # Ties the row opened at admission to its close (unique); None: a row written once, at the end.
    audit_key: str | None = None
    # The client's own id for the request (`x-request-id` / `X-Client-Request-Id`), when it sent a
    # well-formed one. Clients choose it, so it is not unique: `request_id` is the server's own.
    client_request_id: str | None = None


OPEN_STATUS = 0  # the status of a row opened at admission and not yet closed
CRASH_STATUS = 500  # a row left open by a gateway that died, closed by the next start
GATEWAY_CRASH = "gateway_crash"  # its finish_reason and error_type


@dataclass(frozen=True)
class AuditHealth:
    """The audit log's writer, as /health and /metrics report it."""

    degraded: bool = False
    reason: str | None = None  # why rows cannot be written now (the store's error), when degraded
    spool_rows: int = 0  # rows held in memory now, waiting for the store
    spooled_total: int = 0  # rows ever held because the store failed
    dropped_total: int = 0  # rows lost because the spool was full (never silently: counted and logged)
    written_total: int = 0  # rows written (open or close)


class RequestGuard(Protocol):
    auth_enabled: bool  # False: no keys exist; serve then refuses a non-loopback host without --insecure

    async def authenticate(self, headers: Mapping[str, str]) -> Principal: ...

    async def adjust(self, reservation: Reservation, tokens: int) -> None: ...

    def check_model(self, principal: Principal, model: str) -> None: ...

    def visible_models(self, principal: Principal, models: list[str]) -> list[str]: ...

    async def check_policy(self, principal: Principal, texts: list[str]) -> None: ...

    async def reserve(self, principal: Principal, model: str, tokens: int) -> Reservation: ...

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None: ...

    async def audit_open(self, record: AuditRecord, progress: Callable[[], int]) -> None: ...

    async def audit(self, record: AuditRecord) -> None: ...

    def audit_health(self) -> AuditHealth | None: ...


class OpenGuard:
    """No keys, no limits, no audit: every request is the anonymous principal."""

    auth_enabled = False

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        return Principal()

    def check_model(self, principal: Principal, model: str) -> None:
        return None

    def visible_models(self, principal: Principal, models: list[str]) -> list[str]:
        return list(models)

    async def check_policy(self, principal: Principal, texts: list[str]) -> None:
        return None

    async def reserve(self, principal: Principal, model: str, tokens: int) -> Reservation:
        return Reservation(principal=principal, model=model, tokens=tokens)

    async def adjust(self, reservation: Reservation, tokens: int) -> None:
        reservation.tokens = tokens

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        return None

    async def audit_open(self, record: AuditRecord, progress: Callable[[], int]) -> None:
        return None

    async def audit(self, record: AuditRecord) -> None:
        return None

    def audit_health(self) -> AuditHealth | None:
        return None
