"""A request with a LoRA adapter in its trace: `gen_ai.request.model` is the adapter and
`tokenpath.lora.base` the base; the adapter load it waited for (engine events, stamped at the
replica boundary) is a `lora.load` span under its dispatch span, with its time on the root."""

from __future__ import annotations

import pytest

from tokenpath.protocol import EngineEvents, RequestOutput
from tokenpath.replica.events import stamp_events
from tokenpath.telemetry.otel import begin_trace
from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.timeline import Timeline
from tokenpath.telemetry.tracing import record_trace


def test_adapter_and_its_load_in_the_trace(traced):
    provider, exporter = traced
    t = Timeline("cmpl-1")
    begin_trace(t, {}, provider)
    t0 = t.stamps["received"]
    for i, stage in enumerate(("authenticated", "routed", "tokenized", "admitted", "dispatched")):
        t.stamp(stage, at=t0 + 0.1 * (i + 1))
    t.attrs.update(replica="r0", policy="prefix_aware", reason="lora_cold", lora="sql", lora_base="base")
    out = RequestOutput("cmpl-1", [], [1, 2], 0, True,
                        EngineEvents(queued=t0 + 0.5, scheduled=t0 + 0.6, first_token=t0 + 0.65,
                                     finished=t0 + 0.7, lora_load=[t0 + 0.51, t0 + 0.59, True]))
    stamp_events(t, out, now=t0 + 0.8)
    rec = FinishedRequest(t, "/v1/completions", 200, requested_model="sql", model="base", prompt_tokens=2,
                          completion_tokens=1, finish_reasons=["stop"])
    record_trace(rec, provider)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, dispatch, load = spans["text_completion base"], spans["dispatch r0"], spans["lora.load"]
    assert root.attributes["gen_ai.request.model"] == "sql"
    assert root.attributes["tokenpath.lora.base"] == "base"
    assert root.attributes["tokenpath.lora.load_ms"] == pytest.approx(80, abs=0.01)
    assert root.attributes["tokenpath.lora.load_cold"] is True
    assert load.parent.span_id == dispatch.context.span_id
    assert (load.end_time - load.start_time) / 1e9 == pytest.approx(0.08, abs=1e-3)
    assert load.attributes["tokenpath.lora.name"] == "sql"
