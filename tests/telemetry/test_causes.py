"""Staged incidents over real servers: each names its cause and its culprit, in `tokenpath trace
ID --json`'s `causes`, and `tokenpath diagnose` finds it over the window.

A tiny random-weight Llama (wide enough that a 1,000-token prefill chunk is far slower than a
decode step) keeps every incident to a second or two. Three servers, started as users start
them (the console script, `--port 0`):

- in-process, `--max-num-seqs 1`: a short request behind long ones (engine queue and admission
  queue), and a client that reads slowly;
- in-process, an 80-block KV pool and 1,024-token prefill chunks: a long prompt stalling a decoding
  stream, and a preemption forced by another request's growth;
- `--replicas 2` engine processes, `--max-num-seqs 1`: a shared prefix routed away under load,
  and a request queued in an engine process's own queue (the facts cross the engine link).

Each request is sent with its own `x-request-id` (the client's id, kept beside the server's):
`tokenpath trace` finds it by that, and a cause names its culprit by the server's id (`_sid`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.tiny_models import save_tiny
from tests.telemetry.conftest import Served, make_keys, stop

TOKENPATH = str(Path(sys.executable).parent / "tokenpath")
MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-causes") / "tiny", hidden_size=256,
                     intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                     max_position_embeddings=4096)


def _serve(tmp: Path, model: Path, *args: str) -> Served:
    data_dir = tmp / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    keys = make_keys(data_dir)
    log = tmp / "server.log"
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([TOKENPATH, "serve", "--port", "0", "--model", str(model), "--served-model-name",
                                 MODEL, "--dtype", "float32", *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if m:
            return Served(proc, int(m.group(1)), log, data_dir, None, keys)  # type: ignore[arg-type]
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log.read_text()}")


def _server(tmp_path_factory: pytest.TempPathFactory, tiny: Path, *args: str) -> Iterator[Served]:
    srv = _serve(tmp_path_factory.mktemp("srv"), tiny, *args)
    try:
        yield srv
    finally:
        assert stop(srv) == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def one_seq(tmp_path_factory, tiny) -> Iterator[Served]:
    yield from _server(tmp_path_factory, tiny, "--max-num-seqs", "1")


@pytest.fixture(scope="module")
def small_kv(tmp_path_factory, tiny) -> Iterator[Served]:
    yield from _server(tmp_path_factory, tiny, "--max-num-seqs", "4", "--max-num-batched-tokens", "1024",
                       "--num-kv-blocks", "80", "--block-size", "16")


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory, tiny) -> Iterator[Served]:
    yield from _server(tmp_path_factory, tiny, "--replicas", "2", "--max-num-seqs", "1")


def _rid(tag: str) -> str:
    """A client's id for one request (unique here, so `tokenpath trace` finds that one request)."""
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def _sid(srv: Served, client_id: str) -> str:
    """The server's id of the (finished) request sent with this client id: what causes name."""
    return _trace(srv, client_id)["request_id"]


def _complete(srv: Served, rid: str, prompt: str, max_tokens: int, **extra: object) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", headers=srv.headers(**{"x-request-id": rid}), timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, **extra})


