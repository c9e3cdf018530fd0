"""OpenTelemetry spans derived from a finished request's Timeline (GenAI semantic conventions).

Spans are built after the fact from the Timeline's stamps, so tracing adds nothing to the hot
path and cannot disagree with Server-Timing, the log line or the metrics. With tracing off (no
SDK provider installed, see `otel.setup_tracing`) `record_trace` returns at once.

One request is one trace:
- SERVER root `chat {model}` / `text_completion {model}` / `embeddings {model}`, a child of the
  caller's span when the request carried a `traceparent`;
- its children `gateway.upload` (the client sending its body), `gateway.auth`, `gateway.route`, `gateway.tokenize`, `gateway.rate_limit`,
  `admission.queue`, and the CLIENT span `dispatch {replica}`;
- under `dispatch`, the engine's `engine.queue`, `engine.prefill` (one event per prefill chunk)
  and `engine.decode` (token count and inter-token latency summary as attributes). A remote
  replica continues the trace from the `traceparent` it was sent, which names `dispatch`.

Each span has one owner. An engine process or Ray actor with tracing on exports its own engine
spans (`engine_spans.py`) and says so on its last output (`EngineEvents.traced`, copied to the
Timeline as `engine_traced`); the gateway then builds no engine spans of its own under
`dispatch`. It still builds them for an in-process engine and for an OpenAI-compatible replica,
which export nothing tokenpath could count on.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from tokenpath.telemetry.causes import detail_json
from tokenpath.telemetry.otel import caller_context, preset_ids, tracing_provider
from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.timeline import Timeline

log = logging.getLogger("tokenpath.telemetry")
PROVIDER_NAME = "tokenpath"
# (span name, start stamp, end stamp) of the gateway's own children of the root.
_GATEWAY_SPANS = (("gateway.upload", "received", "body_read"), ("gateway.auth", "body_read", "authenticated"), ("gateway.route", "authenticated", "routed"),
                  ("gateway.tokenize", "routed", "tokenized"), ("gateway.rate_limit", "tokenized", "admitted"))
_ENGINE_SPANS = (("engine.queue", "dispatched", "scheduled"), ("engine.prefill", "scheduled", "first_token"),
                 ("engine.decode", "first_token", "finished"))


def _ns(timeline: Timeline, at: float) -> int:
    """A monotonic time as wall-clock nanoseconds (anchored at `wall_start`)."""
    return int((timeline.wall_start + (at - timeline.stamps["received"])) * 1e9)


def _stamp_ns(timeline: Timeline, stage: str) -> int | None:
    at = timeline.get(stage)
    return None if at is None else _ns(timeline, at)


def _hex(value: object) -> int | None:
    try:
        return int(str(value), 16)
    except ValueError:
        return None


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def root_attributes(rec: FinishedRequest) -> dict[str, Any]:
    """GenAI semconv attributes plus tokenpath's own; never a key, text only when allowed."""
    a = rec.timeline.attrs
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": rec.operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": rec.requested_model or "",
        "gen_ai.response.id": rec.request_id,
        "gen_ai.usage.input_tokens": rec.prompt_tokens,
        "gen_ai.usage.output_tokens": rec.completion_tokens,
        "http.request.method": "POST",
        "http.route": rec.endpoint,
        "http.response.status_code": rec.status,
        "tokenpath.request_id": rec.request_id,
        "tokenpath.tenant": rec.tenant,
        "tokenpath.cached_tokens": rec.cached_tokens,
        "tokenpath.preemptions": int(a.get("preemptions", 0) or 0),  # type: ignore[call-overload]
    }
    optional = {
        "gen_ai.response.model": rec.model, "gen_ai.request.max_tokens": rec.max_tokens,
        "gen_ai.request.temperature": rec.temperature, "gen_ai.request.top_p": rec.top_p,
        "gen_ai.request.seed": rec.seed, "server.address": rec.server_address, "server.port": rec.server_port,
        "tokenpath.key_prefix": rec.key_prefix, "tokenpath.priority": rec.priority,
        "tokenpath.client_request_id": rec.client_request_id, "tokenpath.replica": a.get("replica"),
        "tokenpath.routing.policy": a.get("policy"), "tokenpath.routing.reason": a.get("reason"),
        "tokenpath.admission": a.get("admission"),
        "tokenpath.lora.base": a.get("lora_base"),
    }
    spec = a.get("spec_decode")
    if isinstance(spec, dict):  # speculative decoding: what the request's drafts gained
        optional.update({f"tokenpath.spec_decode.{k}": spec.get(k) for k in ("proposed", "accepted", "acceptance")})
    attrs.update({k: v for k, v in optional.items() if v is not None})
    load = a.get("lora_load")  # the adapter load this request waited for
    if isinstance(load, list):
        attrs["tokenpath.lora.load_ms"] = round(1000 * (load[1] - load[0]), 3)
        attrs["tokenpath.lora.load_cold"] = bool(load[2])
    backend = a.get("backend_timing")  # a URL replica: whose clock the engine stages came from
    if isinstance(backend, dict):
        attrs.update({f"tokenpath.backend.{k}": v for k, v in backend.items()})
    grammar = a.get("grammar")  # constrained decoding: compile (hit or miss) and mask cost
    if isinstance(grammar, dict):
        attrs.update({f"tokenpath.grammar.{k}": v for k, v in grammar.items() if v is not None})
    if rec.finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = list(rec.finish_reasons)
    if rec.status >= 400:
        attrs["error.type"] = rec.error_code or rec.error_type or str(rec.status)
    if rec.prompt_text is not None:  # present only under TOKENPATH_AUDIT_TEXT=1
        attrs["gen_ai.input.messages"] = json.dumps([{"role": "user", "parts": [
            {"type": "text", "content": rec.prompt_text}]}])
    if rec.completion_text is not None:
        attrs["gen_ai.output.messages"] = json.dumps([{"role": "assistant", "parts": [
            {"type": "text", "content": rec.completion_text}]}])
    return attrs


