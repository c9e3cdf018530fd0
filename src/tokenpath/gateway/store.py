"""The gateway's durable state: tenants, keys, admissions (rate windows), daily usage, audit log.

One class over either backend of `tokenpath.gateway.db`; every method is synchronous and
short (the guard calls them through `asyncio.to_thread`). Secrets never reach this module:
it stores and returns a key's prefix, salt and digest only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenpath.config import env_database_url
from tokenpath.gateway import audit_store, limiter
from tokenpath.gateway.audit_store import AUDIT_COLUMNS, AuditOp, Instance
from tokenpath.gateway.base import AuditRecord, Limits
from tokenpath.gateway.db import Tx, connect
from tokenpath.gateway.keys import NewKey

STORE_FILE = "gateway.sqlite3"
PRUNE_EVERY = 256  # reservations between deletions of admission rows that left every window
# How long a gateway keeps a read "no keys" while no key is signalled (`keys_generation`: the
# SQLite mark, PostgreSQL's LISTEN): the bound on seeing a key the signal misses (raw SQL on SQLite;
# triggers skipped or a pooler on PostgreSQL). Keys made by tokenpath are seen by the next request
# (SQLite) or the next one after the notification arrives (PostgreSQL, any INSERT: a trigger).
NO_KEYS_RECHECK_S = 1.0


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: Limits
    models: frozenset[str] | None
    created_at: float


@dataclass(frozen=True)
class KeyRecord:
    """A key as stored: no secret, only what identifies and verifies it."""

    prefix: str
    tenant: str
    salt: str
    digest: str
    name: str | None
    models: frozenset[str] | None
    limits: Limits
    priority: int
    expires_at: float | None
    created_at: float
    last_used_at: float | None
    revoked_at: float | None
    admin: bool = False


@dataclass(frozen=True)
class Admitted:
    """The store's answer to a reservation: the verdict, and the rows to reconcile when admitted."""

    verdict: limiter.Verdict
    admission_id: int | str | None = None  # a SQL row id, or a Redis admission id
    day: int | None = None


@dataclass(frozen=True)
class UsageRow:
    day: str  # YYYY-MM-DD (UTC)
    model: str | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


_KEY_COLUMNS = ("prefix, tenant, salt, digest, name, models, rpm, tpm, daily_tokens, priority, "
                "expires_at, created_at, last_used_at, revoked_at, admin")
_ANY_KEY = "SELECT 1 FROM api_keys LIMIT 1"
_FIND_KEY = f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE prefix = ?"
_TOUCH_KEY = "UPDATE api_keys SET last_used_at = ? WHERE prefix = ?"
_TENANT = "SELECT name, rpm, tpm, daily_tokens, models, created_at FROM tenants WHERE name = ?"


def _models_out(models: frozenset[str] | None) -> str | None:
    return None if models is None else json.dumps(sorted(models))


def _models_in(text: str | None) -> frozenset[str] | None:
    return None if text is None else frozenset(json.loads(text))


def _tenant_from_row(r: tuple) -> Tenant:
    return Tenant(r[0], Limits(r[1], r[2], r[3]), _models_in(r[4]), r[5])


def _key_from_row(r: tuple) -> KeyRecord:
    return KeyRecord(r[0], r[1], r[2], r[3], r[4], _models_in(r[5]), Limits(r[6], r[7], r[8]), r[9],
                     r[10], r[11], r[12], r[13], bool(r[14]))


def resolve_store_location(data_dir: Path, database_url: str | None = None) -> str:
    """`--database-url`, else `TOKENPATH_DATABASE_URL`, else a SQLite file in the data dir."""
    url = database_url or env_database_url()
    return url if url else str(Path(data_dir) / STORE_FILE)


