"""Embeddings take the chat path: admission, replicas, Timeline stages, /metrics, /health.

Three real `tokenpath serve` processes serving all-MiniLM-L6-v2, driven with the real `openai`
client: in-process (the default), as two engine processes (`--embedding-replicas 2`), and as one
engine process behind tiny admission limits (a routing file: one request at a time, no queue).
Slow: the encoder loads five times.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from tests.api.conftest import EMBED_MODEL, Server

from tokenpath.telemetry.timeline import STAGES

pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hi", "Ünïcödé and emoji 🚀", "paged attention"]
TIGHT = f"""
deployments:
  - name: {EMBED_MODEL}
    task: embedding
    replicas: [{{local: 1}}]
    pool: {{max_inflight: 1}}
    admission: {{max_queue: 0}}
"""


@pytest.fixture(scope="module")
def servers(server_factory, tmp_path_factory):
    routing = tmp_path_factory.mktemp("routing") / "tight.yaml"
    routing.write_text(TIGHT)
    return (server_factory("--model", EMBED_MODEL), server_factory("--model", EMBED_MODEL, "--embedding-replicas", "2"),
            server_factory("--model", EMBED_MODEL, "--routing", str(routing)))


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def count(srv: Server, pattern: str) -> float:
    """The sum of every /metrics sample whose line matches `pattern` (labels in any order)."""
    text = httpx.get(srv.url + "/metrics").text
    return sum(float(m.group(1)) for line in text.splitlines() if re.search(pattern, line)
               for m in [re.search(r" (\S+)$", line)] if not line.startswith("#"))


def engine_pids(srv: Server) -> dict[str, int]:
    log_dir = srv.log.parent / "data" / "logs" / "engines"
    return {p.stem: int(re.findall(r"started \(pid (\d+)\)", p.read_text())[-1]) for p in log_dir.glob("embed-*.log")}


def test_same_vectors_and_stages_in_process_and_as_replicas(servers):
    local, replicas, _ = servers
    results = {}
    for srv in (local, replicas):
        raw = client(srv).embeddings.with_raw_response.create(model=EMBED_MODEL, input=TEXTS)
        timing = dict(re.findall(r"(\w+);dur=([0-9.]+)", raw.headers["server-timing"]))
        # gateway, queue, engine_queue, prefill, decode, total (an embedding never reasons)
        assert list(timing) == [s for s in STAGES if s not in ("reasoning", "model_load")], timing
        stages = {k: float(v) for k, v in timing.items()}
        assert all(v >= 0 for v in stages.values())
        assert sum(v for k, v in stages.items() if k != "total") == pytest.approx(stages["total"], abs=0.5)
        results[srv.port] = [d.embedding for d in raw.parse().data]
    a, b = results.values()
    assert len(a) == len(TEXTS) and len(a[0]) == 384
    assert a == b  # float32 over the link: the very same numbers
    health = httpx.get(replicas.url + "/health").json()
    assert health["status"] == "ok" and set(health["replicas"][EMBED_MODEL]) == {"embed-0", "embed-1"}


def test_metrics_count_embedding_requests(servers):
    for srv in servers[:2]:
        model = rf'model_name="{EMBED_MODEL}"'
        ok = rf'tokenpath:requests_total\{{(?=.*endpoint="/v1/embeddings")(?=.*{model})(?=.*status="200")'
        prefill = rf'tokenpath:request_stage_seconds_count\{{(?=.*{model})(?=.*stage="prefill")'
        e2e = rf'tokenpath:embedding_request_latency_seconds_count\{{(?=.*{model})'
        before = [count(srv, p) for p in (ok, prefill, e2e)]
        for i in range(3):
            client(srv).embeddings.create(model=EMBED_MODEL, input=f"count me {i}")
        assert [count(srv, p) - b for p, b in zip((ok, prefill, e2e), before, strict=True)] == [3, 3, 3]


def test_overload_is_a_429_with_retry_after(servers):
    """One request at a time and no queue: while a long request holds the only slot (its
    dispatch is seen on /metrics first), the next is refused at once by admission."""
    tight = servers[2]
    admitted = r'tokenpath:admissions_total\{.*outcome="immediate"'
    before = count(tight, admitted)
    long_inputs = [f"sentence {i} " + "lorem ipsum dolor sit amet " * 25 for i in range(12)]
    first: dict = {}
    holder = threading.Thread(target=lambda: first.update(r=client(tight).embeddings.create(
        model=EMBED_MODEL, input=long_inputs)))
    holder.start()
    deadline = time.monotonic() + 30
    while count(tight, admitted) == before:
        assert time.monotonic() < deadline and holder.is_alive()
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as err:
        client(tight).embeddings.create(model=EMBED_MODEL, input="one more")
    holder.join(120)
    assert len(first["r"].data) == 12  # the one admitted is served
    response = err.value.response
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "queue_full"
    assert count(tight, r'tokenpath:admission_rejections_total\{.*reason="queue_full"') >= 1
    # Once the slot is free, requests are admitted again.
    assert len(client(tight).embeddings.create(model=EMBED_MODEL, input="now").data) == 1


def test_health_stays_200_degraded_while_one_replica_is_down(servers):
    """An operator's /health: 200 while every model has a healthy replica (the body says which
    is down, within a second of its death), `ok` again once the engine is restarted."""
    replicas = servers[1]
    pids = engine_pids(replicas)
    victim = "embed-0"
    killed = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    while (h := httpx.get(replicas.url + "/health")).json()["replicas"][EMBED_MODEL][victim]["healthy"]:
        assert time.monotonic() - killed < 1.5, "health must see the death within a second"
        time.sleep(0.05)
    assert h.status_code == 200 and h.json()["status"] == "degraded" and h.json()["models"][EMBED_MODEL]
    assert h.json()["replicas"][EMBED_MODEL][victim]["state"] == "down"
    for i in range(3):  # the other engine serves meanwhile
        assert len(client(replicas).embeddings.create(model=EMBED_MODEL, input=f"still {i}").data) == 1
    # The restart is a new process importing torch and loading the model: seconds on a quiet
    # machine, over 30 s on 2 cores at load 9; the bound only catches a restart that never comes.
    while (h := httpx.get(replicas.url + "/health")).json()["status"] != "ok":
        assert h.status_code == 200 and time.monotonic() - killed < 120, replicas.output()[-2000:]
        time.sleep(0.2)
    assert engine_pids(replicas)[victim] != pids[victim]
