"""Store mechanics: migrations, reopening, pruning, and PostgreSQL reconnection."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from tokenpath.gateway import GatewayStore, Limits
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.base import AuditRecord
from tokenpath.gateway.db import MIGRATIONS, SCHEMA_VERSION, PostgresDatabase, SqliteDatabase


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


@pytest.mark.parametrize("store_location", ["postgres"], indirect=True)  # PostgreSQL only
def test_postgres_store_reconnects_after_the_connection_is_killed(store_location, clock):
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


def test_a_v4_store_gains_the_client_request_id_column(store_location):
    """A store written before migration 5 (no `client_request_id`) is migrated on open: its old
    rows read back with no client id, new rows keep theirs, and either id finds a row."""
    raw = PostgresDatabase(store_location) if store_location.startswith("postgres") else \
        SqliteDatabase(Path(store_location))
    with raw.transaction() as tx:
        tx.q("CREATE TABLE tokenpath_gateway_schema (version INTEGER NOT NULL)")
        for statement in (s for m in MIGRATIONS[:4] for s in m):
            tx.q(statement.format(**raw.words))
        tx.q("INSERT INTO tokenpath_gateway_schema (version) VALUES (4)")
        tx.q("INSERT INTO audit_log (request_id, time, day, tenant, endpoint, status) VALUES (?, ?, ?, ?, ?, ?)",
             ("old-client-id", 1.0, 0, "acme", "/v1/completions", 200))
    raw.close()
    store = GatewayStore(store_location)
    try:
        assert _schema_version(store) == SCHEMA_VERSION
        (old,) = store.query_audit(request_id="old-client-id")
        assert old.client_request_id is None
        store.write_audit(AuditRecord(request_id="cmpl-1", time=2.0, tenant="acme", key_prefix=None, model=None,
                                      endpoint="/v1/completions", status=200, client_request_id="mine"))
        store.write_audit(AuditRecord(request_id="cmpl-2", time=3.0, tenant="other", key_prefix=None, model=None,
                                      endpoint="/v1/completions", status=200, client_request_id="mine"))
        assert [(r.request_id, r.tenant) for r in store.query_audit(client_request_id="mine")] == \
            [("cmpl-1", "acme"), ("cmpl-2", "other")]
        assert store.query_audit(request_id="cmpl-2")[0].client_request_id == "mine"
    finally:
        store.close()
