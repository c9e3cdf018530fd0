"""Store mechanics: migrations, reopening, pruning, and PostgreSQL reconnection."""

from __future__ import annotations

import psycopg
import pytest

from tokenpath.gateway import GatewayStore, Limits
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.db import SCHEMA_VERSION


def _schema_version(store: GatewayStore) -> int:
    with store.db.transaction() as tx:
        return tx.q("SELECT version FROM tokenpath_gateway_schema")[0][0]


def test_reopening_keeps_data_and_does_not_reapply_migrations(store_location, clock):
    first = GatewayStore(store_location)
    secret, record = create_key(first, "acme", limits=Limits(rpm=3), now=clock())
    first.close()
    again = GatewayStore(store_location)
    try:
        assert _schema_version(again) == SCHEMA_VERSION
        assert again.find_key(record.prefix) == record
        with again.db.transaction() as tx:
            assert tx.q("SELECT COUNT(*) FROM tokenpath_gateway_schema")[0][0] == 1
    finally:
        again.close()


def test_a_newer_schema_is_refused(store_location):
    s = GatewayStore(store_location)
    with s.db.transaction() as tx:
        tx.q("UPDATE tokenpath_gateway_schema SET version = ?", (SCHEMA_VERSION + 1,))
    s.close()
    with pytest.raises(RuntimeError, match="newer"):
        GatewayStore(store_location)


def test_sqlite_store_uses_wal(tmp_path):
    s = GatewayStore(tmp_path / "gw.sqlite3")
    try:
        with s.db.transaction() as tx:
            assert tx.q("PRAGMA journal_mode")[0][0] == "wal"
    finally:
        s.close()


def test_prune_drops_only_admissions_outside_every_window(store, clock):
    secret, record = create_key(store, "acme", now=clock())
    store.reserve(record.prefix, "acme", Limits(), Limits(), 5, clock() - 300)
    store.reserve(record.prefix, "acme", Limits(), Limits(), 5, clock() - 10)
    store.prune(clock())
    with store.db.transaction() as tx:
        assert tx.q("SELECT tokens FROM admissions")[0][0] == 5
        assert tx.q("SELECT COUNT(*) FROM admissions")[0][0] == 1


def test_postgres_store_reconnects_after_the_connection_is_killed(store_location, clock):
    if not store_location.startswith("postgres"):
        pytest.skip("PostgreSQL only")
    s = GatewayStore(store_location)
    try:
        create_key(s, "acme", now=clock())
        pid = s.db._conn.info.backend_pid
        with psycopg.connect(store_location, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            s.has_keys()
        assert s.has_keys()  # the next call reconnects
    finally:
        s.close()
