"""A client's `x-request-id` is its own: another tenant sending the same one changes nothing (issue 41).

Tenant B streams a long greedy completion with `x-request-id: R`; while it streams, tenant A sends
requests with the same R, streamed and not. The server mints its own unique id for every request
(what the engine, the aborts and the audit row use) and keeps R beside it as `client_request_id`.
So B's stream ends normally with all its tokens, token-identical to the same request made alone;
A's requests are simply other requests and succeed; the audit rows have distinct ids, each with
R as its client id; and `tokenpath trace R` lists them all with their tenants.

Before: R was the server's id. The engine refused A's duplicate, and the gateway then sent
`abort(R)`, which ended B's stream (in-process) or left it hanging, with no tokens and no end
(over `--replicas 2` engine processes). Both server kinds run here, as users start them; with two
replicas every request carries one session id under `session_affinity` routing, so A's requests
land on the engine process running B's.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.api.conftest import CHAT_MODEL, TOKENPATH, Server, running_server
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.store import GatewayStore, resolve_store_location

pytestmark = pytest.mark.slow

PROMPT = "Tell me a long story about a lighthouse."
LONG = 300  # B's tokens: long enough that A's requests all run while it streams
SESSION = {"x-session-id": "one-home"}  # (every request to the same replica)


@pytest.fixture(scope="module", params=[(), ("--replicas", "2", "--routing-policy", "session_affinity")],
                ids=["in-process", "replicas"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[Server, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("request-ids")
    (tmp / "data").mkdir()
    store = GatewayStore(resolve_store_location(tmp / "data"))
    try:
        keys = {t: create_key(store, t)[0] for t in ("tenant-a", "tenant-b")}
    finally:
        store.close()
    with running_server(tmp, "--model", CHAT_MODEL, "--num-kv-blocks", "256", *request.param, wait=600) as srv:
        yield srv, keys


def _body(max_tokens: int, stream: bool) -> dict:
    return {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


class Stream(threading.Thread):
    """One streamed completion on its own thread: its text, finish reason, usage and ids."""

    def __init__(self, srv: Server, key: str, client_id: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.key, self.client_id, self.max_tokens = srv, key, client_id, max_tokens
        self.status = 0
        self.chunks = 0
        self.text = ""
        self.finish: str | None = None
        self.usage: dict = {}
        self.headers: dict[str, str] = {}
        self.done = False  # saw [DONE]
        self.error: BaseException | None = None

    def run(self) -> None:
        headers = {"authorization": f"Bearer {self.key}", "x-request-id": self.client_id, **SESSION}
        try:
            # A read timeout well under the test's: a stream left hanging fails as such.
            with httpx.Client(base_url=self.srv.base_url, timeout=60) as c, \
                    c.stream("POST", "/completions", json=_body(self.max_tokens, True), headers=headers) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    event = json.loads(line[6:])
                    for choice in event.get("choices") or []:
                        self.chunks += 1
                        self.text += choice.get("text") or ""
                        self.finish = choice.get("finish_reason") or self.finish
                    self.usage = event.get("usage") or self.usage
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _finished(s: Stream, timeout: float = 300) -> Stream:
    s.join(timeout)
    assert not s.is_alive(), f"stream {s.client_id} still open after {timeout}s ({s.chunks} chunks)"
    assert s.error is None, repr(s.error)
    return s


def _rows(srv: Server, client_id: str, n: int) -> list:
    """The closed audit rows carrying this client id, once all `n` are written."""
    store = GatewayStore(resolve_store_location(srv.log.parent / "data"))
    try:
        deadline = time.monotonic() + 30
        while True:
            rows = [r for r in store.query_audit(client_request_id=client_id) if r.status != 0]
            if len(rows) >= n or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)
    finally:
        store.close()


def _trace(srv: Server, rid: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TOKENPATH, "trace", rid, *args, "--data-dir", str(srv.log.parent / "data")],
                          capture_output=True, text=True, timeout=60)


def test_another_tenant_sending_the_same_request_id_changes_nothing(served):
    srv, keys = served
    tag = srv.port  # (ids unique to this server: the fixture runs twice)
    alone = Stream(srv, keys["tenant-b"], f"alone-{tag}", LONG)
    alone.start()
    _finished(alone)
    assert alone.status == 200 and alone.finish == "length" and alone.usage["completion_tokens"] == LONG, alone.usage

    shared = f"shared-{tag}"
    victim = Stream(srv, keys["tenant-b"], shared, LONG)
    victim.start()
    deadline = time.monotonic() + 120
    while victim.chunks < 10:  # streaming: it holds the id in its engine now
        assert victim.is_alive() and time.monotonic() < deadline, (victim.status, victim.chunks, victim.error)
        time.sleep(0.02)

    # Tenant A, the same client id: streamed, not streamed, and both at once.
    a_headers = {"authorization": f"Bearer {keys['tenant-a']}", "x-request-id": shared, **SESSION}
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        plain = c.post("/completions", json=_body(8, False), headers=a_headers)
        other = Stream(srv, keys["tenant-a"], shared, 8)
        other.start()
        plain2 = c.post("/completions", json=_body(8, False), headers=a_headers)
    _finished(other)
    overlapped = victim.is_alive()  # (checked last: a B cut short fails its own checks first)

    for r in (plain, plain2):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 8
        assert r.headers["x-client-request-id"] == shared and r.headers["x-request-id"] == r.json()["id"]
    assert other.status == 200 and other.done and other.finish == "length", (other.status, other.finish)

    # B: all its tokens, ended normally, the same text as alone (greedy; rows are batch-invariant).
    _finished(victim)
    assert victim.status == 200 and victim.done, (victim.status, victim.chunks)
    assert victim.finish == "length" and victim.usage["completion_tokens"] == LONG, (victim.finish, victim.usage)
    assert victim.text == alone.text
    assert overlapped, "B's stream ended before A's requests ran: the test proved nothing"

    # Four requests, four server ids, none of them R; the tenants tell B's from A's.
    ids = {victim.headers["x-request-id"], other.headers["x-request-id"], *(r.headers["x-request-id"]
                                                                           for r in (plain, plain2))}
    assert len(ids) == 4 and shared not in ids, ids
    rows = _rows(srv, shared, 4)
    assert sorted(r.request_id for r in rows) == sorted(ids), [(r.request_id, r.tenant) for r in rows]
    assert all(r.status == 200 and r.client_request_id == shared for r in rows), rows
    by_id = {r.request_id: r for r in rows}
    b_row = by_id[victim.headers["x-request-id"]]
    assert (b_row.tenant, b_row.finish_reason, b_row.completion_tokens) == ("tenant-b", "length", LONG)
    assert sorted(r.tenant for r in rows) == ["tenant-a"] * 3 + ["tenant-b"]

    # `tokenpath trace R` lists every request that sent R, with its tenant and server id.
    listed = _trace(srv, shared)
    assert listed.returncode == 0, listed.stderr
    assert "4 requests sent client id" in listed.stdout, listed.stdout
    for r in rows:
        line = next(ln for ln in listed.stdout.splitlines() if r.request_id in ln)
        assert r.tenant in line, listed.stdout
    found = json.loads(_trace(srv, shared, "--json").stdout)
    assert sorted((s["request_id"], s["tenant"]) for s in found) == sorted((r.request_id, r.tenant) for r in rows)
    # One server id: that request's waterfall, naming its tenant and the client's id.
    one = _trace(srv, victim.headers["x-request-id"])
    assert one.returncode == 0 and "tenant tenant-b" in one.stdout and f"client id {shared}" in one.stdout, one
