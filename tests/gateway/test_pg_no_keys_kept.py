"""On PostgreSQL a gateway with no keys keeps the store's "no keys" while its LISTEN on the `api_keys`
trigger's channel hears nothing (`tokenpath.gateway.keys_listener`), instead of a thread hop and a
round trip before every request; any key stored (the CLI, raw SQL), and a lost listener, end it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

import tokenpath
from tokenpath.errors import AuthenticationError
from tokenpath.gateway import Gateway, GatewayStore, Principal
from tokenpath.gateway.admin import create_key

_SRC = str(Path(tokenpath.__file__).resolve().parents[1])
pytestmark = pytest.mark.parametrize("store_location", ["postgres"], indirect=True)  # PostgreSQL only


def _until(check, within_s: float = 5.0):
    """`check()`'s first truthy answer, polled every 10 ms for at most `within_s`."""
    end = time.monotonic() + within_s
    while True:
        answer = check()
        if answer or time.monotonic() > end:
            return answer
        time.sleep(0.01)


def _listening(store: GatewayStore) -> int:
    generation = _until(lambda: store.db.keys_generation() is not None and store.db.keys_generation())
    assert generation is not None, "the keys listener never started LISTENing"
    return generation


@pytest.fixture
def slow_recheck(store_location: str):
    """A store whose kept "no keys" lasts an hour: within a test only a signal can end it."""
    store = GatewayStore(store_location, no_keys_recheck_s=3600)
    yield store
    store.close()


async def _keeping_no(store: GatewayStore, clock) -> tuple[Gateway, int]:
    """A gateway on `store` whose "no keys" is kept: the first request starts the listener, the one
    after it LISTENs is read and kept. Returns the gateway and the listener's generation."""
    gw = Gateway(store, clock=clock)
    assert await gw.authenticate({}) == Principal()
    generation = _listening(store)
    assert await gw.authenticate({}) == Principal()
    assert store.has_keys_nowait() is False  # (kept)
    return gw, generation


class _Transactions:
    """The transactions the store's connection opens on the server from now on (every store read is
    one: `GatewayStore.has_keys`'s too), counted in libpq's own trace of what that connection sends
    (not a count of Python calls). BEGIN is counted: after five runs psycopg prepares a statement and
    sends only its name, so the read's text no longer shows."""

    def __init__(self, store: GatewayStore) -> None:
        self._pgconn = store.db._conn.pgconn
        self._file = tempfile.TemporaryFile()  # noqa: SIM115 - closed by `count`
        self._pgconn.trace(self._file.fileno())

    def count(self) -> int:
        self._pgconn.untrace()  # (flushes libpq's buffer)
        self._file.seek(0)
        sent = [line.split("\t") for line in self._file.read().decode().splitlines()]
        self._file.close()
        return sum(f[1:2] == ["F"] and f[3:4] == ["Query"] and f[4:5] == [' "BEGIN"'] for f in sent)


async def test_many_requests_with_no_keys_read_postgres_once(store_location, clock):
    store = GatewayStore(store_location, no_keys_recheck_s=3600)
    try:
        gw = Gateway(store, clock=clock)
        end = time.monotonic() + 5.0  # the first requests start the listener, then one keeps "no"
        while time.monotonic() < end:
            assert await gw.authenticate({}) == Principal()
            if store.has_keys_nowait() is False:
                break
            time.sleep(0.01)
        sent = _Transactions(store)
        for _ in range(50):
            assert await gw.authenticate({}) == Principal()
        assert sent.count() == 0  # (before: a read of api_keys, and a thread hop, per request)
    finally:
        store.close()
    assert store.db.keys_generation() is None  # (closed: nothing kept, no listener)


