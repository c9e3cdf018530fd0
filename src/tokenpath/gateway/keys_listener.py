"""PostgreSQL's signal that a key was stored: LISTEN on the channel the `api_keys` trigger notifies.

A gateway with no keys asks "any key?" before every request (`GatewayStore.has_keys_nowait`). On
SQLite a mark file answers "none stored since" with one `access()`; gateways on several hosts share
a PostgreSQL store, so there the signal is the database's own: migration 7 adds a statement-level
AFTER INSERT trigger on `api_keys` that runs `pg_notify(KEYS_CHANNEL, '')`. It fires for every way
a row gets in (the store, raw SQL, COPY, another tokenpath at this schema version), and NOTIFY is
transactional: it is delivered at the inserting transaction's commit, when the row is visible.

`KeysListener.generation` is what a kept "no keys" is checked against: None while nothing is
listening (not yet connected, the connection lost, closed), otherwise a number that changes at each
notification and at each (re)connection. A reader takes it *before* its read of `api_keys` and keeps
the read's "no" only while it is still the same number (not None). That order is the point: a
number exists only once LISTEN is in effect, so a key committed after the number was taken is
notified to this listener (and the number moves on), and one committed before is seen by the read.
Taken after the read instead, a key committed between the read and the LISTEN would be missed for
as long as the answer is kept (tests/gateway/test_pg_no_keys_kept.py shows both orders).

The channel is database-wide (schemas do not scope it): a key stored in another schema's store only
costs this gateway one read. A notification is never missed while the number holds, but paths that
skip triggers (`session_replication_role = replica`: pg_restore --disable-triggers, a logical
replication subscriber) or a transaction-pooling PgBouncer (LISTEN lands on a pooled server
connection) are not signalled at all, and a link that dies without a reset leaves the listener
waiting on a silent socket: the store's `NO_KEYS_RECHECK_S` still bounds a kept answer (every kept
"no" is a real read at most that old), so these cost staleness up to that bound, never more.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from typing import Any

KEYS_CHANNEL = "tokenpath_keys"
RETRY_FIRST_S = 0.5  # the wait before reconnecting a listener that failed, doubled per failure ...
RETRY_MAX_S = 30.0  # ... up to this (a hot standby refuses LISTEN: one attempt per 30 s, not a loop)


class KeysListener:
    """One autocommit connection of its own that LISTENs on `KEYS_CHANNEL`, in a daemon thread.

    The thread sleeps in `select()` on the connection's socket and a wake-up socket pair (no
    polling, no timeout while connected); `close()` wakes it and waits briefly. It is a daemon, so
    it never keeps the process alive, and `close()` does not hang on a connect in progress. Only
    the thread writes `generation` (one attribute: readers see a whole value, never a torn pair)."""

    def __init__(self, connect: Any) -> None:
        self._connect = connect  # () -> an autocommit psycopg connection
        self.generation: int | None = None
        self.backend_pid: int | None = None  # the listening connection's server pid (tests end it)
        self._count = 0
        self._stopped = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="tokenpath-keys-listener", daemon=True)
        self._thread.start()

    def _next(self) -> None:
        self._count += 1
        self.generation = None if self._stopped else self._count

    def _run(self) -> None:
        retry_s = RETRY_FIRST_S
        try:
            while not self._stopped:
                try:
                    self._listen()  # returns when stopped; raises when the connection fails
                except Exception:  # noqa: BLE001 - any failure: unknown until listening again
                    self.generation = None
                    self.backend_pid = None
                    if self._wait(retry_s):
                        return
                    retry_s = min(retry_s * 2, RETRY_MAX_S)
                else:
                    retry_s = RETRY_FIRST_S
        finally:
            self.generation = None
            self._wake_r.close()

    def _listen(self) -> None:
        import psycopg

        conn = self._connect()
        try:
            conn.execute(f"LISTEN {KEYS_CHANNEL}")  # in effect when this returns (autocommit)
            pgconn = conn.pgconn
            self.backend_pid = pgconn.backend_pid
            self._next()  # a new number: nothing seen before this LISTEN may be kept against it
            with selectors.DefaultSelector() as sel:
                sel.register(pgconn.socket, selectors.EVENT_READ)
                sel.register(self._wake_r, selectors.EVENT_READ)
                while not self._stopped:
                    sel.select()
                    if self._stopped:
                        return
                    pgconn.consume_input()  # raises once the server is gone
                    if pgconn.status != psycopg.pq.ConnStatus.OK:
                        raise psycopg.OperationalError("the keys listener's connection was lost")
                    notified = False
                    while pgconn.notifies() is not None:
                        notified = True
                    if notified:
                        self._next()
        finally:
            self.generation = None  # before the connection goes: never a number without a LISTEN
            with contextlib.suppress(Exception):
                conn.close()

    def _wait(self, seconds: float) -> bool:
        """Sleep before a reconnect, woken early by `close()`; whether it was."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ)
            sel.select(seconds)
        return self._stopped

    def close(self, wait_s: float = 2.0) -> None:
        self._stopped = True
        self.generation = None
        with contextlib.suppress(OSError):  # (a closed socket object raises; it never reuses an fd)
            self._wake_w.send(b"x")
        self._thread.join(wait_s)
        self._wake_w.close()