def _child(tracer: trace.Tracer, name: str, parent: trace.Span, start: int, end: int,
           kind: SpanKind = SpanKind.INTERNAL, attributes: dict[str, Any] | None = None) -> trace.Span:
    span = tracer.start_span(name, context=trace.set_span_in_context(parent), kind=kind, start_time=start,
                             attributes=attributes)
    span.end(end_time=max(start, end))
    return span


def record_trace(rec: FinishedRequest, provider: TracerProvider | None = None) -> None:
    """Export the request's spans (no-op when tracing is off or the trace was not sampled).
    `provider` defaults to the process's (tests and embedders may pass their own)."""
    provider = provider or tracing_provider()
    if provider is None:
        return
    tracer = provider.get_tracer("tokenpath")
    t, a = rec.timeline, rec.timeline.attrs
    start = _stamp_ns(t, "received") or time.time_ns()
    end = max(start, _stamp_ns(t, "finished") or time.time_ns())
    caller = caller_context(rec.incoming_headers)
    # An empty Context, not the current one: nothing running around this call is our parent.
    parent_ctx = trace.set_span_in_context(trace.NonRecordingSpan(caller)) if caller is not None else Context()
    name = f"{rec.operation} {rec.model or rec.requested_model or ''}".strip()
    with preset_ids(_hex(a.get("trace_id")), _hex(a.get("trace_root"))):
        root = tracer.start_span(name, context=parent_ctx, kind=SpanKind.SERVER, start_time=start,
                                 attributes=root_attributes(rec))
    if not root.is_recording():
        return
    if rec.status >= 400:
        root.set_status(Status(StatusCode.ERROR, rec.error_code or rec.error_type or str(rec.status)))
    _cause_events(root, rec, end)
    for span_name, a_stage, b_stage in _GATEWAY_SPANS:
        sa, sb = _stamp_ns(t, a_stage), _stamp_ns(t, b_stage)
        if sa is None and a_stage == "body_read":  # no body read through the middleware: auth from the start
            sa = _stamp_ns(t, "received")
        if sa is not None and sb is not None:
            _child(tracer, span_name, root, sa, sb)
    admitted, dispatched = _stamp_ns(t, "admitted"), _stamp_ns(t, "dispatched")
    if admitted is not None and dispatched is not None:
        _child(tracer, "admission.queue", root, admitted, dispatched,
               attributes={k: v for k, v in (("tokenpath.admission", a.get("admission")),
                                             ("tokenpath.priority", rec.priority)) if v is not None})
    if dispatched is not None:
        _dispatch(tracer, rec, root, dispatched, end)
    elif (scheduled := _stamp_ns(t, "scheduled")) is not None:  # embeddings: the encoder's batch
        _child(tracer, "engine.embed", root, scheduled, end, attributes={"gen_ai.usage.input_tokens": rec.prompt_tokens})
    root.end(end_time=end)