async def test_a_key_made_by_tokenpath_keys_create_ends_the_kept_answer(store_location, slow_recheck, clock):
    store = slow_recheck
    gw, _ = await _keeping_no(store, clock)
    made = subprocess.run(
        [sys.executable, "-c", "import sys; from tokenpath.cli import main; sys.exit(main(sys.argv[1:]))",
         "keys", "create", "--tenant", "acme", "--database-url", store_location],
        env={**os.environ, "PYTHONPATH": _SRC}, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("tp-")
    assert _until(lambda: store.has_keys_nowait() is not False, 2.0)  # the NOTIFY arrived
    with pytest.raises(AuthenticationError):
        await gw.authenticate({})
    assert (await gw.authenticate({"Authorization": f"Bearer {secret}"})).tenant == "acme"


async def test_a_key_inserted_by_raw_sql_ends_the_kept_answer_through_the_trigger(store_location, slow_recheck, clock):
    """No mark, no tokenpath: the trigger of migration 7 notifies (the recheck is an hour here)."""
    store = slow_recheck
    gw, _ = await _keeping_no(store, clock)
    with psycopg.connect(store_location, autocommit=True) as raw:
        raw.execute("INSERT INTO tenants (name, created_at) VALUES ('acme', 0)")
        raw.execute("INSERT INTO api_keys (prefix, tenant, salt, digest, created_at) "
                    "VALUES ('tp-raw', 'acme', 's', 'd', 0)")
    assert _until(lambda: store.has_keys_nowait() is not False, 2.0)
    with pytest.raises(AuthenticationError):
        await gw.authenticate({})


async def test_a_killed_listener_drops_the_kept_answer_and_recovers(store_location, slow_recheck, clock):
    store = slow_recheck
    gw, before = await _keeping_no(store, clock)
    pid = store.db.listener_pid
    with psycopg.connect(store_location, autocommit=True) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
    assert _until(lambda: store.db.keys_generation() != before, 2.0)
    assert store.has_keys_nowait() is None  # not kept: ask the database (off the loop)
    after = _listening(store)  # reconnected, LISTENing again
    assert after != before and store.db.listener_pid != pid
    assert await gw.authenticate({}) == Principal()  # read again, and kept again
    assert store.has_keys_nowait() is False


async def test_a_key_committed_while_the_listener_starts_is_not_kept_out_of_sight(store_location, slow_recheck, clock):
    """The race of a starting listener, through the store's own `has_keys`: its read says "no", a key
    is committed, then LISTEN takes effect (so that key is never notified). The store takes the
    number before its read (here None or a number the key's NOTIFY moves on), so the stale "no" is
    not kept; a store that took it after the read would keep it, and this test would fail."""
    store = slow_recheck
    other = GatewayStore(store_location)
    real = store.db.transaction
    raced = []

    @contextmanager
    def read_then_race(*args, **kwargs):
        with real(*args, **kwargs) as tx:
            yield tx
        if not raced:  # after the first read: a key committed, then the listener LISTENing
            raced.append(create_key(other, "acme", now=clock()))
            _listening(store)

    try:
        gw = Gateway(store, clock=clock)
        store.db.watch_keys(True)  # (as after a first "no": the listener starts, not yet listening)
        store.db.transaction = read_then_race
        assert store.has_keys() is False  # the read's own answer: it ran before the key
        assert raced
        assert store.has_keys_nowait() is None  # not kept: the next request reads, and sees the key
        with pytest.raises(AuthenticationError):
            await gw.authenticate({})
    finally:
        other.close()


def test_the_migration_adds_the_trigger_on_postgres_only(store_location, tmp_path):
    store = GatewayStore(store_location)
    lite = GatewayStore(tmp_path / "gateway.sqlite3")
    try:
        with store.db.transaction() as tx:
            assert tx.q("SELECT tgname FROM pg_trigger WHERE tgrelid = 'api_keys'::regclass "
                        "AND NOT tgisinternal") == [("api_keys_notify",)]
        with lite.db.transaction() as tx:
            assert tx.q("SELECT name FROM sqlite_master WHERE type = 'trigger'") == []
    finally:
        lite.close()
        store.close()


def test_close_does_not_wait_for_the_listener(store_location):
    store = GatewayStore(store_location)
    assert store.has_keys() is False  # (starts the listener)
    _listening(store)
    t0 = time.monotonic()
    store.close()
    assert time.monotonic() - t0 < 1.5  # (a listener not woken would hold close() for its 2 s join)
    assert store.db.keys_generation() is None


def test_the_listener_starts_after_a_no_and_stops_once_a_key_is_seen(store_location, clock):
    """A gateway with keys never holds the second connection; one whose first key appears lets it go."""
    with_key = GatewayStore(store_location)
    store = GatewayStore(store_location)
    try:
        assert store.has_keys() is False
        _listening(store)
        create_key(with_key, "acme", now=clock())
        assert with_key.has_keys() is True
        assert with_key.db.listener_pid is None and with_key.db.keys_generation() is None
        assert _until(lambda: store.has_keys_nowait() is not False, 2.0)
        assert store.has_keys() is True
        assert store.db.listener_pid is None and store.db.keys_generation() is None
    finally:
        store.close()
        with_key.close()
