"""`Gateway`: the real `RequestGuard` — keys, model access, limits, policy and the audit log.

The HTTP layer calls it at fixed points of each request (see `tokenpath.gateway.base`). Errors are
raised as the typed exceptions of `tokenpath.errors`; the API layer maps them to responses.

Secrets: the presented credential lives only in a local variable of `authenticate`. Messages,
log lines and audit rows name a key by its non-secret prefix, and only after the full key has
been verified (so a guessed or mistyped key is never echoed, not even in part).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from tokenpath.errors import (
    AuthenticationError,
    InvalidRequestError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
)
from tokenpath.gateway.audit_store import Instance
from tokenpath.gateway.audit_writer import STALE_S, AuditWriter, describe_error
from tokenpath.gateway.base import AuditHealth, AuditRecord, Limits, Principal, Reservation
from tokenpath.gateway.keys import hash_key, key_prefix, looks_like_key, verify_key
from tokenpath.gateway.limiter import Verdict
from tokenpath.gateway.limits_backend import LimitsBackend, StoreLimits
from tokenpath.gateway.policy import PolicyHook
from tokenpath.gateway.store import GatewayStore, KeyRecord

log = logging.getLogger("tokenpath.gateway")

Clock = Callable[[], float]  # wall-clock seconds since the epoch; injectable for windows and days
R = TypeVar("R")
TOUCH_EVERY_S = 60.0  # `last used` is refreshed at most this often per key (one write, not one per request)
_HOW = "Pass a tokenpath key as 'Authorization: Bearer <key>' or in an 'api-key' or 'x-api-key' header."
_MISSING = "Missing API key. " + _HOW
_INVALID = "Invalid API key. " + _HOW
_DUMMY_SALT, _DUMMY_DIGEST = "00" * 16, "0" * 64  # no key hashes to this digest


# The headers a key may come in besides `Authorization: Bearer`: Azure OpenAI's `api-key`, and
# `x-api-key`, what Anthropic's SDKs and Claude Code send (/v1/messages).
KEY_HEADERS = ("api-key", "x-api-key")
_CREDENTIAL_NAMES_STR = frozenset(("authorization", *KEY_HEADERS))
_CREDENTIAL_NAMES = {name.encode("latin-1"): name for name in _CREDENTIAL_NAMES_STR}


def _credential_headers(headers: Mapping[str, str]) -> dict[str, list[str]]:
    """Every value of `authorization` and the `KEY_HEADERS`, duplicates included, by lowercase
    name, in one pass over the headers: Starlette's `Headers` keeps duplicates in `raw` (three
    `getlist` scans, each decoding every header, were ~4 us of each request's path), a plain dict
    (tests, internal callers) has at most one per spelling."""
    found: dict[str, list[str]] = {}
    raw = getattr(headers, "raw", None)
    if raw is not None:
        for k, v in raw:
            name = _CREDENTIAL_NAMES.get(k.lower())  # (httpx's `raw` keeps the sender's case)
            if name is not None:
                found.setdefault(name, []).append(v.decode("latin-1"))
        return found
    for k, v in headers.items():
        if k.lower() in _CREDENTIAL_NAMES_STR:
            found.setdefault(k.lower(), []).append(v)
    return found


def credential_from(headers: Mapping[str, str]) -> str | None:
    """The key from `Authorization: Bearer <key>`, else from `api-key` or `x-api-key`; header names
    case-insensitive.

    Ambiguous credentials are a 400, never resolved by order: with two `Authorization` headers (or
    two different keys in `Authorization`, `api-key` and `x-api-key`) a proxy and this server could
    each pick a different one, so whichever "wins" would be a silent choice of identity. The same key
    sent twice (an Anthropic client given a bearer token and the key) is one key.
    """
    sent = _credential_headers(headers)
    if not sent:  # (no credential at all: most requests to a gateway with auth off)
        return None
    auths = [v.strip() for v in sent.get("authorization", ())]
    if len(auths) > 1:
        raise InvalidRequestError(f"The request has {len(auths)} 'Authorization' headers; send exactly one.",
                                  param="Authorization", code="ambiguous_credentials")
    given: list[tuple[str, str]] = []  # (header, key)
    if auths and auths[0]:
        scheme, _, value = auths[0].partition(" ")
        given.append(("Authorization", value.strip() if scheme.lower() == "bearer" else ""))
    for name in KEY_HEADERS:
        values = [v.strip() for v in sent.get(name, ())]
        if len(values) > 1:
            raise InvalidRequestError(f"The request has {len(values)} '{name}' headers; send exactly one.",
                                      param=name, code="ambiguous_credentials")
        given.extend((name, v) for v in values)
    if len({key for _, key in given}) > 1:
        names = " and ".join(f"'{name}'" for name, _ in given)
        raise InvalidRequestError(f"The request carries different keys in {names}; send one of them.",
                                  param=given[0][0], code="ambiguous_credentials")
    return given[0][1] if given else None


def store_unavailable(exc: Exception, what: str) -> ServiceUnavailableError:
    """A 503 for a store that cannot be read or written (never a 500 naming only the exception class)."""
    return ServiceUnavailableError(f"The gateway's store is unreachable ({type(exc).__name__}); {what}. Retry later.",
                                   code="store_unavailable", headers={"Retry-After": "1"})


STATIC_TENANT = "default"  # the tenant of `serve --api-key` keys


async def _read(nowait: Callable[[], list[R] | None], off_loop: Callable[[], R | None]) -> R | None:
    """A store read asked before every request with a stored key (the key, its tenant): on the
    event loop where the store answers at once (SQLite's `read_nowait`), else off it (PostgreSQL,
    or SQLite's reader busy), where its failure is raised. On two busy cores the key's and the
    tenant's reads took 3.3 ms p50 through threads, 0.29 ms on the loop (the first thread hop of a
    request pays a worker's wake-up and the loop's), on the request's way to its first token."""
    found = nowait()
    if found is None:
        return await asyncio.to_thread(off_loop)
    return found[0] if found else None