class GatewayStore:
    def __init__(self, location: str | Path, *, no_keys_recheck_s: float = NO_KEYS_RECHECK_S) -> None:
        self.db = connect(location)
        self.no_keys_recheck_s = no_keys_recheck_s
        self.kind = self.db.kind
        self._reservations = 0
        # A kept "no keys": (the db's `keys_generation` taken before the read, monotonic end). One
        # attribute, so a worker thread's `has_keys` and the loop never leave a mixed pair.
        self._no_keys: tuple[int, float] | None = None

    def close(self) -> None:
        self.db.close()

    # ---- tenants ---------------------------------------------------------------------------
    def put_tenant(self, name: str, limits: Limits | None, models: frozenset[str] | None, now: float,
                   *, update: bool) -> Tenant:
        """Create the tenant if missing; with `update`, also replace its default limits and models."""
        limits = limits or Limits()
        with self.db.transaction() as tx:
            exists = tx.q("SELECT 1 FROM tenants WHERE name = ?", (name,))
            if not exists:
                tx.q("INSERT INTO tenants (name, rpm, tpm, daily_tokens, models, created_at) "
                     "VALUES (?, ?, ?, ?, ?, ?)",
                     (name, limits.rpm, limits.tpm, limits.daily_tokens, _models_out(models), now))
            elif update:
                tx.q("UPDATE tenants SET rpm = ?, tpm = ?, daily_tokens = ?, models = ? WHERE name = ?",
                     (limits.rpm, limits.tpm, limits.daily_tokens, _models_out(models), name))
        tenant = self.get_tenant(name)
        assert tenant is not None
        return tenant

    def get_tenant(self, name: str) -> Tenant | None:
        with self.db.transaction() as tx:
            rows = tx.q(_TENANT, (name,))
        return _tenant_from_row(rows[0]) if rows else None

    def get_tenant_nowait(self, name: str) -> list[Tenant] | None:
        """`get_tenant` on the event loop, where the database answers at once (`read_nowait`): the
        tenant in a list (empty: none of that name); None: ask `get_tenant` off the loop. Asked
        before every request with a stored key, where the thread hop was the cost (`find_key_nowait`)."""
        rows = self.db.read_nowait(_TENANT, (name,))
        return None if rows is None else [_tenant_from_row(r) for r in rows[:1]]

    # ---- keys ------------------------------------------------------------------------------
    def add_key(self, new: NewKey, tenant: str, *, name: str | None, models: frozenset[str] | None,
                limits: Limits, priority: int, expires_at: float | None, now: float,
                admin: bool = False) -> KeyRecord:
        self.db.mark_keys()  # before the row: a gateway that sees no mark may keep its "no keys"
        with self.db.transaction() as tx:
            tx.q(f"INSERT INTO api_keys ({_KEY_COLUMNS}) VALUES ({', '.join('?' * 15)})",
                 (new.prefix, tenant, new.salt, new.digest, name, _models_out(models), limits.rpm,
                  limits.tpm, limits.daily_tokens, priority, expires_at, now, None, None, int(admin)))
        record = self.find_key(new.prefix)
        assert record is not None
        return record

    def find_key(self, prefix: str) -> KeyRecord | None:
        with self.db.transaction() as tx:
            rows = tx.q(_FIND_KEY, (prefix,))
        return _key_from_row(rows[0]) if rows else None

    def find_key_nowait(self, prefix: str) -> list[KeyRecord] | None:
        """`find_key` on the event loop, where the database answers at once (`read_nowait`): the key
        in a list (empty: no key has that prefix); None: ask `find_key` off the loop. Asked before
        every request with a stored key: on two busy cores a thread hop there (waking a worker, the
        GIL handed over and back) cost more than the read, on the request's way to its first token."""
        rows = self.db.read_nowait(_FIND_KEY, (prefix,))
        return None if rows is None else [_key_from_row(r) for r in rows[:1]]

    def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        where, params = ("WHERE tenant = ?", (tenant,)) if tenant else ("", ())
        with self.db.transaction() as tx:
            rows = tx.q(f"SELECT {_KEY_COLUMNS} FROM api_keys {where} ORDER BY created_at, prefix", params)
        return [_key_from_row(r) for r in rows]

    def has_keys(self) -> bool:
        """Any key, revoked ones included: revoking the last key must not silently turn auth off.
        A "no" is kept for `has_keys_nowait` (on PostgreSQL this, off the loop, is the read)."""
        now = time.monotonic()  # (the kept answer's age counts from before the read)
        generation = self.db.keys_generation()  # before the read: see `_answered`
        with self.db.transaction() as tx:
            rows = tx.q(_ANY_KEY)
        return self._answered(generation, rows, now)

    def has_keys_nowait(self) -> bool | None:
        """`has_keys` on the event loop, where the database answers at once (`read_nowait`); None:
        ask `has_keys` off the loop. What a gateway with no keys asks before every request: a "no"
        read is kept while the db's `keys_generation` stays the number taken before that read (SQLite:
        no key marked, one `access()`; PostgreSQL: no notification on the listener, two attribute
        reads), up to `NO_KEYS_RECHECK_S`. The read it saves was ~75 us of the request's path on two
        busy cores on SQLite (the reader's page cache reset by the audit writer's commit of the
        request before); on PostgreSQL a thread hop and a network round trip."""
        now = time.monotonic()
        generation = self.db.keys_generation()
        kept = self._no_keys
        if kept is not None and generation == kept[0] and now < kept[1]:
            return False
        rows = self.db.read_nowait(_ANY_KEY)
        return None if rows is None else self._answered(generation, rows, now)

    def _answered(self, generation: int | None, rows: list[tuple], now: float) -> bool:
        """`generation` must be taken before the read of `rows`: a key stored after it is signalled
        (the mark made, or a notification that changes the number), one stored before it is in
        `rows`. Taken after the read, a key stored between the read and the signal's start (the mark
        check, the LISTEN) would be kept out of sight."""
        if not rows and generation is not None:
            self._no_keys = (generation, now + self.no_keys_recheck_s)
        else:  # a "no" not kept: listen (if not yet) for the next; a key: nothing more to watch
            self.db.watch_keys(not rows)
        return bool(rows)

    def revoke_key(self, prefix: str, now: float) -> bool:
        with self.db.transaction() as tx:
            rows = tx.q("UPDATE api_keys SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL "
                        "RETURNING prefix", (now, prefix))
        return bool(rows)

    def touch_key(self, prefix: str, now: float) -> None:
        with self.db.transaction() as tx:
            tx.q(_TOUCH_KEY, (now, prefix))

    def touch_key_nowait(self, prefix: str, now: float) -> bool:
        """`touch_key` on the event loop, where the store can write at once (`write_nowait`);
        False: nothing written, ask `touch_key` off the loop. (Once a minute per key, on the path
        of that request.)"""
        return self.db.write_nowait(lambda tx: tx.q(_TOUCH_KEY, (now, prefix))) is not None

    # ---- rate limits -----------------------------------------------------------------------
    def reserve(self, key_prefix: str, tenant: str, key_limits: Limits, tenant_limits: Limits,
                tokens: int, now: float) -> Admitted:
        """Read both scopes' usage, decide, and record the admission: one transaction, one lock."""
        with self.db.transaction(lock_tenant=tenant) as tx:
            admitted = self._reserve(tx, key_prefix, tenant, key_limits, tenant_limits, tokens, now)
        return self._reserved(admitted, now)

    def reserve_nowait(self, key_prefix: str, tenant: str, key_limits: Limits, tenant_limits: Limits,
                       tokens: int, now: float) -> Admitted | None:
        """`reserve` on the event loop, where the store can write at once (`write_nowait`); None: ask
        `reserve` off the loop (it is not recorded). A reservation that prunes old admissions (one
        in `PRUNE_EVERY`) is left to `reserve`: a bulk delete is no work for the loop."""
        if (self._reservations + 1) % PRUNE_EVERY == 0:
            return None
        done = self.db.write_nowait(
            lambda tx: self._reserve(tx, key_prefix, tenant, key_limits, tenant_limits, tokens, now))
        return None if done is None else self._reserved(done[0], now)

    def _reserve(self, tx: Tx, key_prefix: str, tenant: str, key_limits: Limits, tenant_limits: Limits,
                 tokens: int, now: float) -> Admitted:
        day = limiter.day_of(now)
        usages = [
            self._usage(tx, "key", key_prefix, key_limits, now, day),
            self._usage(tx, "tenant", tenant, tenant_limits, now, day),
        ]
        verdict = limiter.decide(usages, tokens, now)
        if not verdict.allowed:
            if verdict.reason in ("requests", "tokens") and verdict.scope is not None:
                verdict.retry_after = self._retry_after(tx, verdict, tokens, now)
            return Admitted(verdict)
        admission_id = tx.q("INSERT INTO admissions (key_prefix, tenant, at, tokens) VALUES (?, ?, ?, ?) "
                            "RETURNING id", (key_prefix, tenant, now, tokens))[0][0]
        for scope in (f"key:{key_prefix}", f"tenant:{tenant}"):
            tx.q("INSERT INTO daily_usage (scope, day, requests, tokens) VALUES (?, ?, 1, ?) "
                 "ON CONFLICT (scope, day) DO UPDATE SET requests = daily_usage.requests + 1, "
                 "tokens = daily_usage.tokens + excluded.tokens", (scope, day, tokens))
        return Admitted(verdict, admission_id, day)

    def _reserved(self, admitted: Admitted, now: float) -> Admitted:
        """An admission recorded: every `PRUNE_EVERY`th prunes the admissions out of every window."""
        if admitted.admission_id is not None:
            self._reservations += 1
            if self._reservations % PRUNE_EVERY == 0:
                self.prune(now)
        return admitted

    def reconcile(self, admission_id: int, key_prefix: str, tenant: str, day: int, reserved: int,
                  used: int) -> None:
        """Replace the reservation by the real use, in the window and in the day it was charged to."""
        with self.db.transaction() as tx:
            self._reconcile(tx, admission_id, key_prefix, tenant, day, reserved, used)

    def reconcile_nowait(self, admission_id: int, key_prefix: str, tenant: str, day: int, reserved: int,
                         used: int) -> bool:
        """`reconcile` on the event loop, where the store can write at once (`write_nowait`), as
        `reserve_nowait`: True when done; False: ask `reconcile` off the loop (nothing was changed).
        Every request with a stored key reconciles; its thread hop (a worker woken, then the loop)
        cost more CPU on two busy cores than the two-row update (issue 37)."""
        done = self.db.write_nowait(
            lambda tx: self._reconcile(tx, admission_id, key_prefix, tenant, day, reserved, used))
        return done is not None

    def _reconcile(self, tx: Tx, admission_id: int, key_prefix: str, tenant: str, day: int, reserved: int,
                   used: int) -> None:
        delta = used - reserved
        tx.q("UPDATE admissions SET tokens = ? WHERE id = ?", (used, admission_id))
        # Key row before tenant row, as `reserve` takes them: no lock-order deadlock on PostgreSQL.
        for scope in (f"key:{key_prefix}", f"tenant:{tenant}") if delta else ():
            tx.q("UPDATE daily_usage SET tokens = tokens + ? WHERE scope = ? AND day = ?", (delta, scope, day))

    def adjust(self, admission_id: int, key_prefix: str, tenant: str, key_limits: Limits, tenant_limits: Limits,
               day: int, reserved: int, tokens: int, now: float) -> limiter.Verdict:
        """Re-size an admission reserved on an estimate. Shrinking always succeeds; growing is decided
        as if this admission were not in the window and `tokens` were asked for now (one transaction,
        the tenant lock as in `reserve`). A refusal deletes the admission and its day counts."""
        with self.db.transaction(lock_tenant=tenant) as tx:
            return self._adjust(tx, admission_id, key_prefix, tenant, key_limits, tenant_limits, day, reserved,
                                tokens, now)

    def adjust_nowait(self, admission_id: int, key_prefix: str, tenant: str, key_limits: Limits,
                      tenant_limits: Limits, day: int, reserved: int, tokens: int,
                      now: float) -> limiter.Verdict | None:
        """`adjust` on the event loop, where the store can write at once (`write_nowait`); None: ask
        `adjust` off the loop (nothing was changed)."""
        done = self.db.write_nowait(lambda tx: self._adjust(tx, admission_id, key_prefix, tenant, key_limits,
                                                            tenant_limits, day, reserved, tokens, now))
        return None if done is None else done[0]

    def _adjust(self, tx: Tx, admission_id: int, key_prefix: str, tenant: str, key_limits: Limits,
                tenant_limits: Limits, day: int, reserved: int, tokens: int, now: float) -> limiter.Verdict:
        verdict = limiter.Verdict(allowed=True)
        if tokens > reserved:
            usages = [self._usage(tx, "key", key_prefix, key_limits, now, day),
                      self._usage(tx, "tenant", tenant, tenant_limits, now, day)]
            for u in usages:  # take this admission back out, then decide afresh
                u.requests, u.tokens, u.day_tokens = u.requests - 1, u.tokens - reserved, u.day_tokens - reserved
            verdict = limiter.decide(usages, tokens, now)
        if verdict.allowed:
            tx.q("UPDATE admissions SET tokens = ? WHERE id = ?", (tokens, admission_id))
            requests, delta = 0, tokens - reserved
        else:
            tx.q("DELETE FROM admissions WHERE id = ?", (admission_id,))
            requests, delta = -1, -reserved
            # After the delete: the refused admission frees nothing when it would have left the window.
            if verdict.reason in ("requests", "tokens") and verdict.scope is not None:
                verdict.retry_after = self._retry_after(tx, verdict, tokens, now)
        for scope in (f"key:{key_prefix}", f"tenant:{tenant}"):
            tx.q("UPDATE daily_usage SET requests = requests + ?, tokens = tokens + ? WHERE scope = ? AND day = ?",
                 (requests, delta, scope, day))
        return verdict

    def prune(self, now: float) -> None:
        with self.db.transaction() as tx:
            tx.q("DELETE FROM admissions WHERE at <= ?", (now - 2 * limiter.WINDOW_S,))

    def _usage(self, tx: Tx, kind: str, name: str, limits: Limits, now: float, day: int) -> limiter.ScopeUsage:
        column = "key_prefix" if kind == "key" else "tenant"
        u = limiter.ScopeUsage(kind, name, limits)
        if limits.rpm is not None or limits.tpm is not None:
            count, total, oldest = tx.q(
                f"SELECT COUNT(*), COALESCE(SUM(tokens), 0), MIN(at) FROM admissions "
                f"WHERE {column} = ? AND at > ?", (name, now - limiter.WINDOW_S))[0]
            u.requests, u.tokens, u.oldest_at = int(count), int(total), oldest
        if limits.daily_tokens is not None:
            rows = tx.q("SELECT tokens FROM daily_usage WHERE scope = ? AND day = ?", (f"{kind}:{name}", day))
            u.day_tokens = int(rows[0][0]) if rows else 0
        return u

    def _retry_after(self, tx: Tx, verdict: limiter.Verdict, tokens: int, now: float) -> float:
        u = verdict.scope
        assert u is not None and verdict.reason is not None
        column = "key_prefix" if u.kind == "key" else "tenant"
        rows = tx.q(f"SELECT at, tokens FROM admissions WHERE {column} = ? AND at > ? ORDER BY at",
                    (u.name, now - limiter.WINDOW_S))
        more_requests, more_tokens = limiter.excess(u, verdict.reason, tokens)
        return limiter.sliding_retry_after([(float(a), int(t)) for a, t in rows], now, more_requests, more_tokens)

    # ---- audit -----------------------------------------------------------------------------
    def write_audit(self, record: AuditRecord) -> None:
        """One finished request's row, at once (the serving path goes through `AuditWriter`)."""
        with self.db.transaction() as tx:
            audit_store.write_batch(tx, [AuditOp("close", record)], None, record.time)

    def write_audit_batch(self, ops: Sequence[AuditOp], instance: Instance, now: float) -> None:
        """Open and close rows of many requests in one transaction (idempotent: a retry is safe)."""
        with self.db.transaction() as tx:
            audit_store.write_batch(tx, ops, instance, now)

    def reclaim_space(self) -> bool:
        """A write failed (perhaps for space): free what the database holds back (its reserve, a
        WAL to truncate). Whether anything was freed; never raises."""
        try:
            return self.db.reclaim_space()
        except Exception:  # noqa: BLE001 - a best effort before the next retry
            return False

    def keep_reserve(self) -> None:
        """Hold the store's reserve of disk once more, if there is room (a best effort)."""
        self.db.keep_reserve()

    @property
    def reserve_spent(self) -> bool:
        """The disk filled and the reserve was given back; not made again yet (no room)."""
        return self.db.reserve_spent

    def write_audit_progress(self, updates: Sequence[tuple[str, int]], instance: Instance, now: float) -> None:
        with self.db.transaction() as tx:
            audit_store.write_progress(tx, updates, instance, now)

    def close_crashed_audit(self, me: Instance, now: float, stale_s: float) -> int:
        """Close the rows gone gateway instances left open, as `gateway_crash`; how many."""
        with self.db.transaction() as tx:
            return audit_store.close_crashed(tx, me, now, stale_s)

    def forget_instance(self, instance: Instance) -> None:
        with self.db.transaction() as tx:
            audit_store.forget_instance(tx, instance)

    def query_audit(self, *, tenant: str | None = None, since: float | None = None, until: float | None = None,
                    request_id: str | None = None, client_request_id: str | None = None,
                    limit: int | None = 1000) -> list[AuditRecord]:
        where, params = self._audit_filter(tenant, since, until, request_id, client_request_id)
        sql = f"SELECT {', '.join(AUDIT_COLUMNS)} FROM audit_log {where} ORDER BY time, id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self.db.transaction() as tx:
            rows = tx.q(sql, params)
        return [AuditRecord(**dict(zip(AUDIT_COLUMNS, r, strict=True))) for r in rows]

    def usage(self, *, tenant: str | None = None, since: float | None = None,
              until: float | None = None) -> list[UsageRow]:
        """Tokens summed by UTC day and model, from the audit log (what was actually used)."""
        where, params = self._audit_filter(tenant, since, until)
        sql = (f"SELECT day, model, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens) "
               f"FROM audit_log {where} GROUP BY day, model ORDER BY day, model")
        with self.db.transaction() as tx:
            rows = tx.q(sql, params)
        return [UsageRow(_day_text(int(d)), m, int(n), int(p or 0), int(c or 0), int(o or 0))
                for d, m, n, p, c, o in rows]

    @staticmethod
    def _audit_filter(tenant: str | None, since: float | None, until: float | None,
                      request_id: str | None = None, client_request_id: str | None = None,
                      ) -> tuple[str, Sequence[Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        for clause, value in (("tenant = ?", tenant), ("time >= ?", since), ("time < ?", until),
                              ("request_id = ?", request_id), ("client_request_id = ?", client_request_id)):
            if value is not None:
                clauses.append(clause)
                params.append(value)
        return ("WHERE " + " AND ".join(clauses) if clauses else ""), params


def _day_text(day: int) -> str:
    import datetime as dt

    return (dt.date(1970, 1, 1) + dt.timedelta(days=day)).isoformat()
