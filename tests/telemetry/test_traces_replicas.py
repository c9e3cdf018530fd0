"""`serve --replicas 2 --otlp-endpoint`: one request is one trace across processes.

The gateway sends `traceparent` naming its `dispatch` span to the engine process it picked;
that process (exporting to the same receiver) makes its own request root a child of it, with
its engine queue/prefill/decode spans beneath, all inside the gateway's dispatch span in time.
Each engine span is exported once (by the engine process; the gateway builds none of its own
for it), and with OTEL_SERVICE_NAME set for the gateway the engines still export as a service
of their own (`{name}-engine`). The engine's SERVER span carries the GenAI attributes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.telemetry.conftest import CHAT_MODEL, Served, chat, launch, stop
from tests.telemetry.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow
SERVICE = "shop-gateway"


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    receiver = OtlpReceiver().start()
    srv = launch(tmp_path_factory.mktemp("replicas"), receiver, "--replicas", "2", wait=600,
                 env={"OTEL_SERVICE_NAME": SERVICE})
    try:
        yield srv
    finally:
        code = stop(srv)
        receiver.stop()
    assert code == 0, srv.output()[-3000:]


def test_one_trace_spans_the_gateway_and_the_engine_process(two_replicas: Served):
    srv = two_replicas
    with httpx.Client(base_url=srv.url, timeout=300) as http, http.stream(
            "POST", "/v1/chat/completions", headers=srv.headers(), json=chat(8, stream=True)) as resp:
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
        assert "[DONE]" in "".join(resp.iter_lines())
    roots = srv.receiver.wait_for(lambda s: s["attributes"].get("gen_ai.response.id") == rid
                                  and s["service"] == SERVICE, timeout=30)
    assert len(roots) == 1
    root = roots[0]
    srv.receiver.wait_for(lambda s: s["trace_id"] == root["trace_id"] and s["service"] == f"{SERVICE}-engine"
                          and s["name"] == "engine.decode", timeout=30)
    time.sleep(1.0)  # a second copy, if any were sent, would be batched within OTEL_BSP_SCHEDULE_DELAY
    spans = srv.receiver.trace(root["trace_id"])
    services = {s["service"] for s in spans}
    assert services == {SERVICE, f"{SERVICE}-engine"}, services
    dispatch = next(s for s in spans if s["name"].startswith("dispatch ") and s["service"] == SERVICE)
    assert dispatch["parent_id"] == root["span_id"] and dispatch["attributes"]["tokenpath.replica"].startswith("engine-")
    engine_root = next(s for s in spans if s["service"] == f"{SERVICE}-engine" and s["kind"] == "SPAN_KIND_SERVER")
    assert engine_root["parent_id"] == dispatch["span_id"]
    ids = {s["span_id"] for s in spans}
    assert all(s["parent_id"] in ids for s in spans if s is not root)
    # Each engine span exactly once in the trace, and the engine process's.
    engine_spans = [s for s in spans if s["name"].startswith("engine.")]
    assert sorted(s["name"] for s in engine_spans) == ["engine.decode", "engine.prefill", "engine.queue"]
    assert {s["service"] for s in engine_spans} == {f"{SERVICE}-engine"}
    assert all(s["parent_id"] == engine_root["span_id"] for s in engine_spans)
    for s in engine_spans:
        assert dispatch["start"] <= s["start"] <= s["end"] <= dispatch["end"], s["name"]
    by_name = {s["name"]: s for s in engine_spans}
    a, ga = engine_root["attributes"], root["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "tokenpath"
    assert a["gen_ai.request.model"] == CHAT_MODEL and a["gen_ai.response.id"] == rid
    assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == ga["gen_ai.usage.input_tokens"]
    assert a["gen_ai.usage.output_tokens"] == ga["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    prefill = by_name["engine.prefill"]
    assert sum(e["attributes"]["tokens"] for e in prefill["events"]) == (
        a["gen_ai.usage.input_tokens"] - a["tokenpath.cached_tokens"]), prefill["events"]
    assert by_name["engine.decode"]["attributes"]["tokenpath.itl.p50_ms"] > 0


def test_a_completion_is_a_text_completion_on_the_engine_span_too(two_replicas: Served):
    srv = two_replicas
    with httpx.Client(base_url=srv.url, timeout=300) as http:
        resp = http.post("/v1/completions", headers=srv.headers(), json={
            "model": CHAT_MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    (root,) = srv.receiver.wait_for(lambda s: s["attributes"].get("gen_ai.response.id") == rid
                                    and s["service"] == SERVICE, timeout=30)
    engine = srv.receiver.wait_for(lambda s: s["trace_id"] == root["trace_id"] and s["kind"] == "SPAN_KIND_SERVER"
                                   and s["service"] == f"{SERVICE}-engine", timeout=30)
    assert len(engine) == 1 and engine[0]["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert root["attributes"]["gen_ai.operation.name"] == "text_completion"
