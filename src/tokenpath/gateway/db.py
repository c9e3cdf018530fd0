"""The two SQL backends of the gateway store (SQLite, PostgreSQL) behind one small interface.

The store writes its SQL once, with `?` placeholders and a few dialect words (`{pk}`, `{float}`,
`{int}`); each backend translates. Everything runs inside `transaction(lock=...)`, which is where
the exactness of the limits comes from:
- SQLite: `BEGIN IMMEDIATE` takes the database's write lock before the first read, so the read /
  decide / write of a reservation is serialised across threads *and* processes sharing the file.
- PostgreSQL: `SELECT ... FOR UPDATE` on the tenant's row serialises the reservations of that
  tenant across every gateway process sharing the database, while other tenants proceed.
One connection per backend, guarded by a thread lock: calls come from `asyncio.to_thread`. SQLite
also answers a small read on the event loop itself (`read_nowait`: its own connection, which never
waits), for the lookups in front of every request. Each backend also says when a key may have been
stored (`keys_generation`), so a gateway with no keys need not read before every request: SQLite a
mark file, PostgreSQL a LISTEN on the channel an `api_keys` trigger notifies (`keys_listener`).

Migrations are numbered; `migrate()` applies the missing ones under the same lock (an advisory
lock on PostgreSQL), so two processes starting together do not both apply them.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tokenpath.gateway.keys_listener import KEYS_CHANNEL, KeysListener

R = TypeVar("R")

# A statement is SQL for every backend, or `(kind, SQL)` for that backend only (`kind` as below).
MIGRATIONS: list[list[str | tuple[str, str]]] = [
    [  # 1: tenants, keys, admissions (sliding windows), daily usage (quotas), audit log
        """CREATE TABLE tenants (
            name TEXT PRIMARY KEY, rpm {int}, tpm {int}, daily_tokens {int}, models TEXT,
            created_at {float} NOT NULL)""",
        """CREATE TABLE api_keys (
            prefix TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(name),
            salt TEXT NOT NULL, digest TEXT NOT NULL, name TEXT, models TEXT,
            rpm {int}, tpm {int}, daily_tokens {int}, priority INTEGER NOT NULL DEFAULT 0,
            expires_at {float}, created_at {float} NOT NULL, last_used_at {float}, revoked_at {float})""",
        "CREATE INDEX api_keys_tenant ON api_keys (tenant)",
        """CREATE TABLE admissions (
            id {pk}, key_prefix TEXT NOT NULL, tenant TEXT NOT NULL, at {float} NOT NULL,
            tokens {int} NOT NULL)""",
        "CREATE INDEX admissions_key_at ON admissions (key_prefix, at)",
        "CREATE INDEX admissions_tenant_at ON admissions (tenant, at)",
        "CREATE INDEX admissions_at ON admissions (at)",
        """CREATE TABLE daily_usage (
            scope TEXT NOT NULL, day {int} NOT NULL, requests {int} NOT NULL DEFAULT 0,
            tokens {int} NOT NULL DEFAULT 0, PRIMARY KEY (scope, day))""",
        """CREATE TABLE audit_log (
            id {pk}, request_id TEXT NOT NULL, time {float} NOT NULL, day {int} NOT NULL,
            tenant TEXT NOT NULL, key_prefix TEXT, model TEXT, endpoint TEXT NOT NULL,
            status INTEGER NOT NULL, finish_reason TEXT, prompt_tokens {int} NOT NULL DEFAULT 0,
            cached_tokens {int} NOT NULL DEFAULT 0, completion_tokens {int} NOT NULL DEFAULT 0,
            queue_s {float}, prefill_s {float}, decode_s {float}, total_s {float}, client TEXT,
            error_type TEXT, prompt_text TEXT, completion_text TEXT)""",
        "CREATE INDEX audit_log_time ON audit_log (time)",
        "CREATE INDEX audit_log_tenant_time ON audit_log (tenant, time)",
        "CREATE INDEX audit_log_request ON audit_log (request_id)",
    ],
    [  # 2: admin keys may call the operator endpoints (/metrics, /reset_prefix_cache) when auth is on
        "ALTER TABLE api_keys ADD COLUMN admin INTEGER NOT NULL DEFAULT 0",
    ],
    [  # 3: per-stage timing and routing facts of each request, as JSON (`tokenpath trace`)
        "ALTER TABLE audit_log ADD COLUMN timing TEXT",
    ],
    [  # 4: rows opened at admission and closed at the end (a crashed gateway's are closed on the next start)
        "ALTER TABLE audit_log ADD COLUMN audit_key TEXT",  # ties a request's open row to its close
        "ALTER TABLE audit_log ADD COLUMN open_by TEXT",  # the gateway instance while the row is open
        "CREATE UNIQUE INDEX audit_log_key ON audit_log (audit_key)",
        "CREATE INDEX audit_log_open ON audit_log (open_by)",
        """CREATE TABLE gateway_instances (
            id TEXT PRIMARY KEY, host TEXT NOT NULL, pid {int} NOT NULL, pid_start TEXT,
            started_at {float} NOT NULL, seen_at {float} NOT NULL)""",
    ],
    [  # 5: the client's own id beside the server's (`tokenpath trace` finds a request by either)
        "ALTER TABLE audit_log ADD COLUMN client_request_id TEXT",
        "CREATE INDEX audit_log_client_request ON audit_log (client_request_id)",
    ],
    [  # 6: stored Responses API responses (`previous_response_id` chains), per tenant
        """CREATE TABLE stored_responses (
            id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at {float} NOT NULL, size {int} NOT NULL,
            body TEXT NOT NULL)""",
        "CREATE INDEX stored_responses_created ON stored_responses (created_at)",
    ],
    [  # 7: PostgreSQL tells listening gateways that a key was stored (`keys_listener`); SQLite has its mark
        ("postgres", f"""CREATE OR REPLACE FUNCTION tokenpath_keys_notify() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_notify('{KEYS_CHANNEL}', ''); RETURN NULL; END $$"""),
        ("postgres", """CREATE TRIGGER api_keys_notify AFTER INSERT ON api_keys
            FOR EACH STATEMENT EXECUTE FUNCTION tokenpath_keys_notify()"""),
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)
WAL_LIMIT_BYTES = 1 << 20  # the WAL file is truncated back to this after a checkpoint
RESERVE_BYTES = 1 << 20  # disk held back for the audit spool's rows when the disk fills (SQLite)


class Tx(Protocol):
    def q(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]: ...


class _SqliteTx:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def q(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        return self._conn.execute(sql, tuple(params)).fetchall()


class SqliteDatabase:
    """A SQLite file in WAL mode: readers do not block the single writer."""

    kind = "sqlite"
    words = {"pk": "INTEGER PRIMARY KEY AUTOINCREMENT", "float": "REAL", "int": "INTEGER"}

    def __init__(self, path: Path) -> None:
        _private_file(path)
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=60)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes in WAL mode
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.execute("PRAGMA busy_timeout=60000")
        # A small disk: the WAL is checkpointed every 256 pages (1 MiB; SQLite's default is 1000,
        # ~4 MiB, more than a 3 MiB disk holds) and truncated back to 1 MiB after a checkpoint, so
        # once space returns the WAL alone cannot fill the disk again.
        self._conn.execute("PRAGMA wal_autocheckpoint=256")
        self._conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        self.reserve = path.with_name(path.name + ".reserve")
        self.keys_marker = path.with_name(path.name + ".keys")  # see `mark_keys`
        self.reserve_spent = False  # given back for a full disk, and not made again yet
        self.keep_reserve()
        self._reader: sqlite3.Connection | None = None  # `read_nowait`'s, opened on first use
        self._reader_lock = threading.Lock()
        self._loop_writer: sqlite3.Connection | None = None  # `write_nowait`'s, opened on first use
        self._loop_writer_lock = threading.Lock()
        self._closed = False

    def keep_reserve(self) -> None:
        """Hold `RESERVE_BYTES` of the disk in a file beside the database, while there is room for it.

        When the disk fills, `reclaim_space` gives it back: the room the rows spooled meanwhile
        (and a checkpoint that truncates the WAL) need to be written, even if the space never
        comes back by itself. Made again, later, once the disk has room for it twice over."""
        try:
            if self.reserve.exists():
                self.reserve_spent = False
                return
            free = os.statvfs(self.path.parent)
            if free.f_bavail * free.f_frsize < 2 * RESERVE_BYTES:
                return
            fd = os.open(self.reserve, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"\0" * RESERVE_BYTES)  # written, not sparse: the blocks are really held
            finally:
                os.close(fd)
            self.reserve_spent = False
        except OSError:
            with contextlib.suppress(OSError):
                self.reserve.unlink()

    def reclaim_space(self) -> bool:
        """After a write failed for space: give back the reserve and truncate the WAL (a checkpoint
        copies its pages into the database, which needs less room than the WAL held). Whether
        anything was freed."""
        freed = False
        with contextlib.suppress(OSError):
            self.reserve.unlink()
            freed = self.reserve_spent = True
        with self._lock, contextlib.suppress(sqlite3.Error):
            busy, _, _ = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            freed = freed or not busy
        return freed

    @contextmanager
    def transaction(self, lock_tenant: str | None = None) -> Iterator[_SqliteTx]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTx(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def mark_keys(self) -> None:
        """Made before a key is first stored (`GatewayStore.add_key`), and never removed: while it
        is missing, no process has begun to store a key through the store, so a gateway that read
        "no keys" can keep that answer with one `access()` per request (`keys_unmarked`) and no
        SQLite read. A database-wide signal would not do: `PRAGMA data_version` and the -wal file's stat
        change at every audit commit, so once per request, and the data_version read itself costs
        what the read of `api_keys` does (benchmarks/results/gateway_ttft_path-stages.md)."""
        fd = os.open(self.keys_marker, os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)

    def keys_unmarked(self) -> bool:
        """No key has been stored through the store since the database was made (`mark_keys`);
        False once closed (a closed store answers nothing, as `read_nowait`)."""
        return not self._closed and not os.access(self.keys_marker, os.F_OK)  # (access: no exception made)

    def keys_generation(self) -> int | None:
        """What a kept "no keys" read is checked against (see `PostgresDatabase.keys_generation`):
        0 while no key is marked, None once one is (nothing then tells when the next is stored)."""
        return 0 if self.keys_unmarked() else None

    def watch_keys(self, watch: bool) -> None:
        """Nothing to start or stop: the mark is the signal (see `PostgresDatabase.watch_keys`)."""

    def read_nowait(self, sql: str, params: Sequence[Any] = ()) -> list[tuple] | None:
        """A read that never waits, for the event loop: on a connection of its own (not behind the
        writers' lock, and no `BEGIN IMMEDIATE`: a WAL reader sees the last commit and blocks no
        writer), with no busy timeout. None whenever it cannot answer at once (the connection in
        use, a lock, a closed or failing store): the caller then reads through `transaction`, off
        the loop, where failures are handled. ~10 us, where a thread hop costs 0.15-0.5 ms."""
        if self._closed or not self._reader_lock.acquire(blocking=False):
            return None
        try:
            if self._reader is None:
                self._reader = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False,
                                               timeout=0)
                self._reader.execute("PRAGMA query_only=ON")
            return self._reader.execute(sql, tuple(params)).fetchall()
        except sqlite3.Error:
            return None
        finally:
            self._reader_lock.release()

    def write_nowait(self, work: Callable[[Tx], R]) -> tuple[R] | None:
        """A short write transaction on the event loop (a rate-limit reservation before every request
        with a stored key), where it can begin at once: `(work's result,)`, committed. None when
        it cannot, having changed nothing: another writer holds SQLite's write lock (the audit
        writer's thread, another gateway or CLI process: no busy wait here), or the write failed
        (rolled back: a full disk); the caller then writes through `transaction`, off the loop,
        where waits and failures are handled as before. The same SQL and the same single-writer
        serialization (SQLite's own lock, `BEGIN IMMEDIATE`), on a connection of its own that never
        checkpoints (the writer's commits do; a checkpoint syncs the disk). Measured in front of vLLM
        on two busy cores (benchmarks/results/vllm_behind_gateway-loaded-ab.md): a request's first
        thread hop cost ~2.5 ms (a worker woken, then the loop), the write on the loop ~0.2-0.3."""
        if self._closed or not self._loop_writer_lock.acquire(blocking=False):
            return None
        try:
            if self._loop_writer is None:
                conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=0)
                conn.execute("PRAGMA foreign_keys=ON")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA wal_autocheckpoint=0")
                self._loop_writer = conn
            conn = self._loop_writer
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error:
                return None
            try:
                result = work(_SqliteTx(conn))
                conn.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    return None
                raise
            return (result,)
        except sqlite3.Error:  # (the connection itself could not be opened)
            return None
        finally:
            self._loop_writer_lock.release()

    def migrate(self) -> None:
        with self.transaction() as tx:
            _apply_migrations(tx, self.words, self.kind)

    def close(self) -> None:
        self._closed = True
        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
        with self._loop_writer_lock:
            if self._loop_writer is not None:
                self._loop_writer.close()
        with self._lock:
            self._conn.close()


def _private_file(path: Path) -> None:
    """The store holds key digests, tenants and the audit log: readable by its owner only. A directory
    made here is 0700; the file is created (or tightened) to 0600 before SQLite opens it, and SQLite
    gives its -wal and -shm files the database file's permissions."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


class _PgTx:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def q(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        cur = self._conn.execute(sql.replace("?", "%s"), tuple(params))
        return cur.fetchall() if cur.description is not None else []


class PostgresDatabase:
    """PostgreSQL via psycopg 3: the store shared by several gateway processes."""

    kind = "postgres"
    words = {"pk": "BIGSERIAL PRIMARY KEY", "float": "DOUBLE PRECISION", "int": "BIGINT"}
    _MIGRATION_LOCK = 0x7470_6761_7465  # pg_advisory_xact_lock key: "tpgate"

    def __init__(self, url: str) -> None:
        import psycopg  # here: ~9 MiB and 0.1 s that a gateway on SQLite (the default) never needs

        self._connect = lambda: psycopg.connect(url, autocommit=True)
        self._lock = threading.Lock()
        self._conn = self._connect()
        self._listener: KeysListener | None = None  # started by `watch_keys`
        self._listener_lock = threading.Lock()
        self._keys_seen = False  # a read found a key: the listener is not (re)started
        self._closed = False

    @contextmanager
    def transaction(self, lock_tenant: str | None = None) -> Iterator[_PgTx]:
        with self._lock:
            if self._conn.broken:  # the server restarted or the link dropped: the call that met it
                # has already failed (not retried: it may have committed); this one reconnects.
                self._conn = self._connect()
            with self._conn.transaction():
                tx = _PgTx(self._conn)
                if lock_tenant is not None:
                    tx.q("SELECT name FROM tenants WHERE name = ? FOR UPDATE", (lock_tenant,))
                yield tx

    reserve_spent = False  # the server's disk is PostgreSQL's to manage: nothing held here

    def mark_keys(self) -> None:
        """Nothing: gateways on other hosts share the database, and a file here is not theirs; the
        `api_keys` trigger notifies them instead (migration 7, `keys_generation`)."""

    def keys_generation(self) -> int | None:
        """The number a "no keys" read is kept against: taken before the read, the answer holds while
        this returns the same number (`keys_listener` says why the order matters). None while no
        listener is LISTENing (not started, connecting, reconnecting, stopped, closed): nothing is
        kept then, and each request reads as before. Two attribute reads per request."""
        listener = self._listener
        return None if listener is None else listener.generation

    def watch_keys(self, watch: bool) -> None:
        """Start the listener after a read found no keys (so a gateway with keys, or the CLI, never
        opens its connection), and stop it for good once a read finds one: keys are revoked, never
        deleted, and a gateway that has seen one does not ask again. Called off the loop when
        stopping (`has_keys`: the read that sees a key on PostgreSQL is never on the loop)."""
        with self._listener_lock:
            if watch and self._listener is None and not self._closed and not self._keys_seen:
                self._listener = KeysListener(self._connect)
                return
            if watch or self._keys_seen:
                return
            self._keys_seen = True
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    @property
    def listener_pid(self) -> int | None:
        """The server pid of the listener's connection, while it has one (tests end it)."""
        return None if self._listener is None else self._listener.backend_pid

    def read_nowait(self, sql: str, params: Sequence[Any] = ()) -> list[tuple] | None:
        """Never on the event loop: a read is a network round trip (see `SqliteDatabase`)."""
        return None

    def write_nowait(self, work: Callable[[Tx], R]) -> tuple[R] | None:
        """Never on the event loop, as `read_nowait`."""
        return None

    def keep_reserve(self) -> None:
        pass

    def reclaim_space(self) -> bool:
        return False

    def migrate(self) -> None:
        with self.transaction() as tx:
            tx.q("SELECT pg_advisory_xact_lock(?)", (self._MIGRATION_LOCK,))
            _apply_migrations(tx, self.words, self.kind)

    def close(self) -> None:
        self._closed = True
        with self._listener_lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            self._conn.close()


def _apply_migrations(tx: Tx, words: dict[str, str], kind: str) -> None:
    tx.q("CREATE TABLE IF NOT EXISTS tokenpath_gateway_schema (version INTEGER NOT NULL)")
    rows = tx.q("SELECT version FROM tokenpath_gateway_schema")
    current = rows[0][0] if rows else 0
    if current > SCHEMA_VERSION:
        raise RuntimeError(
            f"the gateway store has schema version {current}, newer than this tokenpath "
            f"({SCHEMA_VERSION}); upgrade tokenpath"
        )
    for version in range(current + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS[version - 1]:
            if isinstance(statement, tuple):
                only, statement = statement
                if only != kind:
                    continue
            tx.q(statement.format(**words))
    if not rows:
        tx.q("INSERT INTO tokenpath_gateway_schema (version) VALUES (?)", (SCHEMA_VERSION,))
    elif current != SCHEMA_VERSION:
        tx.q("UPDATE tokenpath_gateway_schema SET version = ?", (SCHEMA_VERSION,))


def connect(url_or_path: str | Path) -> SqliteDatabase | PostgresDatabase:
    """`postgresql://...` (or `postgres://`) -> PostgreSQL; `sqlite:///path` or a path -> SQLite."""
    text = str(url_or_path)
    if text.startswith(("postgresql://", "postgres://")):
        db: SqliteDatabase | PostgresDatabase = PostgresDatabase(text)
    else:
        db = SqliteDatabase(Path(text.removeprefix("sqlite://")))
    db.migrate()
    return db
