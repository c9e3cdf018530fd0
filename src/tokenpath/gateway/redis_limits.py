"""Rate windows, token reservations and daily quotas in Redis (`tokenpath serve --redis-url`).

Several gateways in front of the same replicas then enforce one key's limits exactly: each
reservation is one atomic Lua script (read the windows, decide, charge; see `redis_scripts`),
re-sized by another once the prompt is tokenized (the API reserves on an estimate first), and
each request's end reconciles it (gives back what was reserved but not used). The decision,
messages and `x-ratelimit-*` headers are those of the SQL store (`limiter.decide` over the
snapshot the script returns), so clients cannot tell which backend holds the counters.

When Redis cannot be reached the gateway does not guess: it fails closed, refusing requests that
need a limit check with a 503 (OpenAI body, code `rate_limits_unavailable`) and a log line, or,
with `fail_open` (`--limits-fail-open`), admits them without limits and logs that it does. Either
way the next request tries Redis again, so service resumes by itself when Redis is back. A command
that meets a dropped connection (Redis restarted since the pooled connection was opened) is sent
once more on a fresh one; the scripts are idempotent per admission, so a resend never charges or
gives back twice. Timeouts are not resent: a request waits at most about `timeout_s` for its 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from tokenpath.config import REDIS_TIMEOUT_S
from tokenpath.errors import ServiceUnavailableError
from tokenpath.gateway import limiter
from tokenpath.gateway.base import Limits
from tokenpath.gateway.redis_scripts import ADJUST, RECONCILE, RESERVE
from tokenpath.gateway.store import Admitted

log = logging.getLogger("tokenpath.gateway")

DAY_TTL_S = 2 * limiter.DAY_S  # a day's counter outlives midnight: late requests reconcile into it
REMIND_S = 30.0  # while Redis stays down, one reminder line this often (not one line per request)


def redacted(url: str) -> str:
    """The URL without credentials, for messages and logs."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class _Outage:
    """One log line when Redis becomes unreachable, a reminder every REMIND_S, one when it is back."""

    def __init__(self, where: str, fail_open: bool, clock: Callable[[], float]) -> None:
        self.where = where
        self.fail_open = fail_open
        self.clock = clock
        self.since: float | None = None
        self.last_line = 0.0
        self.requests = 0

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.requests += 1
        what = "admitting requests WITHOUT rate limits (--limits-fail-open)" if self.fail_open else \
            "refusing requests with 503 until it is back (fail closed)"
        if self.since is None:
            self.since, self.last_line, self.requests = now, now, 1
            log.error("rate limits: Redis at %s is unreachable (%s: %s); %s", self.where, type(exc).__name__,
                      exc, what)
        elif now - self.last_line >= REMIND_S:
            self.last_line = now
            log.error("rate limits: Redis at %s still unreachable after %.0f s (%d requests affected); %s",
                      self.where, now - self.since, self.requests, what)

    def recovered(self) -> None:
        if self.since is not None:
            log.warning("rate limits: Redis at %s is reachable again after %.1f s (%d requests %s meanwhile)",
                        self.where, self.clock() - self.since, self.requests,
                        "admitted without limits" if self.fail_open else "refused")
            self.since = None


