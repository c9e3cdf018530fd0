"""The one place where engine events reach the gateway's Timeline.

Every replica yields `RequestOutput` deltas whose `events` are in this process's monotonic clock
(the in-process engine shares it; the engine-link client translates an engine process's clock
at receipt; an OpenAI-compatible server has no events, so its client stamps receipt times).
`stamp_events` puts them on the request's Timeline, clamped to the window the gateway itself saw
(after `dispatched`, not after now), so clock error or link latency can never make a stage
negative or push an event out of order: the stages still sum to `total`.
"""

from __future__ import annotations

import time

from tokenpath.protocol import EmbeddingOutput, RequestOutput
from tokenpath.telemetry.timeline import Timeline


def stamp_events(timeline: Timeline | None, out: RequestOutput | EmbeddingOutput, now: float | None = None) -> None:
    if timeline is None:
        return
    now = time.monotonic() if now is None else now
    floor = timeline.get("dispatched") or timeline.stamps["received"]
    ev = out.events
    # One engine request per prompt: a batched completions request (ids `<id>-<i>`) is finished
    # when its last prompt is, which the gateway stamps itself.
    whole = out.request_id == timeline.request_id
    # `finished` is when the gateway holds the last delta (receipt), not the engine's own finish:
    # the request is done for the client only then, and a remote engine's spans end before it.
    for name, at in (("scheduled", ev.scheduled), ("first_token", ev.first_token),
                     ("finished", now if out.finished and whole else None)):
        if at is None and name == "first_token" and isinstance(out, RequestOutput) \
                and any(c.token_ids for c in out.outputs):
            at = now  # a replica without engine events: the first token arrived now
        if at is None:
            continue
        at = min(max(at, floor), now)
        timeline.stamp(name, at=at)
        floor = timeline.stamps[name]
    if isinstance(out, EmbeddingOutput):
        return
    if ev.traced:  # the engine exported its own spans: the gateway's trace leaves them to it
        timeline.attrs["engine_traced"] = True
    if out.num_cached_tokens:
        timeline.attrs["cached_tokens"] = out.num_cached_tokens
    if ev.prefill_chunks:
        timeline.attrs["prefill_chunks"] = [(min(max(t, timeline.stamps.get("scheduled", t)), now), n)
                                            for t, n in ev.prefill_chunks]
    if out.num_preemptions:
        timeline.attrs["preemptions"] = out.num_preemptions
    if ev.spec is not None:  # speculative decoding: [steps that drafted, proposed, accepted]
        steps, proposed, accepted = ev.spec
        timeline.attrs["spec_decode"] = {"steps": steps, "proposed": proposed, "accepted": accepted,
                                         "acceptance": round(accepted / proposed, 3) if proposed else 0.0,
                                         "gained_per_step": round(accepted / steps, 3) if steps else 0.0}
    if ev.lora_load is not None:  # the adapter load this request waited for (clamped like the rest)
        started, ended, cold = ev.lora_load
        started = min(max(started, timeline.get("dispatched") or timeline.stamps["received"]), now)
        timeline.attrs["lora_load"] = [started, min(max(ended, started), now), bool(cold)]
    # The engine's facts behind the request's causes (`tokenpath.telemetry.causes`); the latest
    # delta carries them whole, so each replaces the previous one.
    for key, value in (("engine_behind", ev.behind), ("engine_freed_by", ev.freed_by),
                       ("engine_stalls", ev.stalls), ("engine_preempted", ev.preempted)):
        if value:
            timeline.attrs[key] = value
