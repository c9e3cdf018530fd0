"""A mixture of experts' routing figures reach `/metrics` and `/diagnose` from an engine process:
the sparse layers' counters (`EngineState.moe_experts`) cross the engine link in the state frame,
`/metrics` sums them per model (`tokenpath:moe_expert_rows_total` ...), and `/diagnose` puts the
window's rows per expert read and the busiest expert's load in the engine's figures. A dense model
gets no such series."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.engine.tiny_models import cached_tiny

pytestmark = pytest.mark.requires("kernels")

K, SPARSE = 2, 2  # tests/engine/tiny_models.py's qwen3moe: top-2, two sparse layers


def _counter(text: str, name: str, model: str) -> float:
    m = re.search(rf'^tokenpath:{name}_total\{{model_name="{re.escape(model)}"\}} (\S+)$', text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_expert_counters_reach_metrics_and_diagnose_over_the_engine_link(server_factory, server):
    path = str(cached_tiny("qwen3moe"))
    srv = server_factory("--model", path, "--served-model-name", "tiny-moe", "--replicas", "1",
                         "--max-model-len", "512", "--kv-cache-memory", "16MiB")
    since = time.time() - 1
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        dep = http.get("/v1/models").json()["data"][0]["root"]  # the deployment /metrics labels ("tiny-moe": an alias)
        rows0 = _counter(http.get("/metrics").text, "moe_expert_rows", dep)

        def ask(i: int) -> int:
            r = http.post("/v1/completions", json={"model": "tiny-moe", "prompt": f"tell me {i} things about",
                                                   "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["prompt_tokens"]) + 5  # the 6th token needs no step of its own

        tokens = sum(ThreadPoolExecutor(4).map(ask, range(4)))
        deadline = time.monotonic() + 10
        while True:  # the state frame after the last step may be a moment behind the replies
            text = http.get("/metrics").text
            rows = _counter(text, "moe_expert_rows", dep) - rows0
            if rows >= tokens * K * SPARSE or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert rows == tokens * K * SPARSE
        reads = _counter(text, "moe_experts_read", dep)
        layer_steps = _counter(text, "moe_layer_steps", dep)
        assert K * layer_steps <= reads <= 8 * layer_steps
        assert _counter(text, "moe_busiest_expert_rows", dep) >= layer_steps
        report = http.get("/diagnose", params={"since": str(since)}).json()
    (engine,) = report["engines"]
    assert engine["moe_expert_rows"] > 0 and 1.0 <= engine["figures"]["expert_rows_per_read"] <= 4 * K
    busy = next(f for f in report["findings"] if f["kind"] == "engine_busy")
    assert busy["evidence"]["busiest_expert_vs_mean"] >= 1.0
    assert "moe_expert_rows" not in httpx.get(server.url + "/metrics", timeout=60).text  # SmolLM2: dense
