"""Why a request was slow: its causes, derived in one place from its Timeline and the facts the
gateway and the engine recorded where they saw them.

Each cause is `{kind, ms, detail, request_ids}`: how many milliseconds of this request's latency
it explains, what it was, and the other requests responsible (the culprits, most to blame
first). Causes are sorted by ms; they overlap the stages, not each other's facts (a stage can
hold several causes, and a cause explains part of one stage, named in `detail["stage"]`).

| kind                        | facts (who records them)                                        | explains      |
|-----------------------------|-----------------------------------------------------------------|---------------|
| `queued_behind`             | the slot holders when it queued, whose end freed the slot       | queue /       |
|                             | (admission controller; the engine scheduler for its own queue;  | engine_queue  |
|                             | a URL replica's backend, by its reported queue time: no culprits)|               |
| `prefill_uncached`          | uncached prompt tokens and cached_tokens (engine)               | prefill       |
| `prefix_elsewhere`          | a replica holding more of the prompt, and why the router passed  | prefill       |
|                             | it over (replica picker); ms is the prefill share it would save |               |
| `decode_stalled_by_prefill` | decode steps shared with other requests' prefill chunks that    | decode        |
|                             | took over 2x this request's median ITL (engine core)            |               |
| `preempted`                 | each preemption, tokens recomputed, whose allocation forced it   | prefill/decode|
|                             | (scheduler)                                                     |               |
| `retried`/`replica_ejected` | the replica that failed before the first token, and how         | engine_queue  |
| `slow_client`               | time blocked writing to the client's socket (SSE response)      | decode        |
| `upload`                    | headers in -> whole body read (the body-limit middleware)       | upload        |
| `model_load`                | its model was loaded for it: cold, or evicted N s ago to make   | model_load    |
|                             | room for another model (routing.catalog)                        |               |
| `speculation_wasted`        | speculative decoding kept failing: proposals verified, few      | decode        |
|                             | accepted (the engine's spec counters); ms is the decode share   |               |
|                             | of the rejected rows, an upper bound (see `_speculation`)       |               |

The same facts exist in every deployment (in-process, engine processes, Ray): the engine's
travel in `EngineEvents`, which cross the engine link, and `replica.events.stamp_events` puts
them on the Timeline in the gateway's clock.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from tokenpath.telemetry.stages import stage_durations
from tokenpath.telemetry.timeline import Timeline

MIN_MS = 0.5  # a cause under half a millisecond explains nothing worth reading
# Writing to and reading from a healthy local client takes a few ms of event-loop turns; below
# this the client-side causes are noise, not a slow client or a slow uplink.
CLIENT_MIN_MS = 10.0
STALL_FACTOR = 2.0  # a token gap over this many times the request's median ITL is a stall
# Kinds kept whatever their ms: they are facts about the request even when they cost little.
_FACTS = ("prefill_uncached", "prefix_elsewhere", "retried", "replica_ejected", "model_load")


@dataclass
class Cause:
    kind: str
    ms: float
    detail: dict[str, Any] = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The cause as JSON-ready values (a copy: the caller may change it freely). Built by hand:
        `dataclasses.asdict` walks and deep-copies every value one call at a time, ~17 calls per
        finished request's audit row (issue 37)."""
        return {"kind": self.kind, "ms": self.ms, "detail": copy.deepcopy(self.detail),
                "request_ids": list(self.request_ids)}


def derive(timeline: Timeline, *, prompt_tokens: int = 0, cached_tokens: int = 0,
           token_times: list[float] | None = None, completion_tokens: int = 0) -> list[Cause]:
    """Every cause this request's facts support, most milliseconds first."""
    stages = {k: v * 1000 for k, v in stage_durations(timeline).items()}
    a = timeline.attrs
    out: list[Cause] = []
    out += _queued(a, stages)
    out += _prefill(a, stages, prompt_tokens, cached_tokens)
    out += _stalls(a, token_times or [])
    out += _preempted(timeline)
    out += _retried(a)
    out += _speculation(a, stages, completion_tokens)
    blocked = float(a.get("client_blocked_s") or 0.0) * 1000
    if blocked >= CLIENT_MIN_MS:
        out.append(Cause("slow_client", round(min(blocked, stages.get("decode", blocked)), 1),
                         {"stage": "decode", "blocked_ms": round(blocked, 1)}))
    load = a.get("model_load")
    if isinstance(load, dict) and "model_load" in stages:
        out.append(Cause("model_load", round(stages["model_load"], 1), {"stage": "model_load", **load}))
    upload = timeline.between("received", "body_read")
    if upload is not None and upload * 1000 >= CLIENT_MIN_MS:
        out.append(Cause("upload", round(upload * 1000, 1), {"stage": "upload", "body_bytes": a.get("body_bytes")}))
    out = [c for c in out if c.ms >= MIN_MS or c.kind in _FACTS]
    out.sort(key=lambda c: -c.ms)
    return out


