"""The stages of a request, read off its Timeline's stamps.

`upload` (received->body_read: the client sending its body), `gateway` (body_read->admitted:
auth, routing, tokenize, rate limits), `queue` (the admission
queue: admitted->dispatched), `engine_queue` (dispatched->scheduled), `prefill`
(scheduled->first token), `decode` (first token->finished) and `total`.

Each stage runs from the previous stamp that exists to its own end stamp, and `finished` closes
the stage the request was in (a 400 ends in `gateway`), so a missing stamp folds its time into
the next stage and the stages always sum to `total`: a trace, a log line
and `tokenpath trace` can never show time that went nowhere. When the Timeline itself already
reports these stages (`Timeline.durations()` with a `gateway` key), that is the answer, so
every consumer agrees with Server-Timing.
"""

from __future__ import annotations

import time

from tokenpath.telemetry.timeline import Timeline

STAGES = ("upload", "gateway", "queue", "engine_queue", "prefill", "decode")
# (stage, the stamp that ends it), in path order; `received` starts the first one.
STAGE_ENDS = (("upload", "body_read"), ("gateway", "admitted"), ("queue", "dispatched"),
              ("engine_queue", "scheduled"), ("prefill", "first_token"), ("decode", "finished"))


def stage_durations(timeline: Timeline) -> dict[str, float]:
    """Seconds per stage plus `total`; stages never reached are left out."""
    own = timeline.durations()
    if "gateway" in own:
        return own
    stamps = timeline.stamps
    start = prev = stamps["received"]
    out: dict[str, float] = {}
    for stage, end in STAGE_ENDS[:-1]:
        at = stamps.get(end)
        if at is not None and at >= prev:
            out[stage] = at - prev
            prev = at
    finished = stamps.get("finished")
    if finished is not None and finished >= prev:
        # The end closes whatever stage the request was in: decode normally, gateway for a 400.
        last = current_stage(timeline, ignore_finished=True)
        out[last] = out.get(last, 0.0) + finished - prev
    out["total"] = max(0.0, (finished or time.monotonic()) - start)
    return out


def stage_ms(timeline: Timeline) -> dict[str, float]:
    """The same, in milliseconds rounded to 0.1 ms (what logs, the audit row and the dashboard hold)."""
    return {k: round(v * 1000, 1) for k, v in stage_durations(timeline).items()}


def current_stage(timeline: Timeline, *, ignore_finished: bool = False) -> str:
    """The stage a request is in: the one after the last stamp it has reached (`done` once
    finished, unless `ignore_finished`)."""
    stage = "gateway"
    for i, (_, end) in enumerate(STAGE_ENDS):
        if end in timeline.stamps and not (ignore_finished and end == "finished"):
            stage = STAGE_ENDS[i + 1][0] if i + 1 < len(STAGE_ENDS) else "done"
    return stage


def dominant_stage(stages: dict[str, float]) -> str | None:
    """The stage that took the longest (total excluded)."""
    parts = {k: v for k, v in stages.items() if k != "total"}
    return max(parts, key=parts.__getitem__) if parts else None
