"""Streaming clients that never read cannot hold the server (issue 41, item 4).

Raw sockets with a tiny receive buffer ask for long streams and then read nothing. Before the
fix, each one held its engine slot until its generation ran out and its admission slot for as
long as the connection stayed open, so with `--max-num-seqs 4` six of them kept every other
request waiting indefinitely (85 s watched in the probe). Now a stream whose client has taken
nothing for `--stream-stall-timeout` seconds is aborted: the engine frees its slot, admission
its slot, and the audit row says `client_stalled` (status 499).

A flood of such streams must also give the gateway's memory back once it is over.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api.conftest import Server, running_server
from tests.api.test_replicas import audit_row
from tests.engine.tiny_models import save_tiny
from tests.reliability.nasty_bodies import CHAT_MODEL
from tokenpath.gateway.base import OPEN_STATUS
from tokenpath.gateway.store import GatewayStore, resolve_store_location
from tokenpath.server.memory import TRIM_INTERVAL_S

STALL_S = 2.0
# Streams in the flood. Each must get ~100 tokens out before its socket is full, and 64 of them on
# two shared cores (top_logprobs for 64 sequences a step) took over 5 minutes; 24 show the same.
FLOOD = 24
# Long streams with big chunks (20 top logprobs per token: ~1.5 KB of SSE each), so a client that
# reads nothing fills the socket and the server's buffer within a few dozen tokens.
STREAM = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
          "max_tokens": 1500, "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("slowreaders"), "--model", CHAT_MODEL, "--max-num-seqs", "4",
                        "--stream-stall-timeout", str(STALL_S)) as srv:
        yield srv


def non_reader(port: int, request_id: str, body: dict = STREAM, api_key: str | None = None) -> socket.socket:
    """A streaming request whose client never reads a byte of the answer (as `api_key`'s tenant)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Before connect: the window it offers, and a small MSS. On loopback (MSS 64 KiB) the server's
    # kernel would otherwise size its send buffer for ten full segments and take ~2.6 MB before a
    # send waits; at 536 bytes (a dial-up link's MSS) it takes tens of KB, as over a real network.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"x-request-id: " + request_id.encode() + b"\r\n"
                 + (b"Authorization: Bearer " + api_key.encode() + b"\r\n" if api_key else b"")
                 + b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def connection_ends(sock: socket.socket, within: float = 30) -> bool:
    """Read until the server's end of the connection (EOF or reset); False if it stays open."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def gauge(srv: Server, name: str, model: str = CHAT_MODEL) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    m = re.search(rf'^tokenpath:{name}\{{model_name="{re.escape(model)}"\}} (\S+)$', text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024  # type: ignore[union-attr]


def test_non_reading_streams_are_aborted_and_free_their_slots(small_server: Server):
    srv = small_server
    ids = [f"stall-{i}-{time.monotonic_ns()}" for i in range(6)]
    socks = [non_reader(srv.port, rid) for rid in ids]
    try:
        # A normal request queues behind the six (4 engine slots, 2 in the engine's queue) and must
        # get through once they are found stalled: each batch fills its sockets within seconds, then
        # the stall bound. Before the fix it waited for as long as the six stayed connected.
        t0 = time.monotonic()
        r = httpx.post(srv.base_url + "/chat/completions", timeout=150,
                       json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        waited = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert waited < 120, waited
        for rid in ids:
            row = audit_row(srv, rid, client=True)  # (sent as its x-request-id)
            assert (row.status, row.finish_reason, row.error_type) == (499, "client_stalled", "client_stalled"), row
            assert 0 < row.completion_tokens < STREAM["max_tokens"], row  # cut off, not run out
        deadline = time.monotonic() + 30
        while (running := gauge(srv, "num_requests_running")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert running == 0
        assert gauge(srv, "kv_cache_usage_perc") == 0
        # The server dropped the connections: a read gets what was in flight, then the end.
        for s in socks:
            assert connection_ends(s)
    finally:
        for s in socks:
            s.close()
    assert "ASGI callable returned without completing response" not in srv.output()


def read_stream(srv: Server) -> int:
    """A normal client of the same stream, reading all of it (shorter)."""
    with httpx.stream("POST", srv.base_url + "/chat/completions", json={**STREAM, "max_tokens": 40},
                      timeout=300) as r:
        for _ in r.iter_bytes():
            pass
        return r.status_code


def wait_stalled(srv: Server, ids: list[str], within: float = 300) -> None:
    """Every one of `ids` (client request ids) has its closed audit row, saying the client stalled."""
    store = GatewayStore(resolve_store_location(srv.log.parent / "data"))
    try:
        deadline = time.monotonic() + within
        while True:
            rows = {r.client_request_id: r for r in store.query_audit(limit=None) if r.client_request_id in ids}
            if (len(rows) == len(ids) and all(r.status != OPEN_STATUS for r in rows.values())) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        store.close()
    assert sorted(rows) == sorted(ids)
    for row in rows.values():
        assert (row.status, row.finish_reason) == (499, "client_stalled"), row


@pytest.mark.slow
def test_a_flood_of_non_readers_gives_the_memory_back(tmp_path_factory: pytest.TempPathFactory):
    """FLOOD non-reading streams at once are all found stalled, and once they are
    gone the gateway's RSS is back within 10% of what it was before the flood. Before, the outputs
    of each piled up in the gateway while the engine kept generating for nobody (565 -> 1,122 MiB
    with 200 such clients in the probe, and it stayed there)."""
    # Engine processes (--replicas 2), so the RSS measured is the gateway's alone: with the engine
    # in-process the same flood left ~70 MiB more after it (582 -> 650 MiB), while this gateway's
    # own RSS stayed flat (346 -> 349 peak -> 347 MiB). The engines run a tiny model with
    # SmolLM2's tokenizer, served under SmolLM2's name: the gateway's side (what is measured) is
    # the same, and SmolLM2 generating for the flood made this one of the slowest tests (~107 s).
    tmp = tmp_path_factory.mktemp("flood")
    model = save_tiny("llama", tmp / "tiny", max_position_embeddings=4096)
    with running_server(tmp, "--model", str(model), "--served-model-name", CHAT_MODEL, "--replicas", "2",
                        "--stream-stall-timeout", str(STALL_S)) as srv:
        served = [m["id"] for m in httpx.get(srv.base_url + "/models", timeout=30).json()["data"]]
        deployment = next(name for name in served if name != CHAT_MODEL)  # (the metrics' label)

        def running() -> float:
            return gauge(srv, "num_requests_running", deployment)

        # Warm-up first: what the server allocates once belongs to the baseline, not to the flood:
        # the engine's buffers for a batch this wide with logprobs (FLOOD reading streams at once),
        # and the stall path's (a few non-readers).
        with ThreadPoolExecutor(FLOOD) as pool:
            codes = list(pool.map(lambda _: read_stream(srv), range(FLOOD)))
        assert codes == [200] * FLOOD
        warm = [f"warm-{i}-{time.monotonic_ns()}" for i in range(4)]
        socks = [non_reader(srv.port, rid) for rid in warm]
        wait_stalled(srv, warm)
        for s in socks:
            s.close()
        time.sleep(TRIM_INTERVAL_S + 5)  # past the gateway's next periodic heap trim: the baseline
        before = rss_mib(srv.proc.pid)

        ids = [f"flood-{i}-{time.monotonic_ns()}" for i in range(FLOOD)]
        socks = [non_reader(srv.port, rid) for rid in ids]
        peak = before
        deadline = time.monotonic() + 300
        while running() == 0 and time.monotonic() < deadline:
            time.sleep(0.2)  # (admitted)
        while (busy := running()) and time.monotonic() < deadline:
            peak = max(peak, rss_mib(srv.proc.pid))
            time.sleep(0.5)
        assert busy == 0
        wait_stalled(srv, ids)
        for s in socks:
            s.close()
        # Back within 10% once the gateway's periodic heap trim (every 15 s) has run: polled, with
        # two trims' slack for a loaded host, rather than a fixed 20 s wait.
        deadline = time.monotonic() + 2 * TRIM_INTERVAL_S + 10
        while (after := rss_mib(srv.proc.pid)) > before * 1.10 and time.monotonic() < deadline:
            time.sleep(1.0)
        print(f"RSS MiB: before {before:.0f}, peak {peak:.0f}, after {after:.0f}")
        assert after <= before * 1.10, (before, peak, after)
        r = httpx.post(srv.base_url + "/chat/completions", timeout=120,
                       json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        assert r.status_code == 200, r.text
