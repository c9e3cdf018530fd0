"""One request, one record, in-process and across the engine link.

The same greedy requests against `tokenpath serve` (engine in-process) and `tokenpath serve
--replicas 2` (two engine processes on the engine link): the same Timeline stages in Server-Timing,
the body and the audit row; every stage >= 0 and summing to `total`; token-identical text; the
gateway's per-stage histograms counting every request; prefix-cache hits reported back; the server's
own request id in the response, the audit row and the engine process's log, with the client's
x-request-id kept beside it (`client_request_id`, `x-client-request-id`); an engine SIGKILL
failing its stream cleanly, /health degraded then ok, and the restart counted. Slow: loads the
model three times (gateway tokenizer aside).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest
from tests.api.conftest import CHAT_MODEL, Server

from tokenpath.gateway.store import GatewayStore, resolve_store_location
from tokenpath.telemetry.timeline import STAGES

pytestmark = pytest.mark.slow

FLAGS = ("--model", CHAT_MODEL, "--num-kv-blocks", "256")
PROMPTS = ["Name three colors.", "What is 2 + 2?", "Say hello in French."]
LONG = "Here is a long shared context about the history of tea. " * 12


@pytest.fixture(scope="module")
def servers(server_factory):
    # The replicated one starts from an empty data dir, as a user's first start does: its two
    # engine processes build SmolLM2's tokenizer from the GGUF at once, and one publishes it
    # (the other test servers find it built: tests/server_data.py).
    return server_factory(*FLAGS), server_factory(*FLAGS, "--replicas", "2", fresh_data_dir=True)


def chat(srv: Server, content: str, **headers: str) -> httpx.Response:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "temperature": 0}
    r = httpx.post(srv.base_url + "/chat/completions", json=body, headers=headers, timeout=180)
    assert r.status_code == 200, r.text
    return r


def server_timing(r: httpx.Response) -> dict[str, float]:
    return {k: float(v) / 1000 for k, v in re.findall(r"(\w+);dur=([0-9.]+)", r.headers["server-timing"])}


def audit_row(srv: Server, request_id: str, *, client: bool = False):
    """The closed audit row of a request, by its server id (or by the client's id, `client`)."""
    store = GatewayStore(resolve_store_location(srv.log.parent / "data"))
    key = {"client_request_id" if client else "request_id": request_id}
    try:
        deadline = time.monotonic() + 30
        # (a row is opened at admission with status 0 and closed when the request ends)
        while (not (rows := store.query_audit(**key)) or rows[0].status == 0) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        (row,) = rows
        return row
    finally:
        store.close()


def hist_count(srv: Server, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    m = re.search(rf'^tokenpath:{name}_count\{{model_name="{CHAT_MODEL}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_same_stages_same_tokens_in_process_and_over_the_link(servers):
    texts = {}
    for srv in servers:
        for i, prompt in enumerate(PROMPTS):
            rid = f"same-{srv.port}-{i}"
            r = chat(srv, prompt, **{"x-request-id": rid})
            assert r.headers["x-client-request-id"] == rid and r.headers["x-request-id"] != rid
            header = server_timing(r)
            body = r.json()["tokenpath"]["timing"]
            row = audit_row(srv, r.headers["x-request-id"])
            assert row.client_request_id == rid
            audited = {k: v / 1000 for k, v in json.loads(row.timing)["stages_ms"].items()}  # (0.1 ms steps)
            assert (row.queue_s, row.prefill_s, row.decode_s, row.total_s) == pytest.approx(tuple(
                body[k] for k in ("queue", "prefill", "decode", "total")))
            plain = [s for s in STAGES if s not in ("reasoning", "model_load")]  # (SmolLM2 never reasons; no load)
            assert list(header) == list(body) == list(audited) == plain, (header, body, audited)
            assert all(v is not None and v >= 0 for v in audited.values()), audited
            assert all(v >= 0 for v in body.values())
            assert sum(v for k, v in body.items() if k != "total") == pytest.approx(body["total"], abs=0.005)
            assert body == pytest.approx(audited, abs=0.00006)
            assert header == pytest.approx(body, abs=0.0006)  # (the header is rounded to 0.1 ms)
            texts.setdefault(prompt, []).append(r.json()["choices"][0]["message"]["content"])
    assert all(a == b for a, b in texts.values()), texts


def test_histograms_count_every_request_over_the_link(servers):
    _, replicas = servers
    names = ("time_to_first_token_seconds", "request_gateway_time_seconds", "request_queue_time_seconds",
             "request_gateway_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
             "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens")
    before = {n: hist_count(replicas, n) for n in names}
    for i in range(4):
        chat(replicas, f"Count to {i + 2}.")
    assert {n: hist_count(replicas, n) - before[n] for n in names} == dict.fromkeys(names, 4.0)


def step_counts(srv: Server) -> dict[tuple[str, str], float]:
    """{(series, replica): count} of the engine step histograms on the gateway's /metrics."""
    text = httpx.get(srv.url + "/metrics").text
    pattern = (rf'^tokenpath:(engine_step_seconds|iteration_seqs|iteration_tokens_total)_count'
               rf'\{{model_name="{CHAT_MODEL}",replica="([^"]+)"\}} (\S+)$')
    return {(name, replica): float(n) for name, replica, n in re.findall(pattern, text, re.M)}


def test_engine_step_histograms_per_replica_in_process_and_over_the_link(servers):
    """Step time, batch sequences and batch tokens reach the gateway's /metrics from each engine
    process (over the link's state frames), labelled by replica, under the in-process names."""
    names = {"engine_step_seconds", "iteration_seqs", "iteration_tokens_total"}
    for srv, n_replicas in zip(servers, (1, 2), strict=True):
        before = step_counts(srv)
        for i in range(4):  # short distinct raw prompts: cold, so they rotate over idle replicas
            r = httpx.post(srv.base_url + "/completions", timeout=180, json={
                "model": CHAT_MODEL, "prompt": f"Number {i}:", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        time.sleep(0.3)  # (an engine process pushes its counts every 100 ms)
        after = step_counts(srv)
        replicas = {rep for _, rep in after}
        assert len(replicas) == n_replicas, after
        assert {name for name, _ in after} == names
        for name in names:  # every replica stepped, and every step counted in each series
            assert all(after[name, rep] > before.get((name, rep), 0) for rep in replicas), (name, after)
        steps = sum(after["engine_step_seconds", rep] - before.get(("engine_step_seconds", rep), 0)
                    for rep in replicas)
        assert steps >= 4 * 4, after  # (>= one step per token per request)


def test_prefix_cache_hits_come_back_over_the_link(servers):
    _, replicas = servers
    text = httpx.get(replicas.url + "/metrics").text
    hits = lambda t: float(re.search(r'^tokenpath:prefix_cache_hits_total\{.*\} (\S+)$', t, re.M).group(1))  # noqa: E731
    first = chat(replicas, LONG + "Question one?")
    second = chat(replicas, LONG + "Question two?")
    assert first.json()["usage"]["prompt_tokens"] > 100
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
    assert hits(httpx.get(replicas.url + "/metrics").text) - hits(text) >= 96


def test_server_request_id_reaches_the_engine_process_with_the_client_id_beside_it(servers):
    """The engine runs the request under the server's id (unique: a client's id is not), and
    the client's id is kept beside it in the audit row and echoed in `x-client-request-id`."""
    _, replicas = servers
    client_id = "client-trace-7f3a9c"
    r = chat(replicas, "Hi!", **{"x-request-id": client_id})
    rid = r.headers["x-request-id"]
    assert rid.startswith("chatcmpl-") and r.json()["id"] == rid
    assert r.headers["x-client-request-id"] == client_id
    row = audit_row(replicas, rid)
    assert row.status == 200 and row.client_request_id == client_id
    log_dir = replicas.log.parent / "data" / "logs" / "engines"
    deadline = time.monotonic() + 10  # (the engine's log line may trail its last output by a moment)
    while f"request {rid} finished" not in (logs := "".join(p.read_text() for p in log_dir.glob("*.log"))):
        assert time.monotonic() < deadline, logs[-2000:]
        time.sleep(0.1)
    assert f"request {rid} queued" in logs
    assert client_id not in logs  # (the engine never sees the client's id)
    # A malformed client id is neither echoed nor kept.
    bad = chat(replicas, "Hi!", **{"x-request-id": "bad id with spaces"})
    assert bad.headers["x-request-id"].startswith("chatcmpl-") and "x-client-request-id" not in bad.headers
    assert audit_row(replicas, bad.headers["x-request-id"]).client_request_id is None


def test_engine_sigkill_mid_stream_then_health_and_traffic_come_back(servers):
    """The gateway's view of an engine death: the stream in flight ends with a clean error event
    (no hang), /health says `degraded` naming the engine within a second (still 200: the other
    engine serves the model), then `ok` within 30 s once it is restarted,
    and requests are served meanwhile by the other engine and after by both."""
    _, replicas = servers
    log_dir = replicas.log.parent / "data" / "logs" / "engines"
    pids = {p.stem: int(re.findall(r"started \(pid (\d+)\)", p.read_text())[-1]) for p in log_dir.glob("*.log")}
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=replicas.base_url, timeout=60) as client, \
            client.stream("POST", "/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        doomed = r.headers["x-request-id"]  # (the id its engine logged it under)
        victim = next(name for name, _ in sorted(pids.items())
                      if doomed in (log_dir / f"{name}.log").read_text())
        killed = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        rest = [line for line in lines if line]  # must end, not hang
    assert time.monotonic() - killed < 10
    assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]", rest[-3:]
    while (h := httpx.get(replicas.url + "/health")).json()["replicas"][CHAT_MODEL][victim]["healthy"]:
        assert time.monotonic() - killed < 1.5, "health must see the death within a second"
        time.sleep(0.05)
    # The model still has a healthy replica: 200, `degraded`, naming the dead one (as a k8s
    # readiness probe or a LiteLLM health check expects; 503 only when a model has none left).
    assert h.status_code == 200 and h.json()["status"] == "degraded", h.json()
    assert h.json()["replicas"][CHAT_MODEL][victim]["state"] == "down"
    assert chat(replicas, "Still there?").status_code == 200  # the other engine serves meanwhile
    while (h := httpx.get(replicas.url + "/health")).json()["status"] != "ok":
        assert h.status_code == 200, h.json()
        assert time.monotonic() - killed < 30, replicas.output()[-2000:]
        time.sleep(0.5)
    restarted = time.monotonic() - killed
    assert "died with exit code -9" in replicas.output() and "restarted" in replicas.output()
    metrics = httpx.get(replicas.url + "/metrics").text
    assert re.search(rf'tokenpath:replica_restarts_total\{{.*replica="{victim}".*\}} 1\.0', metrics)
    for i in range(3):
        chat(replicas, f"Back {i}?")
    print(f"engine restart to healthy: {restarted:.1f}s")


def test_reset_prefix_cache_reaches_every_engine_process(servers):
    """POST /reset_prefix_cache crosses the engine link to each engine process: the next request
    with a cached prefix comes back cold."""
    _, replicas = servers
    chat(replicas, LONG + "Question three?")
    warm = chat(replicas, LONG + "Question four?")
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
    r = httpx.post(replicas.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and len(r.json()["replicas"]) == 2, r.text
    cold = chat(replicas, LONG + "Question five?")
    assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
