"""Stored Responses API responses (`store: true`), kept per tenant in the gateway's store.

A row is one response and the whole conversation that led to it (its input items, the earlier
turns of a `previous_response_id` chain included), as JSON, so a chain is one read. Rows are
keyed by (id, tenant): a lookup under another tenant finds nothing, exactly as an unknown id does.
Rows older than the retention limit are never returned and are deleted as new ones are written.
Synchronous, like `GatewayStore`: the API calls it through `asyncio.to_thread`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Protocol

from tokenpath.gateway.store import GatewayStore

PRUNE_EVERY = 64  # writes between deletions of expired rows


class ResponseStore(Protocol):
    def put(self, rid: str, tenant: str, now: float, record: dict) -> None: ...

    def get(self, rid: str, tenant: str, now: float) -> dict | None: ...

    def delete(self, rid: str, tenant: str) -> bool: ...


class SqlResponses:
    """The gateway's SQL store (SQLite or PostgreSQL), table `stored_responses` (migration 5)."""

    def __init__(self, store: GatewayStore, retention_s: float) -> None:
        self.db = store.db
        self.retention_s = retention_s
        self._writes = 0

    def put(self, rid: str, tenant: str, now: float, record: dict) -> None:
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        self._writes += 1
        with self.db.transaction() as tx:
            tx.q("INSERT INTO stored_responses (id, tenant, created_at, size, body) VALUES (?, ?, ?, ?, ?)",
                 (rid, tenant, now, len(text.encode()), text))
            if self._writes % PRUNE_EVERY == 1:
                tx.q("DELETE FROM stored_responses WHERE created_at < ?", (now - self.retention_s,))

    def get(self, rid: str, tenant: str, now: float) -> dict | None:
        with self.db.transaction() as tx:
            rows = tx.q("SELECT body FROM stored_responses WHERE id = ? AND tenant = ? AND created_at >= ?",
                        (rid, tenant, now - self.retention_s))
        return json.loads(rows[0][0]) if rows else None

    def delete(self, rid: str, tenant: str) -> bool:
        with self.db.transaction() as tx:
            rows = tx.q("DELETE FROM stored_responses WHERE id = ? AND tenant = ? RETURNING id", (rid, tenant))
        return bool(rows)


class MemoryResponses:
    """For an app built without a gateway store (tests, `OpenGuard`): the newest `capacity` rows
    in memory, with the same retention and tenant rules."""

    def __init__(self, retention_s: float, capacity: int = 1024) -> None:
        self.retention_s = retention_s
        self.capacity = capacity
        self._rows: OrderedDict[str, tuple[str, float, str]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, tenant: str, now: float, record: dict) -> None:
        with self._lock:
            self._rows[rid] = (tenant, now, json.dumps(record, ensure_ascii=False))
            while len(self._rows) > self.capacity:
                self._rows.popitem(last=False)

    def get(self, rid: str, tenant: str, now: float) -> dict | None:
        with self._lock:
            row = self._rows.get(rid)
        if row is None or row[0] != tenant or row[1] < now - self.retention_s:
            return None
        return json.loads(row[2])

    def delete(self, rid: str, tenant: str) -> bool:
        with self._lock:
            row = self._rows.get(rid)
            if row is None or row[0] != tenant:
                return False
            del self._rows[rid]
            return True


def response_store(guard: object, retention_s: float) -> ResponseStore:
    """The guard's SQL store when it has one (`tokenpath serve` always does), else memory."""
    store = getattr(guard, "store", None)
    if isinstance(store, GatewayStore):
        return SqlResponses(store, retention_s)
    return MemoryResponses(retention_s)