def _cause_events(root: trace.Span, rec: FinishedRequest, end: int) -> None:
    """Each cause as a `tokenpath.cause` event on the root span, and the top one as attributes,
    so a trace backend can filter on `tokenpath.cause.kind` and show why without the audit log."""
    causes = rec.causes()
    if not causes:
        return
    top = causes[0]
    root.set_attributes({"tokenpath.cause.kind": top.kind, "tokenpath.cause.ms": top.ms,
                         "tokenpath.cause.kinds": [c.kind for c in causes]})
    if top.request_ids:
        root.set_attribute("tokenpath.cause.request_ids", top.request_ids[:8])
    for c in causes:
        root.add_event("tokenpath.cause", {"tokenpath.cause.kind": c.kind, "tokenpath.cause.ms": c.ms,
                                           "tokenpath.cause.request_ids": c.request_ids[:8],
                                           "tokenpath.cause.detail": detail_json(c)}, timestamp=end)


def _dispatch(tracer: trace.Tracer, rec: FinishedRequest, root: trace.Span, start: int, end: int) -> None:
    t, a = rec.timeline, rec.timeline.attrs
    replica = str(a.get("replica") or "replica")
    attrs = {k: v for k, v in (("tokenpath.replica", a.get("replica")), ("tokenpath.routing.policy", a.get("policy")),
                               ("tokenpath.routing.reason", a.get("reason")),
                               ("tokenpath.routing.matched_blocks", a.get("matched_blocks"))) if v is not None}
    with preset_ids(None, _hex(a.get("trace_dispatch"))):
        dispatch = tracer.start_span(f"dispatch {replica}", context=trace.set_span_in_context(root),
                                     kind=SpanKind.CLIENT, start_time=start, attributes=attrs)
    load = a.get("lora_load")
    if isinstance(load, list):  # the adapter load this request waited for, inside its engine queue time
        _child(tracer, "lora.load", dispatch, _ns(t, float(load[0])), _ns(t, float(load[1])),
               attributes={"tokenpath.lora.name": str(a.get("lora") or ""), "tokenpath.lora.cold": bool(load[2])})
    if a.get("engine_traced"):  # the engine's process exported these spans itself
        dispatch.end(end_time=end)
        return
    embedding = rec.operation == "embeddings"
    for name, a_stage, b_stage in _ENGINE_SPANS:
        sa, sb = _stamp_ns(t, a_stage), _stamp_ns(t, b_stage)
        if sa is None or sb is None or (embedding and name == "engine.decode"):
            continue
        if embedding and name == "engine.prefill":  # an encoder's batch: one forward pass, no decode
            _child(tracer, "engine.embed", dispatch, sa, max(sa, sb), attributes={
                "gen_ai.usage.input_tokens": rec.prompt_tokens})
            continue
        span = tracer.start_span(name, context=trace.set_span_in_context(dispatch), start_time=sa)
        if name == "engine.prefill":
            span.set_attribute("tokenpath.cached_tokens", rec.cached_tokens)
            span.set_attribute("gen_ai.usage.input_tokens", rec.prompt_tokens)
            for at, n in a.get("prefill_chunks") or ():  # type: ignore[attr-defined]
                span.add_event("prefill_chunk", {"tokens": int(n)}, timestamp=_ns(t, float(at)))
        elif name == "engine.decode":
            span.set_attributes(_decode_attributes(rec))
        span.end(end_time=max(sa, sb))
    dispatch.end(end_time=end)


def _decode_attributes(rec: FinishedRequest) -> dict[str, Any]:
    return {"gen_ai.usage.output_tokens": rec.completion_tokens, **itl_attributes(rec.token_times)}


def itl_attributes(times: Sequence[float]) -> dict[str, Any]:
    """The decode span's inter-token latency summary, from token arrival times (seconds)."""
    out: dict[str, Any] = {}
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    if gaps:
        out.update({"tokenpath.itl.mean_ms": round(1000 * sum(gaps) / len(gaps), 3),
                    "tokenpath.itl.p50_ms": round(1000 * _quantile(gaps, 0.5), 3),
                    "tokenpath.itl.p99_ms": round(1000 * _quantile(gaps, 0.99), 3),
                    "tokenpath.itl.max_ms": round(1000 * max(gaps), 3)})
    return out


def annotate_step(scheduled: Sequence[tuple[Any, int]], started: float, ended: float) -> None:
    """An engine step observer: prefill chunks onto each request's engine events (the engine
    thread writes; the replica boundary copies them onto the Timeline, the request's spans read
    them once it has finished). Never raises: telemetry must not be what stops a step loop."""
    try:
        for seq, n in scheduled:
            # Onto the request's engine events (which travel back to the gateway with its outputs,
            # in-process or across a process boundary), not onto a Timeline: the engine has none.
            events = getattr(seq, "events", None)
            if events is None or seq.index != 0:
                continue
            # A prefill chunk: no first token before this step.
            first = events.first_token
            if first is None or first >= started:
                events.prefill_chunks.append((round(ended, 6), n))
    except Exception:
        log.exception("annotating an engine step failed")