class RedisLimits:
    """The `LimitsBackend` of gateways that share their limits through one Redis server."""

    def __init__(self, url: str, *, fail_open: bool = False, namespace: str = "tokenpath",
                 timeout_s: float = REDIS_TIMEOUT_S) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError
            from redis.exceptions import RedisError
        except ImportError as exc:
            raise RuntimeError("--redis-url needs the redis package: pip install 'tokenpath[redis]'") from exc

        self.where = redacted(url)
        self.fail_open = fail_open
        self.namespace = namespace
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
        # Bounded waits: a request waits at most about one of them before its 503, never hangs.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        self.client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                              retry=retry)
        self._reserve = self.client.register_script(RESERVE)
        self._reconcile = self.client.register_script(RECONCILE)
        self._adjust = self.client.register_script(ADJUST)
        self._outage = _Outage(self.where, fail_open, time.monotonic)

    def _keys(self, tenant: str, scope: str, day: int) -> list[str]:
        base = f"{self.namespace}:{{{tenant}}}:{scope}"
        return [f"{base}:win", f"{base}:tok", f"{base}:sum", f"{base}:day:{day}"]

    def _scopes(self, key_prefix: str, tenant: str, key_limits: Limits, tenant_limits: Limits,
                day: int) -> tuple[list[_Scope], list[str], list[str | int]]:
        """The two scopes, their keys, and their limits as script arguments (-1: none)."""
        scopes = [_Scope("key", key_prefix, key_limits), _Scope("tenant", tenant, tenant_limits)]
        keys = [k for s in scopes for k in self._keys(tenant, s.redis_name, day)]
        limits = [-1 if v is None else int(v) for s in scopes for v in (s.limits.rpm, s.limits.tpm,
                                                                        s.limits.daily_tokens)]
        return scopes, keys, limits

    async def reserve(self, key_prefix: str, tenant: str, key_limits: Limits, tenant_limits: Limits,
                      tokens: int, now: float) -> Admitted:
        day = limiter.day_of(now)
        scopes, keys, limits = self._scopes(key_prefix, tenant, key_limits, tenant_limits, day)
        admission_id = uuid.uuid4().hex
        args: list[str | int] = [repr(float(now)), repr(limiter.WINDOW_S), int(tokens), admission_id,
                                 DAY_TTL_S, len(scopes), *limits]
        try:
            reply = await self._reserve(keys=keys, args=args)
        except self._errors as exc:
            return self._unavailable(exc)
        self._outage.recovered()
        if _text(reply[0]) == "replay":  # a resent call that had charged already: the usage includes it
            usages = _usages(reply, scopes)
            return Admitted(limiter.Verdict(allowed=True, headers=limiter.rate_limit_headers(usages, now)),
                            admission_id, day)
        verdict = _verdict(reply, scopes, tokens, now)
        return Admitted(verdict, admission_id, day) if verdict.allowed else Admitted(verdict)

    async def adjust(self, admission_id: int | str, key_prefix: str, tenant: str, key_limits: Limits,
                     tenant_limits: Limits, day: int, reserved: int, tokens: int, now: float) -> limiter.Verdict:
        """As `GatewayStore.adjust`, in one script: a shrink always succeeds (and reports no new
        headers); a growth is decided on the usage without this admission, for `tokens` asked now
        (no second request counted); a refused growth removes the admission and its day tokens."""
        scopes, keys, limits = self._scopes(key_prefix, tenant, key_limits, tenant_limits, day)
        keys.append(f"{self.namespace}:{{{tenant}}}:adjusted:{admission_id}")
        args: list[str | int] = [repr(float(now)), repr(limiter.WINDOW_S), int(tokens), str(admission_id),
                                 int(reserved), len(scopes), *limits]
        try:
            reply = await self._adjust(keys=keys, args=args)
        except self._errors as exc:
            return self._unavailable(exc).verdict  # fail open: the estimate stays charged
        self._outage.recovered()
        if tokens <= reserved:
            return limiter.Verdict(allowed=True)
        return _verdict(reply, scopes, tokens, now)

    async def reconcile(self, admission_id: int | str, key_prefix: str, tenant: str, day: int,
                        reserved: int, used: int) -> None:
        keys = [k for scope in (f"key:{key_prefix}", "tenant") for k in self._keys(tenant, scope, day)[1:]]
        keys.append(f"{self.namespace}:{{{tenant}}}:reconciled:{admission_id}")
        try:
            await self._reconcile(keys=keys, args=[str(admission_id), int(used), int(reserved), 2])
        except self._errors as exc:
            # The reservation stays charged until it leaves the window: safe, never over the limit.
            log.error("rate limits: could not give back %d unused tokens of admission %s to Redis at %s (%s)",
                      max(0, reserved - used), admission_id, self.where, type(exc).__name__)
            return
        self._outage.recovered()

    def _unavailable(self, exc: BaseException) -> Admitted:
        self._outage.failed(exc)
        if self.fail_open:
            return Admitted(limiter.Verdict(allowed=True))  # no admission id: nothing to reconcile
        raise ServiceUnavailableError(
            f"Rate limits cannot be checked right now: the gateway's limit store (Redis at {self.where}) is "
            "unreachable, so requests are refused rather than admitted unchecked. Retry shortly.",
            code="rate_limits_unavailable", headers={"Retry-After": "1"})

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclass(frozen=True)
class _Scope:
    """One scope a request is charged to: the key or its tenant."""

    kind: str
    name: str
    limits: Limits

    @property
    def redis_name(self) -> str:  # the tenant is in every key's hash tag already
        return f"key:{self.name}" if self.kind == "key" else "tenant"


def _usages(reply: list, scopes: list[_Scope]) -> list[limiter.ScopeUsage]:
    """The per-scope usage a script replied (after its decision, status and retry_after)."""
    usages = []
    for i, s in enumerate(scopes):
        requests, used, oldest, day_tokens = (_text(v) for v in reply[3 + 4 * i: 7 + 4 * i])
        usages.append(limiter.ScopeUsage(s.kind, s.name, s.limits, int(requests), int(used),
                                         float(oldest) if oldest else None, int(day_tokens)))
    return usages


def _verdict(reply: list, scopes: list[_Scope], tokens: int, now: float) -> limiter.Verdict:
    """The verdict of a script's decision: `limiter.decide` over the usage it replied, for the
    message and headers the SQL store gives, with the script's own retry_after."""
    decision, retry_after = _text(reply[0]), float(reply[2])
    verdict = limiter.decide(_usages(reply, scopes), tokens, now)
    allowed = decision == "ok"
    if verdict.allowed != allowed or (not allowed and verdict.reason != decision):
        log.error("rate limits: the Redis script decided %r but the limiter %r on the same usage",
                  decision, verdict.reason or "ok")
        verdict.allowed = allowed
    if not allowed and decision in ("requests", "tokens"):
        verdict.retry_after = retry_after
    return verdict


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
