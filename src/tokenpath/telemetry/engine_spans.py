"""The engine process's side of a request's trace, built from its engine events.

An engine process on the engine link runs no API and no Timeline of its own; what it knows of a
request is the `traceparent` the gateway sent (naming its `dispatch` span) and the engine's event
times. When tracing is on in the engine process (the gateway's `--otlp-endpoint` reaches it
through the environment), each finished request becomes a SERVER span under that dispatch span,
with `engine.queue`, `engine.prefill` (its prefill chunks as events) and `engine.decode` (the
inter-token latency summary) children, exported as service `tokenpath-engine` (or
`{OTEL_SERVICE_NAME}-engine`, see `otel.engine_service_name`). The SERVER span carries the
GenAI attributes the engine knows (operation, model, sampling parameters, usage, finish
reasons). The link server then marks the request's last output `traced`, and the gateway builds
no engine spans of its own for it (`tracing.py`): each span is exported once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenpath.telemetry.otel_env import engine_service_name, exporter_kind

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("tokenpath.telemetry")


def setup_engine_tracing(step_observers: list) -> TracerProvider | None:
    """Tracing for an engine outside the gateway's process (an engine process, a Ray actor), set by
    the OTEL_* environment the gateway passes on (its `--otlp-endpoint` arrives as
    OTEL_EXPORTER_OTLP_ENDPOINT). When on, the engine's steps also record prefill chunks for the
    trace's prefill span (`annotate_step` joins `step_observers`), as in-process. None: tracing off,
    decided before the SDK is imported (an engine process without tracing loads none of it)."""
    if exporter_kind("traces", None) == "none":
        return None
    from tokenpath.telemetry.otel import setup_tracing

    try:
        provider = setup_tracing(None, service_name=engine_service_name(), fixed_name=True)
    except ValueError as exc:
        log.warning("tracing off in this engine: %s", exc)
        return None
    if provider is not None:
        from tokenpath.telemetry.tracing import annotate_step

        step_observers.append(annotate_step)
    return provider


@dataclass
class EngineSpanRecord:
    """What the engine knows of one finished request, for its spans. Times are this process's
    `time.monotonic()`; `token_times` are when the link sent each output token of choice 0."""

    request_id: str
    model: str
    traceparent: str | None
    operation: str | None
    queued: float | None
    scheduled: float | None
    first_token: float | None
    finished: float | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    preemptions: int
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


def will_export(provider: TracerProvider | None, traceparent: str | None) -> bool:
    """Whether `record_engine_trace` exports this request's spans (the gateway must then not)."""
    if provider is None:
        return False
    from tokenpath.telemetry.otel import caller_context

    return traceparent is not None and caller_context({"traceparent": traceparent}) is not None


def _attributes(r: EngineSpanRecord) -> dict[str, Any]:
    from tokenpath.telemetry.tracing import PROVIDER_NAME

    attrs: dict[str, Any] = {"gen_ai.operation.name": r.operation or "text_completion",
                             "gen_ai.provider.name": PROVIDER_NAME, "gen_ai.request.model": r.model,
                             "gen_ai.response.model": r.model, "gen_ai.response.id": r.request_id,
                             "gen_ai.usage.input_tokens": r.prompt_tokens,
                             "gen_ai.usage.output_tokens": r.completion_tokens,
                             "tokenpath.request_id": r.request_id, "tokenpath.cached_tokens": r.cached_tokens,
                             "tokenpath.preemptions": r.preemptions}
    optional = {"gen_ai.request.max_tokens": r.max_tokens, "gen_ai.request.temperature": r.temperature,
                "gen_ai.request.top_p": r.top_p, "gen_ai.request.seed": r.seed}
    attrs.update({k: v for k, v in optional.items() if v is not None})
    if r.finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = list(r.finish_reasons)
    return attrs


def record_engine_trace(provider: TracerProvider | None, r: EngineSpanRecord) -> None:
    """Export one request's engine spans. Never raises."""
    if not will_export(provider, r.traceparent) or r.queued is None:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        from tokenpath.telemetry.otel import caller_context
        from tokenpath.telemetry.tracing import itl_attributes

        parent = caller_context({"traceparent": r.traceparent or ""})
        offset = time.time() - time.monotonic()  # monotonic -> wall clock, in this process
        ns = lambda t: int((t + offset) * 1e9)  # noqa: E731
        queued = r.queued
        end = r.finished if r.finished is not None else time.monotonic()
        tracer = provider.get_tracer("tokenpath.engine")  # type: ignore[union-attr]
        root = tracer.start_span(f"engine {r.model}", context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
                                 kind=SpanKind.SERVER, start_time=ns(queued), attributes=_attributes(r))
        ctx = trace.set_span_in_context(root)
        prev = queued
        for name, at in (("engine.queue", r.scheduled), ("engine.prefill", r.first_token), ("engine.decode", r.finished)):
            if at is None:
                continue
            span = tracer.start_span(name, context=ctx, start_time=ns(prev))
            if name == "engine.prefill":
                span.set_attributes({"gen_ai.usage.input_tokens": r.prompt_tokens,
                                     "tokenpath.cached_tokens": r.cached_tokens})
                for t, n in r.prefill_chunks:
                    span.add_event("prefill_chunk", {"tokens": int(n)}, timestamp=ns(min(max(t, prev), at)))
            elif name == "engine.decode":
                span.set_attributes({"gen_ai.usage.output_tokens": r.completion_tokens,
                                     **itl_attributes(r.token_times)})
            span.end(end_time=ns(max(prev, at)))
            prev = max(prev, at)
        root.end(end_time=ns(max(queued, end)))
    except Exception:
        log.exception("building the engine's spans failed")
