"""OpenTelemetry spans derived from a request's Timeline (GenAI semantic conventions).

Spans are built after the fact from the Timeline's stamps, so tracing adds nothing to the hot
path and cannot disagree with Server-Timing or the metrics. Without a configured exporter the
OpenTelemetry API is a no-op.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from tokenpath.telemetry.timeline import STAGE_BOUNDS, Timeline

_tracer = trace.get_tracer("tokenpath")


def _ns(timeline: Timeline, stage: str) -> int | None:
    """A monotonic stamp as wall-clock nanoseconds (anchored at `wall_start`)."""
    at = timeline.get(stage)
    if at is None:
        return None
    return int((timeline.wall_start + (at - timeline.stamps["received"])) * 1e9)


def record_trace(timeline: Timeline, *, endpoint: str, model: str | None, status: int,
                 prompt_tokens: int, completion_tokens: int, finish_reason: str | None) -> None:
    start = _ns(timeline, "received") or time.time_ns()
    end = _ns(timeline, "finished") or time.time_ns()
    op = "embeddings" if endpoint.endswith("embeddings") else "chat" if "chat" in endpoint else "text_completion"
    attrs = {
        "gen_ai.operation.name": op,
        "gen_ai.request.model": model or "",
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": completion_tokens,
        "http.response.status_code": status,
        "tokenpath.request_id": timeline.request_id,
    }
    if finish_reason:
        attrs["gen_ai.response.finish_reasons"] = [finish_reason]
    root = _tracer.start_span(f"{op} {model or ''}".strip(), start_time=start, attributes=attrs)
    ctx = trace.set_span_in_context(root)
    for name, a, b in STAGE_BOUNDS:
        sa, sb = _ns(timeline, a), _ns(timeline, b)
        if sa is not None and sb is not None:
            _tracer.start_span(name, context=ctx, start_time=sa).end(end_time=max(sa, sb))
    root.end(end_time=max(start, end))