def _in_background(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def _trace(srv: Served, rid: str) -> dict:
    deadline = time.monotonic() + 20
    while True:
        out = subprocess.run([TOKENPATH, "trace", rid, "--json", "--data-dir", str(srv.data_dir)],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return json.loads(out.stdout)
        if time.monotonic() > deadline:
            raise AssertionError(out.stderr)
        time.sleep(0.3)  # the audit row is written as the request finishes


def _cause(s: dict, kind: str) -> dict:
    found = [c for c in s["causes"] if c["kind"] == kind]
    assert found, f"no {kind} cause in {json.dumps(s['causes'], indent=1)}"
    return found[0]


def _stage_ms(s: dict, stage: str) -> float:
    return next(st["ms"] for st in s["stages"] if st["stage"] == stage)


def _wait_running(srv: Served, rid: str, stage: str = "decode", timeout: float = 60) -> None:
    """Until the request sent with client id `rid` is in `stage` (decode: it has produced a token
    and holds its slot)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = httpx.get(f"{srv.url}/dashboard/data", headers=srv.headers("admin"), timeout=10).json()
        if any(r["client_request_id"] == rid and r["stage"] == stage for r in data["inflight"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"{rid} never reached {stage}")


def _diagnose(srv: Served, *args: str) -> dict:
    out = subprocess.run([TOKENPATH, "diagnose", "--json", "--since", "10m", *args], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "TOKENPATH_API_KEY": srv.keys["admin"]})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# -- queued behind ---------------------------------------------------------------------------------
def test_a_short_request_behind_a_long_one_names_it(one_seq: Served):
    long_id, short_id = _rid("long"), _rid("short")
    t = _in_background(_complete, one_seq, long_id, "Tell me a story.", 150)
    _wait_running(one_seq, long_id)
    assert _complete(one_seq, short_id, "Hi", 2).status_code == 200
    t.join()
    s, long_sid = _trace(one_seq, short_id), _sid(one_seq, long_id)
    c = s["causes"][0]
    assert c["kind"] == "queued_behind" and c["request_ids"][0] == long_sid, s["causes"]
    assert c["detail"]["where"] == "engine" and c["detail"]["freed_by"] == long_sid
    stage = _stage_ms(s, c["detail"]["stage"])
    assert stage > 50 and c["ms"] >= 0.9 * stage, (c, s["stages"])


def test_a_request_queued_at_the_gateway_names_the_slot_holders_and_who_freed_one(one_seq: Served):
    # 1 running + 2 in the engine's queue fill the replica; the 4th waits in the admission queue.
    ids = [_rid(f"hold{i}") for i in range(3)]
    threads = [_in_background(_complete, one_seq, ids[0], "Tell me a story.", 400)]
    _wait_running(one_seq, ids[0])
    for rid in ids[1:]:
        threads.append(_in_background(_complete, one_seq, rid, "Tell me a story.", 30))
        _wait_running(one_seq, rid, "engine_queue")
    waiter = _rid("waiter")
    assert _complete(one_seq, waiter, "Hi", 2).status_code == 200
    for t in threads:
        t.join()
    s, sids = _trace(one_seq, waiter), [_sid(one_seq, rid) for rid in ids]
    c = _cause(s, "queued_behind")
    assert c["detail"]["where"] == "admission", s["causes"]
    assert c["detail"]["freed_by"] == sids[0] and c["request_ids"][0] == sids[0]
    assert set(sids) <= {h["request_id"] for h in c["detail"]["holders"]}
    assert c["ms"] >= 0.9 * _stage_ms(s, "queue")


# -- slow client -----------------------------------------------------------------------------------
def test_a_client_that_reads_slowly_is_named(one_seq: Served):
    """A client on a slow link: a small receive window and a small segment size (so the kernel
    does not size the server's send buffer from loopback's 64 KiB MSS), and it reads nothing for
    a while. 20 top logprobs make each token's event ~1.6 KB, so the server's buffers (~110 KB
    with asyncio's) fill within ~70 tokens and the rest of the stream waits on the client."""
    rid = _rid("slowreader")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 150,
                       "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {one_seq.keys['acme']}\r\nx-request-id: {rid}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", one_seq.port))
    sock.sendall(head + body)
    sock.settimeout(120)
    # The client reads nothing until the engine has generated every token (its replica runs
    # nothing any more), and 3 s after: the stream's end waits on the client alone.
    seen_running, deadline = False, time.monotonic() + 120
    while time.monotonic() < deadline:
        data = httpx.get(f"{one_seq.url}/dashboard/data", headers=one_seq.headers("admin"), timeout=10).json()
        running = sum(r["running"] for d in data["deployments"] for r in d["replicas"])
        seen_running = seen_running or running > 0
        if seen_running and running == 0:
            break
        time.sleep(0.1)
    engine_done = time.monotonic()
    time.sleep(3.0)
    got = b""
    while not got.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        got += chunk
    read_done = time.monotonic()
    sock.close()
    assert b"[DONE]" in got and len(got) > 200_000, len(got)
    s = _trace(one_seq, rid)
    c = s["causes"][0]
    assert c["kind"] == "slow_client", s["causes"]
    # It covers the time the stream waited on the client alone (the engine done, the client not
    # reading), and no more than the decode stage it sits in (the rest is the engine generating).
    waited_on_client = 1000 * (read_done - engine_done)
    assert 0.9 * waited_on_client <= c["ms"] <= _stage_ms(s, "decode"), (c, waited_on_client, s["stages"])


# -- decode stalled by a prefill -------------------------------------------------------------------
def test_a_long_prompt_stalling_a_decoding_stream_is_named(small_kv: Served):
    stream_id, long_id = _rid("stream"), _rid("longprompt")
    times: list[float] = []

    def stream() -> None:
        with httpx.stream("POST", f"{small_kv.url}/v1/completions", timeout=120,
                          headers=small_kv.headers(**{"x-request-id": stream_id}),
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 200, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    times.append(time.monotonic())

    t = _in_background(stream)
    while len(times) < 20:
        time.sleep(0.01)
    assert _complete(small_kv, long_id, "hello " * 1000, 1).status_code == 200
    t.join()
    s = _trace(small_kv, stream_id)
    c = _cause(s, "decode_stalled_by_prefill")
    assert c["request_ids"][0] == _sid(small_kv, long_id) and c["detail"]["slow_steps"] >= 1, c
    assert c["detail"]["prefills"][0]["tokens"] >= 900
    # It covers most of the stall the client saw: its longest gap beyond its usual one.
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    stalled_ms = 1000 * (gaps[-1] - gaps[len(gaps) // 2])
    assert c["ms"] >= 0.6 * stalled_ms, (c, stalled_ms)
    assert s["causes"][0]["kind"] == "decode_stalled_by_prefill", s["causes"]


# -- preemption ------------------------------------------------------------------------------------
def test_a_small_kv_pool_names_the_request_that_forced_a_preemption(small_kv: Served):
    """80 blocks of 16 tokens. The first request (1,000 prompt + 250 tokens: 79 blocks) is
    decoding when the second (200 + 100: 19 blocks) arrives; within a few blocks of growth they no
    longer fit, the later one is preempted, and waits for the first to finish before recomputing."""
    first, second = _rid("grower"), _rid("victim")
    t = _in_background(_complete, small_kv, first, "hello " * 1000, 250)
    _wait_running(small_kv, first)
    assert _complete(small_kv, second, "world " * 200, 100).status_code == 200  # (no prefix shared)
    t.join()
    s = _trace(small_kv, second)
    c = _cause(s, "preempted")
    assert c["request_ids"] == [_sid(small_kv, first)] and c["detail"]["times"] >= 1, c
    assert c["detail"]["recomputed_tokens"] >= 200
    stage = _stage_ms(s, c["detail"]["stage"])
    assert c["ms"] >= 0.5 * stage, (c, s["stages"])
    assert s["causes"][0]["kind"] == "preempted", s["causes"]


def test_diagnose_finds_the_stall_and_the_kv_pressure(small_kv: Served):
    report = _diagnose(small_kv, "--url", small_kv.url)
    if not {"decode_stalled_by_prefill", "preempted"} <= {f["kind"] for f in report["findings"]}:
        # Run alone (`-k diagnose`): stage the two incidents on this server first.
        test_a_long_prompt_stalling_a_decoding_stream_is_named(small_kv)
        test_a_small_kv_pool_names_the_request_that_forced_a_preemption(small_kv)
        report = _diagnose(small_kv, "--url", small_kv.url)
    kinds = {f["kind"]: f for f in report["findings"]}
    assert {"ttft", "decode_stalled_by_prefill", "preempted", "kv_pressure", "engine_busy"} <= set(kinds), kinds
    assert kinds["kv_pressure"]["evidence"]["preemptions"] >= 1
    assert kinds["decode_stalled_by_prefill"]["share"] > 0
    assert any((_trace(small_kv, i)["client_request_id"] or "").startswith("longprompt-")
               for i in kinds["decode_stalled_by_prefill"]["evidence"]["culprits"])
    assert 0 < kinds["engine_busy"]["evidence"]["busy_fraction"] <= 1
    # The engine figures are the window's (step time, batch, preemptions, KV usage mean and max).
    busy = kinds["engine_busy"]["evidence"]
    assert busy["window_s"] <= 600 + 6 and busy["steps"] > 0 and busy["mean_step_ms"] > 0, busy
    assert busy["mean_batch_seqs"] >= 1 and busy["preemptions"] >= 1 and busy["kv_usage_max"] is not None, busy
    now = httpx.get(f"{small_kv.url}/diagnose", params={"since": str(time.time())}, headers=small_kv.headers("admin"))
    (recent,) = now.json()["engines"]
    assert recent["figures"]["window_s"] <= 6 + 1 and recent["steps"] <= busy["steps"], recent
    for f in report["findings"]:
        assert f["figure"] and f["lever"] and 0 <= f["share"] <= 1
    offline = _diagnose(small_kv, "--data-dir", str(small_kv.data_dir))  # audit rows only
    assert {"ttft", "preempted"} <= {f["kind"] for f in offline["findings"]}
    # GET /diagnose needs the admin key; a bad `since` is a 400 naming it.
    assert httpx.get(f"{small_kv.url}/diagnose", headers=small_kv.headers()).status_code == 403
    bad = httpx.get(f"{small_kv.url}/diagnose", params={"since": "soon"}, headers=small_kv.headers("admin"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


# -- over engine processes -------------------------------------------------------------------------
def test_a_shared_prefix_routed_away_under_load_names_the_replica_that_held_it(two_replicas: Served):
    prefix = "You are a helpful assistant who answers carefully. " * 30
    holder, routed = _rid("prefixholder"), _rid("routedaway")
    t = _in_background(_complete, two_replicas, holder, prefix + "First question?", 400)
    _wait_running(two_replicas, holder)
    assert _complete(two_replicas, routed, prefix + "Second question?", 2).status_code == 200
    t.join()
    held, s = _trace(two_replicas, holder), _trace(two_replicas, routed)
    c = _cause(s, "prefix_elsewhere")
    assert c["detail"]["replica"] == held["replica"] != s["replica"], (c, held["replica"], s["replica"])
    assert c["detail"]["why"] == "load_threshold" and c["detail"]["blocks"] >= 10
    assert c["request_ids"] == [held["request_id"]]
    assert c["ms"] >= 0.7 * _stage_ms(s, "prefill"), (c, s["stages"])
    report = _diagnose(two_replicas, "--url", two_replicas.url)
    lost = next(f for f in report["findings"] if f["kind"] == "prefix_benefit_lost")
    assert lost["evidence"]["achievable_hit_rate"] > lost["evidence"]["achieved_hit_rate"]
    assert s["request_id"] in [d["request_id"] for d in lost["evidence"]["decisions"]]


def test_queued_in_an_engine_process_names_the_request_on_that_replica(two_replicas: Served):
    a, b, short = _rid("busyA"), _rid("busyB"), _rid("behind")
    threads = [_in_background(_complete, two_replicas, a, "Tell me a story.", 500)]
    _wait_running(two_replicas, a)
    threads.append(_in_background(_complete, two_replicas, b, "Tell me another story.", 500))
    _wait_running(two_replicas, b)
    assert _complete(two_replicas, short, "Hi", 2).status_code == 200
    for t in threads:
        t.join()
    s = _trace(two_replicas, short)
    c = s["causes"][0]
    assert c["kind"] == "queued_behind" and c["detail"]["where"] == "engine", s["causes"]
    on_replica = {t["replica"]: t["request_id"] for t in (_trace(two_replicas, x) for x in (a, b))}
    assert c["request_ids"][0] == on_replica[s["replica"]], (c, on_replica, s["replica"])
    assert c["ms"] >= 0.9 * _stage_ms(s, "engine_queue")


# -- upload ----------------------------------------------------------------------------------------
def test_a_body_that_trickles_in_is_named_upload(one_seq: Served):
    rid = _rid("trickle")
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {one_seq.keys['acme']}\r\nx-request-id: {rid}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", one_seq.port), timeout=60) as sock:
        sock.sendall(head + body[:10])
        time.sleep(1.0)  # a slow uplink
        sock.sendall(body[10:])
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    timing = dict(re.findall(rb"(\w+);dur=([\d.]+)", got.split(b"\r\n\r\n")[0]))
    assert float(timing[b"upload"]) >= 900, timing  # a stage of its own in Server-Timing
    s = _trace(one_seq, rid)
    assert s["dominant_stage"] == "upload" and _stage_ms(s, "upload") >= 900, s["stages"]
    assert _stage_ms(s, "gateway") < 0.5 * _stage_ms(s, "upload"), s["stages"]  # the wait is not the gateway's
    c = s["causes"][0]
    assert c["kind"] == "upload" and c["detail"]["stage"] == "upload", s["causes"]
    assert c["ms"] >= 0.9 * _stage_ms(s, "upload") and c["detail"]["body_bytes"] == len(body), (c, s["stages"])
    assert s["total_ms"] >= c["ms"]