def _holder_ids(freed_by: Any, holders: list) -> list[str]:
    ids = [str(freed_by)] if freed_by else []
    return ids + [str(h[0]) for h in holders if str(h[0]) not in ids]


def _queued(a: dict[str, Any], stages: dict[str, float]) -> list[Cause]:
    out = []
    holders = a.get("admission_behind")
    if a.get("admission") == "queued" and stages.get("queue", 0.0) >= MIN_MS:
        holders = holders or []
        out.append(Cause("queued_behind", round(stages["queue"], 1), {
            "stage": "queue", "where": "admission", "ahead": a.get("admission_ahead", 0),
            "holders": [{"request_id": r, "tenant": t, "max_tokens": n, "replica": rep} for r, t, n, rep in holders],
            "freed_by": a.get("admission_freed_by")}, _holder_ids(a.get("admission_freed_by"), holders)))
    behind = a.get("engine_behind")
    if behind and stages.get("engine_queue", 0.0) >= MIN_MS:
        out.append(Cause("queued_behind", round(stages["engine_queue"], 1), {
            "stage": "engine_queue", "where": "engine", "replica": a.get("replica"),
            "holders": [{"request_id": r, "tenant": t, "tokens_left": n, "state": s} for r, t, n, s in behind],
            "freed_by": a.get("engine_freed_by")}, _holder_ids(a.get("engine_freed_by"), behind)))
    backend = a.get("backend_timing")  # a URL replica's backend reported its own queue time
    queued = backend.get("queue_ms") if isinstance(backend, dict) else None
    if isinstance(queued, int | float) and queued >= MIN_MS and stages.get("engine_queue", 0.0) >= MIN_MS:
        out.append(Cause("queued_behind", round(min(float(queued), stages["engine_queue"]), 1), {
            "stage": "engine_queue", "where": "backend", "replica": a.get("replica"),
            "reported_by": backend.get("source"), "holders": [], "freed_by": None}))
    return out


def _prefill(a: dict[str, Any], stages: dict[str, float], prompt: int, cached: int) -> list[Cause]:
    prefill = stages.get("prefill")
    if prefill is None or prompt <= 0:
        return []
    uncached = max(0, prompt - cached)
    out = []
    per_token = prefill / uncached if uncached else 0.0
    if uncached:
        out.append(Cause("prefill_uncached", round(prefill, 1), {
            "stage": "prefill", "uncached_tokens": uncached, "cached_tokens": cached, "prompt_tokens": prompt,
            "ms_per_1k_tokens": round(1000 * per_token, 1),
            "chunks": len(a.get("prefill_chunks") or ())}))
    other = a.get("prefix_elsewhere")
    if isinstance(other, dict):
        missed = max(0, (int(other.get("blocks", 0)) - int(other.get("chosen_blocks", 0)))
                     * int(other.get("block_size", 0)))
        missed = min(missed, uncached)
        out.append(Cause("prefix_elsewhere", round(per_token * missed, 1), {
            "stage": "prefill", "replica": other.get("replica"), "blocks": other.get("blocks"),
            "chosen": a.get("replica"), "chosen_blocks": other.get("chosen_blocks"), "why": other.get("why"),
            "backlog_tokens": other.get("backlog_tokens"), "tokens_it_held": missed,
            "ms_estimated_from": "this request's own prefill ms per uncached token"},
            [str(h) for h in other.get("holders") or ()]))
    return out


def _stalls(a: dict[str, Any], token_times: list[float]) -> list[Cause]:
    records = a.get("engine_stalls")
    if not records:
        return []
    gaps = [b - x for x, b in zip(token_times, token_times[1:], strict=False)]
    steps = [float(r[1]) for r in records]
    # The request's typical ITL: its own token gaps when it has enough, else the engine's steps.
    typical = median(gaps) if len(gaps) >= 3 else median(steps)
    slow = [r for r in records if float(r[1]) > STALL_FACTOR * typical]
    if not slow:
        return []
    by: dict[str, int] = {}
    for r in slow:
        for rid, n in r[2]:
            by[str(rid)] = by.get(str(rid), 0) + int(n)
    culprits = sorted(by.items(), key=lambda kv: -kv[1])
    ms = sum(float(r[1]) - typical for r in slow) * 1000
    return [Cause("decode_stalled_by_prefill", round(ms, 1), {
        "stage": "decode", "slow_steps": len(slow), "median_itl_ms": round(typical * 1000, 2),
        "worst_step_ms": round(max(float(r[1]) for r in slow) * 1000, 1),
        "prefills": [{"request_id": r, "tokens": n} for r, n in culprits[:8]]}, [r for r, _ in culprits[:8]])]


