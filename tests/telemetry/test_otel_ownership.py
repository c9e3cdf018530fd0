"""Each span has one owner, engines name their own service, and the GenAI metrics, without a
server: providers and readers of the test's own (no process-wide state is touched).

- an engine that exported its own spans says so on its last output; that flag survives the
  engine link and reaches the Timeline, and the gateway then builds `dispatch` with no engine
  spans under it;
- the engine's SERVER span carries the GenAI attributes and the prefill/decode detail;
- one finished request is one reading of each GenAI histogram, with the conventions' units and
  buckets, `error.type` on failures and no token/latency readings for them.
"""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind

from tokenpath.protocol import CompletionOutput, GenerateRequest, RequestOutput, SamplingParams
from tokenpath.protocol.outputs import EngineEvents
from tokenpath.protocol.wire import decode_output, decode_request, encode_output, encode_request
from tokenpath.replica.events import stamp_events
from tokenpath.telemetry.engine_spans import EngineSpanRecord, record_engine_trace, will_export
from tokenpath.telemetry.otel import begin_trace
from tokenpath.telemetry.otel_env import engine_service_name
from tokenpath.telemetry.otel_metrics import DURATION_BUCKETS, TTFT_BUCKETS, record_genai_metrics
from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.timeline import Timeline
from tokenpath.telemetry.tracing import record_trace

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _timeline(provider: TracerProvider | None = None) -> Timeline:
    t = Timeline("chatcmpl-1")
    if provider is not None:
        begin_trace(t, {}, provider)
    t0 = t.stamps["received"]
    for i, stage in enumerate(("authenticated", "routed", "tokenized", "admitted", "dispatched", "scheduled",
                               "first_token", "finished")):
        t.stamp(stage, at=t0 + 0.1 * (i + 1))
    t.attrs.update(replica="engine-0", policy="prefix_aware", reason="cold")
    return t


def test_the_traced_flag_crosses_the_link_and_the_gateway_leaves_engine_spans_to_the_engine(traced):
    req = GenerateRequest("chatcmpl-1", [1, 2, 3], SamplingParams(max_tokens=2), traceparent=PARENT,
                          operation="chat")
    assert decode_request(encode_request(req)).operation == "chat"
    last = RequestOutput("chatcmpl-1", [CompletionOutput(0, "hi", [5], finish_reason="length")], [1, 2, 3], 0,
                         finished=True,
                         events=EngineEvents(1.0, 1.1, 1.2, 1.3, [(1.2, 3)], traced=True))
    back = decode_output(encode_output(last), req)
    assert back.events.traced and back.events.shifted(0.5).traced and back.events.snapshot().traced

    provider, exporter = traced
    t = _timeline(provider)
    stamp_events(t, back, now=t.stamps["finished"])
    assert t.attrs["engine_traced"] is True
    record_trace(FinishedRequest(t, "/v1/chat/completions", 200, requested_model="m", model="m"), provider)
    names = [s.name for s in exporter.get_finished_spans()]
    assert "dispatch engine-0" in names and not [n for n in names if n.startswith("engine.")], names

    exporter.clear()  # without the flag (in-process, or a remote replica) the gateway builds them, once
    record_trace(FinishedRequest(_timeline(provider), "/v1/chat/completions", 200, model="m"), provider)
    names = [s.name for s in exporter.get_finished_spans()]
    assert sorted(n for n in names if n.startswith("engine.")) == ["engine.decode", "engine.prefill", "engine.queue"]


def test_the_engine_span_carries_the_genai_attributes(traced):
    provider, exporter = traced
    assert will_export(provider, PARENT) and not will_export(None, PARENT) and not will_export(provider, None)
    now = time.monotonic()
    record_engine_trace(provider, EngineSpanRecord(
        request_id="cmpl-9", model="m", traceparent=PARENT, operation="text_completion", queued=now,
        scheduled=now + 0.01, first_token=now + 0.05, finished=now + 0.2, prompt_tokens=12, completion_tokens=3,
        cached_tokens=4, preemptions=0, prefill_chunks=[(now + 0.05, 8)], token_times=[now + 0.05, now + 0.1, now + 0.2],
        finish_reasons=["length"], max_tokens=3, temperature=0.5, top_p=0.9, seed=1))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["engine m"]
    assert root.kind is SpanKind.SERVER and f"{root.parent.span_id:016x}" == "b7ad6b7169203331"
    a = root.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.provider.name"] == "tokenpath"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "m" and a["gen_ai.response.id"] == "cmpl-9"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"],
            a["gen_ai.request.seed"]) == (3, 0.5, 0.9, 1)
    assert a["gen_ai.usage.input_tokens"] == 12 and a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert [e.attributes["tokens"] for e in spans["engine.prefill"].events] == [8]
    assert spans["engine.decode"].attributes["tokenpath.itl.max_ms"] == pytest.approx(100, abs=0.5)
    for name in ("engine.queue", "engine.prefill", "engine.decode"):
        assert spans[name].parent.span_id == root.context.span_id


def test_engines_get_their_own_service_name(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert engine_service_name() == "tokenpath-engine"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "shop-gateway")
    assert engine_service_name() == "shop-gateway-engine"


def _points(reader: InMemoryMetricReader) -> dict[str, list]:
    out: dict[str, list] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend((m.unit, p) for p in m.data.data_points)
    return out


def test_one_finished_request_is_one_reading_of_each_genai_metric():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    t = _timeline()
    ok = FinishedRequest(t, "/v1/chat/completions", 200, requested_model="m", model="m", prompt_tokens=15,
                         completion_tokens=5, server_address="127.0.0.1", server_port=8000)
    record_genai_metrics(ok, "m", provider)
    bad = Timeline("chatcmpl-2")
    bad.stamp("finished", at=bad.stamps["received"] + 0.003)
    record_genai_metrics(FinishedRequest(bad, "/v1/chat/completions", 400, requested_model="nope",
                                         error_code="model_not_found"), "unknown", provider)
    points = _points(reader)
    assert set(points) == {"gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
                           "gen_ai.server.time_per_output_token", "gen_ai.client.token.usage"}
    durations = {p.attributes.get("error.type"): (unit, p) for unit, p in points["gen_ai.server.request.duration"]}
    unit, good = durations[None]
    assert unit == "s" and good.count == 1 and good.sum == pytest.approx(0.8, abs=1e-6)
    assert tuple(good.explicit_bounds) == DURATION_BUCKETS
    assert good.attributes["gen_ai.operation.name"] == "chat" and good.attributes["gen_ai.request.model"] == "m"
    assert durations["model_not_found"][1].attributes["gen_ai.request.model"] == "unknown"
    ((unit, ttft),) = points["gen_ai.server.time_to_first_token"]
    assert unit == "s" and ttft.count == 1 and ttft.sum == pytest.approx(0.7, abs=1e-6)
    assert tuple(ttft.explicit_bounds) == TTFT_BUCKETS
    ((unit, tpot),) = points["gen_ai.server.time_per_output_token"]
    assert unit == "s" and tpot.sum == pytest.approx(0.1 / 4, abs=1e-6)
    usage = {p.attributes["gen_ai.token.type"]: (unit, p) for unit, p in points["gen_ai.client.token.usage"]}
    assert usage["input"][0] == "{token}" and usage["input"][1].sum == 15 and usage["output"][1].sum == 5
    assert usage["input"][1].count == usage["output"][1].count == 1
