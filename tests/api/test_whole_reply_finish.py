"""A whole (non-streaming) reply is sent before its request's ending runs (`api/replies.py`
`WholeReply`): the audit row's close, the reconcile, the log line and the metrics come after the
body's last byte, as a stream's always did, so none of it is on the reply's latency (issue 37).
The close still lands, with the reply's own figures. Through the real app on a loopback server."""

from __future__ import annotations

import asyncio
import threading
import time
import typing

import httpx
from tests.api.sim_server import SimServer
from tests.simulated_replica import SimulatedConfig, SimulatedReplica

from tokenpath.gateway.base import OPEN_STATUS, AuditRecord, OpenGuard


class HeldCloseGuard(OpenGuard):
    """The open guard whose close write holds until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.rows: list[AuditRecord] = []

    async def audit_open(self, record: AuditRecord, progress: typing.Callable[[], int]) -> None:
        self.rows.append(record)

    async def audit(self, record: AuditRecord) -> None:
        while not self.release.is_set():
            await asyncio.sleep(0.005)
        self.rows.append(record)


def test_a_whole_reply_is_sent_before_its_close_row_is_written():
    guard = HeldCloseGuard()
    srv = SimServer(SimulatedReplica("r0", SimulatedConfig(token_interval_s=0.001)), guard=guard)
    url = srv.start()
    try:
        # The close is held: the reply comes all the same (on the old order it waited for the
        # close, and this timed out).
        r = httpx.post(url + "/v1/completions", json={"model": "sim", "prompt": "hello", "max_tokens": 4},
                       timeout=5)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert "server-timing" in r.headers
        assert [row.status for row in guard.rows] == [OPEN_STATUS]  # (open, no close yet)
        guard.release.set()
        deadline = time.monotonic() + 10
        while len(guard.rows) < 2:
            assert time.monotonic() < deadline, "the close row never came"
            time.sleep(0.005)
        closed = guard.rows[1]
        assert closed.status == 200 and closed.completion_tokens == 4 and closed.finish_reason == "length"
        assert closed.request_id == r.headers["x-request-id"]
    finally:
        guard.release.set()
        srv.stop()