def _preempted(timeline: Timeline) -> list[Cause]:
    records = timeline.attrs.get("engine_preempted")
    if not records:
        return []
    end = timeline.get("finished") or timeline.get("first_token")
    ms = 0.0
    for at, _, _, recovered in records:
        until = recovered if recovered is not None else end
        if until is not None:
            ms += max(0.0, float(until) - float(at)) * 1000
    by = [str(w) for _, w, _, _ in records if w]
    # Those that paused it for the tenant share (admission/preempt.py), not for KV blocks.
    share = {str(p.get("by")) for p in timeline.attrs.get("admission_paused") or () if isinstance(p, dict)}
    stage = "decode" if timeline.get("first_token") and float(records[0][0]) >= timeline.stamps["first_token"] \
        else "prefill"
    return [Cause("preempted", round(ms, 1), {
        "stage": stage, "times": len(records), "recomputed_tokens": sum(int(r[2]) for r in records),
        "forced_by": [w or "(its own growth)" for _, w, _, _ in records],
        "for_tenant_share": [w for w in dict.fromkeys(by) if w in share]}, list(dict.fromkeys(by)))]


SPEC_MIN_PROPOSED = 16  # proposals before a request's acceptance means anything
SPEC_MAX_ACCEPTANCE = 0.3  # below this share accepted, speculation cost this request more than it gave


def _speculation(a: dict[str, Any], stages: dict[str, float], completion_tokens: int) -> list[Cause]:
    """Speculation that kept failing (the engine's counters: steps that drafted, tokens proposed,
    accepted). Every rejected proposal was a row verified for nothing. Its ms: the decode stage's
    share of rejected rows among all rows computed for the request (each output token one row, plus
    the rejected ones). That is an upper bound: it holds where decode is compute-bound (a small
    model on few cores, where rows cost alike), and a rejected row is nearly free where decode is
    bound by reading the weights."""
    spec = a.get("spec_decode")
    if not isinstance(spec, dict):
        return []
    proposed, accepted = int(spec.get("proposed") or 0), int(spec.get("accepted") or 0)
    if proposed < SPEC_MIN_PROPOSED or accepted > SPEC_MAX_ACCEPTANCE * proposed:
        return []
    wasted = proposed - accepted
    rows = max(completion_tokens, accepted + int(spec.get("steps") or 0)) + wasted
    ms = stages.get("decode", 0.0) * wasted / rows if rows else 0.0
    return [Cause("speculation_wasted", round(ms, 1), {
        "stage": "decode", "proposed": proposed, "accepted": accepted,
        "acceptance": round(accepted / proposed, 3), "steps": spec.get("steps"), "rejected_rows": wasted,
        "ms_estimated_as": "decode ms x rejected rows / all rows (an upper bound)"})]


def _retried(a: dict[str, Any]) -> list[Cause]:
    """Hook for the replica failover: `retried_after`/`retry_reason`/`retry_lost_s` set by the
    deployment when a replica failed before the first token (a busy replica is `retried`, one
    that failed is `replica_ejected`), and `fallback_from` when another deployment served it."""
    out = []
    if a.get("retried_after"):
        reason = str(a.get("retry_reason") or "busy")
        kind = "retried" if reason == "busy" else "replica_ejected"
        out.append(Cause(kind, round(float(a.get("retry_lost_s") or 0.0) * 1000, 1), {
            "stage": "engine_queue", "replica": a.get("retried_after"), "reason": reason,
            "served_by": a.get("replica")}))
    if a.get("fallback_from"):
        out.append(Cause("retried", 0.0, {"stage": "gateway", "fallback_from": a.get("fallback_from"),
                                          "reason": a.get("fallback_reason")}))
    return out


def compact(causes: list[Cause]) -> list[dict[str, Any]]:
    """Kind, ms and culprits only: what a log line and the dashboard's recent list carry."""
    return [{"kind": c.kind, "ms": c.ms, "request_ids": c.request_ids[:3]} for c in causes]


def from_json(timing: dict[str, Any]) -> list[Cause]:
    """The causes an audit row's `timing` JSON holds (rows written before causes hold none)."""
    return [Cause(c["kind"], float(c["ms"]), c.get("detail") or {}, list(c.get("request_ids") or []))
            for c in timing.get("causes") or ()]


def detail_json(cause: Cause) -> str:
    return json.dumps(cause.detail, separators=(",", ":"), default=str)
