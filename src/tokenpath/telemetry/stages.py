"""The stages of a request, read off its Timeline's stamps.

`upload` (received->body_read: the client sending its body), `gateway` (body_read->admitted:
auth, routing, tokenize, rate limits), `queue` (the admission
queue: admitted->dispatched), `engine_queue` (dispatched->scheduled), `prefill`
(scheduled->first token), `reasoning` (first token->first answer, for a reply that thought),
`decode` (first answer, or first token, ->finished) and `total`: the table is
`timeline.STAGE_BOUNDS`, and the arithmetic is `Timeline.durations()`; these are views of them.

Each stage runs from the previous stamp that exists to its own end stamp, and `finished` closes
the stage the request was in (a 400 ends in `gateway`), so a missing stamp folds its time into
the next stage and the stages always sum to `total`: a trace, a log line
and `tokenpath trace` can never show time that went nowhere, and every consumer agrees with
Server-Timing.
"""

from __future__ import annotations

from tokenpath.telemetry.timeline import PATH_STAGES, STAGE_BOUNDS, Timeline, skips_reasoning


def stage_durations(timeline: Timeline) -> dict[str, float]:
    """Seconds per stage plus `total`; stages never reached are left out (`Timeline.durations`)."""
    return timeline.durations()


def stage_ms(timeline: Timeline) -> dict[str, float]:
    """The same, in milliseconds rounded to 0.1 ms (what logs, the audit row and the dashboard hold)."""
    return {k: round(v * 1000, 1) for k, v in stage_durations(timeline).items()}


def current_stage(timeline: Timeline, *, ignore_finished: bool = False) -> str:
    """The stage a request is in: the one after the last stamp it has reached (`done` once
    finished, unless `ignore_finished`)."""
    stage = PATH_STAGES[0]
    for i, (_, _, end) in enumerate(STAGE_BOUNDS):
        if end in timeline.stamps and not (ignore_finished and end == "finished"):
            stage = PATH_STAGES[i + 1] if i + 1 < len(PATH_STAGES) else "done"
    return skips_reasoning(stage, timeline.stamps)


def after_first_token(stages: dict[str, float]) -> float | None:
    """Seconds from the first token to the end, reasoning and answer together: vLLM's decode time
    (what `request_decode_time_seconds`, time per output token and the audit's decode_s mean)."""
    if "decode" not in stages and "reasoning" not in stages:
        return None
    return stages.get("reasoning", 0.0) + stages.get("decode", 0.0)


def dominant_stage(stages: dict[str, float]) -> str | None:
    """The stage that took the longest (total excluded)."""
    parts = {k: v for k, v in stages.items() if k != "total"}
    return max(parts, key=parts.__getitem__) if parts else None
