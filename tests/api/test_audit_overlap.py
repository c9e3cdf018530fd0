"""The audit row's open write runs beside the dispatch (api/intake.py `tokenize`, `recorded`): the
engine may start on a request whose row is still being written, but no reply byte reaches the
client before the write completes, and a write that fails fails the request with no token sent and
its engine request aborted. Through the real app on a loopback server (tests/api/sim_server.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import typing
from collections.abc import Iterator

import httpx
import pytest
from tests.api.sim_server import SimServer
from tests.simulated_replica import SimulatedConfig, SimulatedReplica

from tokenpath.errors import ServiceUnavailableError
from tokenpath.gateway.base import OPEN_STATUS, AuditRecord, OpenGuard


class SlowAuditGuard(OpenGuard):
    """The open guard whose open write holds until `release` is set, then succeeds or raises `fail`."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.events: list[tuple[str, float]] = []  # ("open started" | "open done" | "close", monotonic)
        self.rows: list[AuditRecord] = []

    async def audit_open(self, record: AuditRecord, progress: typing.Callable[[], int]) -> None:
        self.events.append(("open started", time.monotonic()))
        while not self.release.is_set():
            await asyncio.sleep(0.005)
        self.events.append(("open done", time.monotonic()))
        if self.fail is not None:
            raise self.fail
        self.rows.append(record)

    async def audit(self, record: AuditRecord) -> None:
        self.events.append(("close", time.monotonic()))
        self.rows.append(record)


class AbortRecordingReplica(SimulatedReplica):
    def __init__(self) -> None:
        super().__init__("r0", SimulatedConfig(token_interval_s=0.005))
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await super().abort(request_id)


def _serve(guard: SlowAuditGuard) -> Iterator[tuple[str, AbortRecordingReplica]]:
    replica = AbortRecordingReplica()
    srv = SimServer(replica, guard=guard)
    try:
        yield srv.start(), replica
    finally:
        srv.stop()


@pytest.fixture
def held() -> Iterator[tuple[str, AbortRecordingReplica, SlowAuditGuard]]:
    guard = SlowAuditGuard()
    for url, replica in _serve(guard):
        yield url, replica, guard


@pytest.fixture
def failing() -> Iterator[tuple[str, AbortRecordingReplica, SlowAuditGuard]]:
    guard = SlowAuditGuard(ServiceUnavailableError("the audit store is down", code="audit_unavailable"))
    for url, replica in _serve(guard):
        yield url, replica, guard


def _until(cond: typing.Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


BODY = {"model": "sim", "prompt": "hello there", "max_tokens": 8}


def test_the_engine_starts_beside_the_open_write_and_the_first_token_waits_for_it(held):
    url, replica, guard = held
    got: dict[str, typing.Any] = {}

    def client() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as r:
            got["headers_at"] = time.monotonic()
            got["status"] = r.status_code
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        got["lines"] = lines

    t = threading.Thread(target=client)
    t.start()
    # The row's write is under way and held: the engine has the request all the same (the write
    # no longer stands between admission and dispatch) ...
    # (Both are waited for: the engine takes the request in the dispatch's own step, and the row's
    # write starts at the event loop's next turn, so this thread could look in between.)
    _until(lambda: bool(replica.served) and bool(guard.events),
           "the engine to start the request while its audit row is being written")
    assert [e for e, _ in guard.events] == ["open started"]
    # ... but the client has nothing: no status line, no token (the first is made in 5 ms), for as
    # long as the write takes.
    time.sleep(0.2)
    assert "headers_at" not in got
    guard.release.set()
    t.join(30)
    done_at = dict(guard.events)["open done"]
    assert got["status"] == 200 and got["headers_at"] >= done_at
    chunks = [json.loads(line[6:]) for line in got["lines"] if line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "".join(f"t{i} " for i in range(8))
    # The open row first, then its close: a close never written before the open it supersedes.
    # (The close is written once the reply is out, so the client can have [DONE] before it lands.)
    _until(lambda: len(guard.events) >= 3, "the request's close row")
    assert [e for e, _ in guard.events] == ["open started", "open done", "close"]
    opened, closed = guard.rows
    assert opened.status == OPEN_STATUS and closed.status == 200 and closed.completion_tokens == 8


@pytest.mark.parametrize("stream", [True, False])
def test_an_open_write_that_fails_fails_the_request_with_no_token_and_aborts_it(failing, stream):
    url, replica, guard = failing
    result: dict[str, typing.Any] = {}

    def client() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "max_tokens": 400, "stream": stream},
                          timeout=30) as r:
            result["status"], result["body"] = r.status_code, r.read().decode()

    t = threading.Thread(target=client)
    t.start()
    _until(lambda: bool(replica.served), "the engine to start the request")
    time.sleep(0.05)  # (tokens are made meanwhile, and held)
    guard.release.set()
    t.join(30)
    assert result["status"] == 503, result
    body = json.loads(result["body"])
    assert body["error"]["code"] == "audit_unavailable" and "data:" not in result["body"]
    # The engine's request is stopped, not left to make its 400 tokens for nobody.
    _until(lambda: replica.aborted == replica.served, "the engine request to be aborted", 5)
    assert replica.running == set()
    _until(lambda: any(e == "close" for e, _ in guard.events), "the row's close")
    (closed,) = guard.rows  # (the open raised: only the close was recorded, with the failure)
    assert closed.status == 503 and closed.error_type is not None
