"""Spans are derived from the Timeline: one root span per request, stage children inside it."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tokenpath.telemetry.timeline import Timeline
from tokenpath.telemetry.tracing import record_trace


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another tracer provider is already installed in this process")
    return exp


def test_spans_follow_the_timeline(exporter):
    t = Timeline("chatcmpl-1")
    t0 = t.stamps["received"]
    t.stamp("admitted", at=t0 + 0.02)
    t.stamp("dispatched", at=t0 + 0.05)
    t.stamp("scheduled", at=t0 + 0.1)
    t.stamp("first_token", at=t0 + 0.3)
    t.stamp("finished", at=t0 + 1.0)
    record_trace(t, endpoint="/v1/chat/completions", model="m", status=200, prompt_tokens=5,
                 completion_tokens=7, finish_reason="stop")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["chat m"]
    assert root.attributes["gen_ai.usage.output_tokens"] == 7
    assert root.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert (root.end_time - root.start_time) / 1e9 == pytest.approx(1.0, abs=1e-3)
    for name, dur in (("gateway", 0.02), ("queue", 0.03), ("engine_queue", 0.05), ("prefill", 0.2),
                      ("decode", 0.7)):
        span = spans[name]
        assert span.parent.span_id == root.context.span_id
        assert (span.end_time - span.start_time) / 1e9 == pytest.approx(dur, abs=1e-3)