def _raise_refusal(verdict: Verdict) -> None:
    if verdict.reason == "too_large":
        raise InvalidRequestError(verdict.message, param="max_tokens", code="rate_limit_exceeded")
    if not verdict.allowed:
        raise RateLimitError(verdict.message, retry_after=verdict.retry_after, code="rate_limit_exceeded",
                             headers=verdict.headers)


class Gateway:
    """Keys and audit in a `GatewayStore`; with no key in the store, every request is anonymous.
    Limits are charged to `limits` (default: the same store; `RedisLimits` for shared Redis)."""

    def __init__(self, store: GatewayStore, *, clock: Clock = time.time, policy: PolicyHook | None = None,
                 log_text: bool = False, static_keys: Sequence[str] = (),
                 limits: LimitsBackend | None = None) -> None:
        self.store = store
        self.limits: LimitsBackend = limits or StoreLimits(store)
        # `serve --api-key` keys, vLLM style: kept only as salted digests, like stored keys.
        self._static = [(salt := secrets.token_hex(16), hash_key(k, salt)) for k in static_keys if k]
        self.clock = clock
        self.policy = policy
        self.log_text = log_text
        self._keys_exist = False  # once true it stays true: key rows are revoked, never deleted
        self._touched: dict[str, float] = {}
        self._store_down_logged = False
        self._keys_checked = False  # the store has answered has_keys at least once (auth off only then)
        self.audit_writer = AuditWriter(store, Instance.current(), clock=clock)
        self._close_crashed()

    def _close_crashed(self) -> None:
        """Rows a crashed gateway left open are closed as `gateway_crash` before this one serves."""
        try:
            n = self.store.close_crashed_audit(self.audit_writer.instance, self.clock(), STALE_S)
        except Exception as exc:  # noqa: BLE001 - a store failing now is retried by the writer later
            log.error("could not close the audit rows of crashed gateways: %s: %s", type(exc).__name__, exc)
            return
        if n:
            log.warning("closed %d audit rows left open by a crashed gateway as gateway_crash", n)

    @property
    def auth_enabled(self) -> bool:
        if self._static:
            return True
        if not self._keys_exist:
            try:
                self._keys_exist = self.store.has_keys()
                self._keys_checked = True
            except Exception as exc:  # noqa: BLE001 - as in `authenticate`
                if not self._keys_checked:
                    return True  # never seen the store answer: keys may exist, so operator endpoints stay shut
                self._store_down(exc)
        return self._keys_exist

    def _store_down(self, exc: Exception) -> None:
        if not self._store_down_logged:
            self._store_down_logged = True
            log.error("gateway store unreachable (%s): no keys existed at the last check, so requests stay "
                      "anonymous until it is back", describe_error(exc))

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        secret = credential_from(headers)  # ambiguous credentials are a 400 even with auth off
        if not self._static and not self._keys_exist:
            try:  # (on the loop where the store answers at once: a thread hop is most of this check)
                has_keys = self.store.has_keys_nowait()
                if has_keys is None:
                    has_keys = await asyncio.to_thread(self.store.has_keys)
            except Exception as exc:  # noqa: BLE001
                if not self._keys_checked:  # fail closed: never seen the store say there are no keys
                    raise store_unavailable(exc, "API keys cannot be checked") from None
                # No key was there at the last look, and none can be made while the store is down:
                # auth stays off (the audit writer reports the outage; this is logged once per outage).
                self._store_down(exc)
                return Principal()
            self._store_down_logged = False
            self._keys_checked = True
            if not has_keys:
                return Principal()
            self._keys_exist = True
        static = self._static_principal(secret)
        if static is not None:
            return static
        record = await self._verified_key(secret)
        now = self.clock()
        if record.revoked_at is not None:
            raise AuthenticationError(f"API key {record.prefix}... has been revoked.", code="invalid_api_key")
        if record.expires_at is not None and record.expires_at <= now:
            raise AuthenticationError(f"API key {record.prefix}... has expired.", code="invalid_api_key")
        if now - self._touched.get(record.prefix, float("-inf")) >= TOUCH_EVERY_S:
            self._touched[record.prefix] = now
            try:  # `last used` is informational: a store that cannot be written must not fail the request
                if not self.store.touch_key_nowait(record.prefix, now):
                    await asyncio.to_thread(self.store.touch_key, record.prefix, now)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not record the last use of key %s...: %s", record.prefix, type(exc).__name__)
        return await self._principal(record)

    def _static_principal(self, secret: str | None) -> Principal | None:
        """A `--api-key` key: the operator's own, so admin and without limits, in tenant 'default'.
        Every static digest is compared (no early exit), so timing does not tell which matched."""
        if not secret or not self._static:
            return None
        matches = [verify_key(secret, salt, digest) for salt, digest in self._static]
        if not any(matches):
            return None
        return Principal(tenant=STATIC_TENANT, key_prefix=f"static-{matches.index(True) + 1}", admin=True)

    async def _verified_key(self, secret: str | None) -> KeyRecord:
        """The stored key the credential proves, or a 401 that echoes nothing of the credential."""
        if not secret:
            raise AuthenticationError(_MISSING, code="invalid_api_key")
        if not looks_like_key(secret):
            raise AuthenticationError(_INVALID, code="invalid_api_key")
        prefix = key_prefix(secret)
        try:
            record = await _read(lambda: self.store.find_key_nowait(prefix), lambda: self.store.find_key(prefix))
        except Exception as exc:  # noqa: BLE001 - fail closed: a key that cannot be checked is not accepted
            raise store_unavailable(exc, "API keys cannot be checked") from None
        # An unknown prefix still costs one hash and compare, so timing tells little about which exist.
        salt, digest = (record.salt, record.digest) if record else (_DUMMY_SALT, _DUMMY_DIGEST)
        if not verify_key(secret, salt, digest) or record is None:
            raise AuthenticationError(_INVALID, code="invalid_api_key")
        return record

    async def _principal(self, record: KeyRecord) -> Principal:
        """Key settings combined with its tenant's: limits tightened, model lists intersected."""
        try:
            tenant = await _read(lambda: self.store.get_tenant_nowait(record.tenant),
                                 lambda: self.store.get_tenant(record.tenant))
        except Exception as exc:  # noqa: BLE001
            raise store_unavailable(exc, "API keys cannot be checked") from None
        tenant_limits = tenant.limits if tenant else Limits()
        models = record.models
        if tenant is not None and tenant.models is not None:
            models = tenant.models if models is None else models & tenant.models
        return Principal(
            tenant=record.tenant, key_prefix=record.prefix, allowed_models=models,
            priority=record.priority, max_priority=record.priority,
            key_limits=record.limits.tightened_by(tenant_limits), tenant_limits=tenant_limits,
            admin=record.admin,
        )

    def check_model(self, principal: Principal, model: str) -> None:
        if principal.allowed_models is not None and model not in principal.allowed_models:
            raise PermissionDeniedError(
                f"The key {principal.key_prefix}... (tenant {principal.tenant!r}) may not use model {model!r}.",
                param="model", code="model_not_allowed",
            )

    def visible_models(self, principal: Principal, models: list[str]) -> list[str]:
        if principal.allowed_models is None:
            return list(models)
        return [m for m in models if m in principal.allowed_models]

    async def check_policy(self, principal: Principal, texts: list[str]) -> None:
        if self.policy is None:
            return
        reason = await self.policy.check(principal, texts)
        if reason:
            raise InvalidRequestError(reason, code="content_policy_violation")

    async def reserve(self, principal: Principal, model: str, tokens: int) -> Reservation:
        """Charge prompt + max_tokens before any work is queued; refuse with 429 over a limit."""
        if principal.key_limits is None or principal.key_prefix is None:  # anonymous (auth off) or a static key:
            return Reservation(principal=principal, model=model, tokens=tokens)  # no limits to hold
        admitted = await self.limits.reserve(principal.key_prefix, principal.tenant, principal.key_limits,
                                             principal.tenant_limits or Limits(), tokens, self.clock())
        _raise_refusal(admitted.verdict)
        verdict = admitted.verdict
        return Reservation(principal=principal, model=model, tokens=tokens, headers=verdict.headers,
                           admission_id=admitted.admission_id, day=admitted.day)

    async def adjust(self, reservation: Reservation, tokens: int) -> None:
        """Replace a reservation made on an estimate (before tokenizing) by the exact count. Growth is
        decided again under the store's lock, as if the exact count had been asked for at first, so
        limits stay exact; a refused growth removes the admission and raises like `reserve`."""
        if reservation.admission_id is None or reservation.day is None or tokens == reservation.tokens:
            reservation.tokens = tokens
            return
        p = reservation.principal
        assert p.key_prefix is not None
        verdict = await self.limits.adjust(reservation.admission_id, p.key_prefix, p.tenant, p.key_limits or Limits(),
                                           p.tenant_limits or Limits(), reservation.day, reservation.tokens, tokens,
                                           self.clock())
        reservation.headers = verdict.headers or reservation.headers  # the response reports the latest state
        if not verdict.allowed:
            reservation.reconciled = True  # the admission is gone: nothing to give back at the end
            _raise_refusal(verdict)
        reservation.tokens = tokens

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        """Return the unused part of a reservation (idempotent: the second call does nothing)."""
        if reservation.reconciled or reservation.admission_id is None or reservation.day is None:
            return
        reservation.reconciled = True
        p = reservation.principal
        assert p.key_prefix is not None
        await self.limits.reconcile(reservation.admission_id, p.key_prefix, p.tenant, reservation.day,
                                    reservation.tokens, max(0, int(used_tokens)))

    async def audit_open(self, record: AuditRecord, progress: Callable[[], int]) -> None:
        """Open the request's row at admission (status 0, `open_by` this instance); `progress` says
        its completion tokens so far, written every few seconds (what a crash is closed with)."""
        if not self.log_text:
            record.prompt_text = record.completion_text = None
        record.audit_key = record.audit_key or uuid.uuid4().hex
        await self.audit_writer.open(record, progress)

    async def audit(self, record: AuditRecord) -> None:
        """Close the request's row (or write it whole when none was opened). Never raises: it runs in
        the API's `finally`. A store that cannot be written spools the row (`AuditWriter`)."""
        if not self.log_text:
            record.prompt_text = record.completion_text = None
        record.audit_key = record.audit_key or uuid.uuid4().hex
        await self.audit_writer.close(record)

    def audit_health(self) -> AuditHealth:
        return self.audit_writer.health()

    def close(self) -> None:
        self.store.close()

    async def aclose(self) -> None:
        """Write the spooled audit rows (a few seconds at most), close the limits backend (its
        connections live on the event loop), then the store."""
        try:
            await self.audit_writer.aclose()
            with contextlib.suppress(Exception):  # a failing store keeps the instance: rows may be open
                await asyncio.to_thread(self.store.forget_instance, self.audit_writer.instance)
            await self.limits.aclose()
        finally:
            await asyncio.to_thread(self.store.close)
