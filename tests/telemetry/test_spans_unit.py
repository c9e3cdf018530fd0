"""Spans from a Timeline, without a server: shapes, ids chosen on arrival, error roots, text
only when allowed. A provider of the test's own (no process-wide state is touched)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, StatusCode

from tokenpath.telemetry.otel import begin_trace
from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.timeline import Timeline
from tokenpath.telemetry.tracing import record_trace


def _timeline(headers: dict[str, str], provider: TracerProvider) -> Timeline:
    t = Timeline("chatcmpl-1")
    begin_trace(t, headers, provider)
    t0 = t.stamps["received"]
    for i, stage in enumerate(("authenticated", "routed", "tokenized", "admitted", "dispatched", "scheduled",
                               "first_token", "finished")):
        t.stamp(stage, at=t0 + 0.1 * (i + 1))
    t.attrs.update(replica="r0", policy="prefix_aware", reason="cold")
    t.attrs["prefill_chunks"] = [(t0 + 0.65, 10), (t0 + 0.7, 5)]
    return t


def test_spans_follow_the_timeline_and_the_ids_chosen_on_arrival(traced):
    provider, exporter = traced
    t = _timeline({}, provider)
    t0 = t.stamps["received"]
    rec = FinishedRequest(t, "/v1/chat/completions", 200, requested_model="m", model="m", prompt_tokens=15,
                          completion_tokens=3, finish_reasons=["stop"], tenant="acme", key_prefix="tp-abc",
                          token_times=[t0 + 0.7, t0 + 0.75, t0 + 0.85])
    record_trace(rec, provider)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, dispatch = spans["chat m"], spans["dispatch r0"]
    assert root.kind is SpanKind.SERVER and dispatch.kind is SpanKind.CLIENT and root.parent is None
    # The ids promised before the spans existed (log line, traceparent sent to a remote replica).
    assert f"{root.context.trace_id:032x}" == t.attrs["trace_id"]
    assert f"{root.context.span_id:016x}" == t.attrs["trace_root"]
    assert f"{dispatch.context.span_id:016x}" == t.attrs["trace_dispatch"]
    assert t.attrs["traceparent"] == f"00-{t.attrs['trace_id']}-{t.attrs['trace_dispatch']}-01"
    assert (root.end_time - root.start_time) / 1e9 == pytest.approx(0.8, abs=1e-3)
    for name in ("gateway.auth", "gateway.route", "gateway.tokenize", "gateway.rate_limit", "admission.queue"):
        assert spans[name].parent.span_id == root.context.span_id
        assert (spans[name].end_time - spans[name].start_time) / 1e9 == pytest.approx(0.1, abs=1e-3)
    for name in ("engine.queue", "engine.prefill", "engine.decode"):
        assert spans[name].parent.span_id == dispatch.context.span_id
    assert [e.attributes["tokens"] for e in spans["engine.prefill"].events] == [10, 5]
    assert spans["engine.decode"].attributes["tokenpath.itl.max_ms"] == pytest.approx(100, abs=0.01)
    assert root.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert root.attributes["tokenpath.key_prefix"] == "tp-abc" and "gen_ai.input.messages" not in root.attributes


def test_caller_parent_error_root_and_text_only_when_given(traced):
    provider, exporter = traced
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    t = Timeline("chatcmpl-2")
    begin_trace(t, {"traceparent": caller}, provider)
    t.stamp("authenticated")
    t.stamp("finished")
    rec = FinishedRequest(t, "/v1/chat/completions", 429, requested_model="m", error_type="rate_limit_error",
                          error_code="rate_limit_exceeded", incoming_headers={"traceparent": caller},
                          prompt_text="hello")
    record_trace(rec, provider)
    (root,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert f"{root.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert f"{root.parent.span_id:016x}" == "b7ad6b7169203331" and root.parent.is_remote
    assert root.status.status_code is StatusCode.ERROR and root.attributes["error.type"] == "rate_limit_exceeded"
    assert "hello" in root.attributes["gen_ai.input.messages"]


def test_tracing_off_builds_nothing_but_forwards_the_callers_traceparent():
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    t = Timeline("x")
    begin_trace(t, {"traceparent": caller})  # no SDK provider installed in this process
    assert t.attrs["traceparent"] == caller and t.attrs["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    record_trace(FinishedRequest(t, "/v1/completions", 200))  # a no-op, and no error


def test_embeddings_get_their_own_root_and_encoder_span(traced):
    provider, exporter = traced
    t = Timeline("embd-1")
    begin_trace(t, {}, provider)
    for i, stage in enumerate(("authenticated", "routed", "tokenized", "admitted", "scheduled", "finished")):
        t.stamp(stage, at=t.stamps["received"] + 0.01 * (i + 1))
    record_trace(FinishedRequest(t, "/v1/embeddings", 200, requested_model="e", model="e", prompt_tokens=9), provider)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["embeddings e"].attributes["gen_ai.operation.name"] == "embeddings"
    assert spans["engine.embed"].parent.span_id == spans["embeddings e"].context.span_id


def test_dispatched_embeddings_get_queue_and_encoder_spans_under_dispatch(traced):
    """Embeddings go through admission and a replica like chat: `engine.queue` (waiting for an
    encoder batch) and `engine.embed` (its forward pass) under the CLIENT dispatch span, no decode."""
    provider, exporter = traced
    t = Timeline("embd-2")
    begin_trace(t, {}, provider)
    for i, stage in enumerate(("authenticated", "routed", "admitted", "dispatched", "scheduled", "first_token",
                               "finished")):
        t.stamp(stage, at=t.stamps["received"] + 0.01 * (i + 1))
    t.attrs["replica"] = "embed-0"
    record_trace(FinishedRequest(t, "/v1/embeddings", 200, requested_model="e", model="e", prompt_tokens=9), provider)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    dispatch = spans["dispatch embed-0"]
    assert spans["engine.embed"].parent.span_id == dispatch.context.span_id
    assert spans["engine.queue"].parent.span_id == dispatch.context.span_id
    assert spans["engine.embed"].attributes["gen_ai.usage.input_tokens"] == 9
    assert "engine.decode" not in spans and "engine.prefill" not in spans


def test_a_speculating_requests_counts_reach_its_root_span_and_audit_row(traced):
    """Issue 39's observability: the Timeline's `spec_decode` (replica/events.py) becomes the root
    span's tokenpath.spec_decode.* attributes and the audit row's timing column."""
    provider, exporter = traced
    t = _timeline({}, provider)
    t.attrs["spec_decode"] = {"steps": 12, "proposed": 40, "accepted": 30, "acceptance": 0.75}
    rec = FinishedRequest(t, "/v1/chat/completions", 200, requested_model="m", model="m", prompt_tokens=15,
                          completion_tokens=42, finish_reasons=["stop"])
    record_trace(rec, provider)
    root = {s.name: s for s in exporter.get_finished_spans()}["chat m"]
    assert {k: root.attributes[f"tokenpath.spec_decode.{k}"] for k in ("proposed", "accepted", "acceptance")} \
        == {"proposed": 40, "accepted": 30, "acceptance": 0.75}
    assert rec.timing_summary()["spec_decode"] == t.attrs["spec_decode"]
