"""The audit writer on real stores (SQLite file, and PostgreSQL when the test server runs): rows
opened at admission and closed at the end, progress, crash recovery, and the bounded spool."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest
from test_audit_cli import record

from tokenpath.errors import ServiceUnavailableError
from tokenpath.gateway import Gateway, GatewayStore
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.audit_store import AuditOp, Instance
from tokenpath.gateway.audit_writer import AuditWriter
from tokenpath.gateway.base import CRASH_STATUS, GATEWAY_CRASH, OPEN_STATUS


def _open(request_id: str, now: float, key: str, **kw):
    return record(request_id, now, audit_key=key, status=OPEN_STATUS, finish_reason=None, completion_tokens=0,
                  **kw)


def _rows(store: GatewayStore) -> dict:
    return {r.request_id: r for r in store.query_audit(limit=None)}


def _open_by(store: GatewayStore, request_id: str) -> str | None:
    with store.db.transaction() as tx:
        return tx.q("SELECT open_by FROM audit_log WHERE request_id = ?", (request_id,))[0][0]


async def test_open_then_close_is_one_row_and_progress_is_written_while_open(store, clock):
    gw = Gateway(store, clock=clock)
    gw.audit_writer.progress_s = 0.05
    sent = [0]
    await gw.audit_open(_open("r1", clock(), "k1"), lambda: sent[0])
    assert _rows(store)["r1"].status == OPEN_STATUS and _open_by(store, "r1") == gw.audit_writer.instance.id
    sent[0] = 7
    for _ in range(100):  # the progress write, within a few periods
        await asyncio.sleep(0.02)
        if _rows(store)["r1"].completion_tokens == 7:
            break
    assert _rows(store)["r1"].completion_tokens == 7
    await gw.audit(record("r1", clock(), audit_key="k1", completion_tokens=9))
    rows = store.query_audit(limit=None)
    assert len(rows) == 1 and (rows[0].status, rows[0].completion_tokens, rows[0].finish_reason) == (200, 9, "stop")
    assert _open_by(store, "r1") is None
    await gw.audit_writer.aclose()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


async def test_rows_of_gone_instances_are_closed_as_gateway_crash(store_location, clock):
    s = GatewayStore(store_location)
    me = Instance.current()
    dead = Instance(f"{me.host}:x:dead", me.host, _dead_pid(), None)  # this host, its process gone
    far_gone = Instance("other:1:a", "other-host", 1, None)  # another host, no heartbeat for minutes
    far_alive = Instance("other:2:b", "other-host", 2, None)  # another host, heartbeat just now
    s.write_audit_batch([AuditOp("open", _open("r-dead", clock(), "kd"))], dead, clock())
    s.write_audit_progress([("kd", 42)], dead, clock())
    s.write_audit_batch([AuditOp("open", _open("r-far", clock(), "kf"))], far_gone, clock() - 600)
    s.write_audit_batch([AuditOp("open", _open("r-alive", clock(), "ka"))], far_alive, clock())
    s.close()
    store = GatewayStore(store_location)
    Gateway(store, clock=clock)  # a start closes what gone instances left open
    rows = _rows(store)
    for rid in ("r-dead", "r-far"):
        assert (rows[rid].status, rows[rid].finish_reason, rows[rid].error_type) == \
            (CRASH_STATUS, GATEWAY_CRASH, GATEWAY_CRASH)
        assert rows[rid].prompt_tokens == 10  # the admission facts stay
    assert rows["r-dead"].completion_tokens == 42  # the tokens of the last progress write
    assert rows["r-alive"].status == OPEN_STATUS  # a live gateway's request is left alone
    store.close()


async def test_a_full_spool_drops_and_counts_and_logs_once(tmp_path, clock, caplog):
    store = GatewayStore(tmp_path / "g.sqlite3")
    writer = AuditWriter(store, Instance.current(), max_rows=3, clock=clock)
    store.close()  # every write fails from now on
    with caplog.at_level(logging.ERROR, logger="tokenpath.gateway"):
        for i in range(5):
            await writer.open(_open(f"r{i}", clock(), f"k{i}"), lambda: 0)
        await writer.close(record("r0", clock(), audit_key="k0"))  # replaces r0's spooled open: no new row
        await asyncio.sleep(0.3)  # retries meanwhile
        h = writer.health()
        assert h.degraded and (h.spool_rows, h.spooled_total, h.dropped_total) == (3, 3, 2)
        assert caplog.text.count("audit store cannot be written") == 1  # the cause, once (then periodically)
        assert caplog.text.count("audit spool full") == 1
        await writer.aclose(timeout=0.1)
    assert writer.health().dropped_total == 5


# Spooled rows written once the store is back: tests/reliability/test_audit_faults.py, on a really
# full tmpfs and a really stopped PostgreSQL.


async def test_an_unreachable_store_fails_auth_closed_unless_it_said_there_were_no_keys(tmp_path, clock):
    """Auth stays off while the store is down only when this gateway saw it hold no key (none can be
    made while it is down); a gateway that never got an answer refuses with 503, not anonymous."""
    keyed = GatewayStore(tmp_path / "keyed.sqlite3")
    create_key(keyed, "acme", now=clock())
    gw = Gateway(keyed, clock=clock)
    keyed.close()  # down before any request
    with pytest.raises(ServiceUnavailableError) as err:
        await gw.authenticate({})
    assert err.value.code == "store_unavailable"
    assert gw.auth_enabled  # operator endpoints stay shut too

    empty = GatewayStore(tmp_path / "empty.sqlite3")
    gw = Gateway(empty, clock=clock)
    assert (await gw.authenticate({})).tenant == "anonymous"  # the store said: no keys
    empty.close()
    assert (await gw.authenticate({})).tenant == "anonymous" and not gw.auth_enabled
