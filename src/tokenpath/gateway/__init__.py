"""Who may ask, and how much: API keys, tenants, model access, rate limits, quotas, audit log."""

from __future__ import annotations

from pathlib import Path

from tokenpath.gateway.base import AuditRecord, Limits, OpenGuard, Principal, RequestGuard, Reservation
from tokenpath.gateway.gateway import Clock, Gateway
from tokenpath.gateway.policy import DenyListPolicy, PolicyHook, load_policy
from tokenpath.gateway.store import GatewayStore, resolve_store_location

__all__ = [
    "AuditRecord", "Clock", "DenyListPolicy", "Gateway", "GatewayStore", "Limits", "OpenGuard", "PolicyHook",
    "Principal", "RequestGuard", "Reservation", "open_gateway",
]


def open_gateway(
    data_dir: Path,
    database_url: str | None = None,
    *,
    clock: Clock | None = None,
    policy: str | PolicyHook | None = None,
    log_text: bool | None = None,
    static_keys: list[str] | None = None,
    redis_url: str | None = None,
    limits_fail_open: bool = False,
    redis_timeout: float | None = None,
) -> Gateway:
    """The guard `tokenpath serve` puts in front of its routes.

    The store is `database_url` (`postgresql://...`), else `TOKENPATH_DATABASE_URL`, else a
    SQLite file in `data_dir`. With no key in it, auth is off (every request is anonymous) but
    audit rows are still written. `policy`: a PolicyHook, `deny-list:PATH` or `module:attribute`.
    `log_text`: store prompt and completion text in audit rows (off by default).
    `redis_url` (else TOKENPATH_REDIS_URL): rate windows, reservations and daily quotas in Redis,
    shared by every gateway pointed at it; keys and audit stay in the store. Redis unreachable:
    503 (fail closed), or admit without limits with `limits_fail_open`; `redis_timeout`: seconds a
    check waits on Redis before it counts as unreachable (default `config.REDIS_TIMEOUT_S`).
    Unset options come from the environment, so an operator can turn them on for `serve`:
    TOKENPATH_POLICY (same forms as `policy`) and TOKENPATH_AUDIT_TEXT=1.
    `static_keys`: `serve --api-key` keys (vLLM's static keys): they turn auth on, act as admin keys
    of tenant 'default' with no limits, and stored keys keep working beside them.
    """
    import time

    from tokenpath.config import env_audit_text, env_policy, env_redis_url

    if policy is None:
        policy = env_policy()
    if log_text is None:
        log_text = env_audit_text()
    redis_url = redis_url or env_redis_url()
    limits = None
    if redis_url:
        from tokenpath.gateway.redis_limits import RedisLimits

        limits = RedisLimits(redis_url, fail_open=limits_fail_open,
                             **({} if redis_timeout is None else {"timeout_s": redis_timeout}))
    store = GatewayStore(resolve_store_location(Path(data_dir), database_url))
    return Gateway(store, clock=clock or time.time, policy=load_policy(policy), log_text=log_text,
                   static_keys=static_keys or (), limits=limits)
