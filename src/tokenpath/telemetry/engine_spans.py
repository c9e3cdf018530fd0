"""The engine process's side of a request's trace, built from its engine events.

An engine process on the engine link runs no API and no Timeline of its own; what it knows of a
request is the `traceparent` the gateway sent (naming its `dispatch` span) and the engine's event
times. When tracing is on in the engine process (the gateway's `--otlp-endpoint` reaches it
through the environment), each finished request becomes a SERVER span under that dispatch span,
with `engine.queue`, `engine.prefill` and `engine.decode` children, exported as service
`tokenpath-engine`. The gateway's own spans are unchanged (`tracing.py`).
"""

from __future__ import annotations

import logging
import time

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind

from tokenpath.telemetry.otel import caller_context, setup_tracing

log = logging.getLogger("tokenpath.telemetry")


def setup_engine_tracing(step_observers: list) -> TracerProvider | None:
    """Tracing for an engine outside the gateway's process (an engine process, a Ray actor), set by
    the OTEL_* environment the gateway passes on (its `--otlp-endpoint` arrives as
    OTEL_EXPORTER_OTLP_ENDPOINT). When on, the engine's steps also record prefill chunks for the
    trace's prefill span (`annotate_step` joins `step_observers`), as in-process. None: tracing off."""
    try:
        provider = setup_tracing(None, service_name="tokenpath-engine")
    except ValueError as exc:
        log.warning("tracing off in this engine: %s", exc)
        return None
    if provider is not None:
        from tokenpath.telemetry.tracing import annotate_step

        step_observers.append(annotate_step)
    return provider


def record_engine_trace(provider: TracerProvider | None, *, traceparent: str | None, request_id: str,
                        model: str, queued: float | None, scheduled: float | None, first_token: float | None,
                        finished: float | None, prompt_tokens: int, completion_tokens: int,
                        cached_tokens: int, preemptions: int) -> None:
    """Export one request's engine spans (times are this process's `time.monotonic()`). Never raises."""
    if provider is None or traceparent is None or queued is None:
        return
    try:
        parent = caller_context({"traceparent": traceparent})
        if parent is None:
            return
        offset = time.time() - time.monotonic()  # monotonic -> wall clock, in this process
        ns = lambda t: int((t + offset) * 1e9)  # noqa: E731
        end = finished if finished is not None else time.monotonic()
        tracer = provider.get_tracer("tokenpath.engine")
        root = tracer.start_span(f"engine {model}", context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
                                 kind=SpanKind.SERVER, start_time=ns(queued),
                                 attributes={"tokenpath.request_id": request_id, "gen_ai.request.model": model,
                                             "gen_ai.usage.input_tokens": prompt_tokens,
                                             "gen_ai.usage.output_tokens": completion_tokens,
                                             "tokenpath.cached_tokens": cached_tokens,
                                             "tokenpath.preemptions": preemptions})
        ctx = trace.set_span_in_context(root)
        prev = queued
        for name, at in (("engine.queue", scheduled), ("engine.prefill", first_token), ("engine.decode", finished)):
            if at is None:
                continue
            span = tracer.start_span(name, context=ctx, start_time=ns(prev))
            span.end(end_time=ns(max(prev, at)))
            prev = max(prev, at)
        root.end(end_time=ns(max(queued, end)))
    except Exception:
        log.exception("building the engine's spans failed")
