"""The Timeline: the one per-request timing record, and where a request's time went.

Created when the HTTP request arrives; every layer stamps the events it sees onto it, and the
replica boundary (`tokenpath.replica.events.stamp_events`) stamps the engine's events, in this
process's clock, whether the engine runs in-process or in an engine process. Server-Timing, the
body's `tokenpath.timing`, the audit row, `/metrics` and traces are all *derived* from
`durations()`, so they cannot disagree. Times are `time.monotonic()` seconds; `wall_start`
anchors them to the wall clock for logs and traces.

Stages (`STAGE_BOUNDS`: the one stage table, which `telemetry.stages`, metrics, the dashboard,
`tokenpath trace`, benchmarks and docs/architecture.md all follow), the same in-process and with
engine processes (`--replicas N`):

| stage          | from -> to              | what it holds                                   |
|----------------|-------------------------|-------------------------------------------------|
| `upload`       | received -> body_read   | the client sending its body (its uplink)        |
| `model_load`   | body_read -> model_loaded | waiting for its model to load (catalog only)  |
| `gateway`      | model_loaded -> admitted| auth, routing, tokenizing, rate limits          |
| `queue`        | admitted -> dispatched  | the gateway's admission (fair) queue            |
| `engine_queue` | dispatched -> scheduled | the link and the engine's own waiting queue     |
| `prefill`      | scheduled -> first_token| prompt compute (chunks, prefix-cache hits)      |
| `reasoning`    | first_token -> first_answer | a reasoning model's think block             |
| `decode`       | first_answer -> finished| every later token (the answer)                  |
| `total`        | received -> finished    | the whole request (the sum of the above)        |

A stage runs from the previous event reached to its own end event, and `finished` closes the
stage the request was in (a 400 ends in `gateway`; a request whose body was never read through the
body-limit middleware has no `upload`, its gateway stage starts at `received`; an embedding request's encoder batch, from
`scheduled` on, is its `prefill`): the stages always sum to `total`. `reasoning` is a stage only of
a reply that thought (`first_reasoning` stamped, by the API's reasoning parser: api/reasoning.py):
otherwise decode runs from `first_token`, and a reply cut before it answered is all reasoning.
`model_load` is a stage only of a request that waited for its model to load (`awaiting_model`
stamped, by routing.catalog): it holds the wait (and the auth before it, a millisecond); a request
that fails while waiting (a failed load, its deadline) ends in it.
`first_reasoning` and `first_answer` are stamped when the gateway sees the first reasoning and the
first answer text; time to first answer is received -> first_answer.

Two events bound no stage: they mark the gateway's own share of the time to a first byte (issue
37: what a gateway in front of vLLM adds to TTFT). `sent` is when a URL replica's request was
written to the backend's connection (received -> sent: everything the gateway did before the
backend could start), and `first_sent` is when the reply's first byte (a stream's first event, a
whole reply's body) was handed to the client's connection (first_token -> first_sent: what it did
with the backend's first token before the client could have it; a whole reply's, from its last
token). `own_path` reads them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Every event a Timeline is stamped with, in path order (tests/telemetry/test_stage_table.py holds
# every stamp in src to it).
EVENTS = (
    "received",  # the request's headers are in (the body is read next: `body_read`)
    "body_read",  # its whole body is in: received -> body_read is the `upload` stage
    "authenticated",
    "awaiting_model",  # its model (routing.catalog) was not loaded: the request waits for the load
    "model_loaded",  # ... and it is: body_read -> model_loaded is the `model_load` stage
    "routed",
    "tokenized",
    "admitted",  # admission (`FlowController.acquire`) alone: it admitted or queued the request
    "dequeued",
    "dispatched",
    "sent",  # a URL replica's request written to the backend's connection (replica/remote.py)
    "scheduled",
    "first_token",
    "first_sent",  # the reply's first byte handed to the client's connection (api/sse.py, api/replies.py)
    "first_reasoning",  # a reasoning model's think block began (the gateway's parser saw it)
    "first_answer",  # ... and its answer: first_token -> first_answer is the `reasoning` stage
    "finished",
)

# (stage, from event, to event); `total` is received -> finished.
STAGE_BOUNDS = (
    ("upload", "received", "body_read"),
    ("model_load", "body_read", "model_loaded"),
    ("gateway", "model_loaded", "admitted"),
    ("queue", "admitted", "dispatched"),
    ("engine_queue", "dispatched", "scheduled"),
    ("prefill", "scheduled", "first_token"),
    ("reasoning", "first_token", "first_answer"),
    ("decode", "first_answer", "finished"),
)
PATH_STAGES = tuple(s for s, _, _ in STAGE_BOUNDS)  # the request path's stages, in order
STAGES = (*PATH_STAGES, "total")  # and their sum: every key `durations()` may return

# Every key of `Timeline.attrs`, the request's facts beside its stamps, with its one meaning and
# writer. Causes, traces, the audit row, the request log and /metrics read them by these names, so
# a key written under another name, or read under a misspelt one, would vanish silently:
# tests/telemetry/test_timeline_attrs.py holds every write and read in src to this table, and
# every entry here to a writer.
ATTRS: dict[str, str] = {
    # api/run.py and api/intake.py: the request as the edge saw it
    "body_bytes": "the request body's size (api/run.py, with `body_read`)",
    "tenant": "the authenticated tenant (api/intake.py, with `authenticated`)",
    "priority": "the request's priority class after the gateway's rules (api/intake.py)",
    "lora": "the LoRA adapter asked for (api/intake.py)",
    "lora_base": "the deployment serving that adapter (api/intake.py)",
    "grammar": "the structured-output grammar: kind, compile ms, cache hit, mask cost (api/generation.py, api/replies.py)",
    "client_blocked_s": "seconds the stream waited on a client that did not read (api/sse.py)",
    "client_stall": "a stalled stream: seconds from its writes blocking to the stall found and to its slot freed (api/sse.py)",
    # routing/: which model and deployment
    "deployment": "the deployment that served it (api/intake.py, routing/models.py, admission/controller.py)",
    "policy": "the routing policy of the pick (routing/models.py, admission/controller.py)",
    "fallback_from": "the deployment it fell back from (routing/models.py)",
    "fallback_reason": "the error code that made it fall back (routing/models.py)",
    "retried_after": "the replica that failed before its first token (routing/models.py)",
    "retry_reason": "why that first attempt failed (routing/models.py)",
    "retry_lost_s": "seconds the failed attempt cost (routing/models.py)",
    "model_load": "the model load it waited for: cold, warm, evicted... (routing/catalog.py)",
    # admission/controller.py: the queue and the pick
    "admission": "`immediate` or `queued` (with `admitted`)",
    "predicted_wait_s": "the wait admission predicted when it queued the request",
    "admission_ahead": "requests ahead of it in the fair queue when it queued",
    "admission_behind": "the requests holding slots when it queued: [id, tenant, max_tokens, replica]",
    "admission_freed_by": "the request whose finish gave it a slot",
    "admission_share": "its tenant's slots held, demand and share when the share held it back (admission/share.py)",
    "admission_preempted": "the running request whose slot it took, over its tenant's share: id, tenant, replica (admission/preempt.py)",
    "admission_paused": "each time it yielded its running slot to another tenant's request: by, tenant, replica (admission/preempt.py)",
    "queued_s": "seconds in the admission queue (with `dequeued`)",
    "replica": "the replica picked (with `dispatched`)",
    "reason": "why that replica: prefix_hit, prefix_predicted, least_loaded... (with `dispatched`)",
    "matched_blocks": "prompt KV blocks the picked replica was known to hold",
    "prefix_elsewhere": "the replica holding its prefix that the pick passed over, and who held it",
    # replica/: what the engine (or the backend) reported
    "backend_timing": "whose clock a URL replica's engine stages came from (replica/backend_timing.py)",
    "engine_traced": "the engine exported its own spans (replica/events.py)",
    "cached_tokens": "prompt tokens served from the prefix cache (replica/events.py)",
    "prefill_chunks": "[(time, tokens)] of each prefill chunk (replica/events.py)",
    "preemptions": "times the engine preempted it (replica/events.py)",
    "spec_decode": "speculative decoding: steps, proposed, accepted, acceptance (replica/events.py)",
    "lora_load": "[started, ended, cold] of the adapter load it waited for (replica/events.py)",
    "engine_behind": "who it waited behind in the engine's queue (replica/events.py)",
    "engine_freed_by": "the engine request whose finish let it be scheduled (replica/events.py)",
    "engine_stalls": "engine steps that stalled while it ran (replica/events.py)",
    "engine_preempted": "its preemptions: [time, by whom, tokens, resumed] (replica/events.py)",
    # telemetry/otel.py: its trace
    "trace_id": "the trace it belongs to (the caller's, or a new one)",
    "trace_root": "its root span's id",
    "trace_dispatch": "the dispatch span's id (the replica's spans are its children)",
    "trace_sampled": "whether the trace is sampled",
    "traceparent": "the W3C traceparent sent on to the replica",
}


def skips_reasoning(stage: str, stamps: dict[str, float]) -> str:
    """`stage`, or `decode` for the reasoning stage of a reply that never thought, or `gateway`
    for the model_load stage of a request that waited for no load: the optional stages."""
    if stage == "reasoning" and "first_reasoning" not in stamps:
        return "decode"
    if stage == "model_load" and "awaiting_model" not in stamps:
        return "gateway"
    return stage


@dataclass
class Timeline:
    request_id: str
    wall_start: float = field(default_factory=time.time)
    stamps: dict[str, float] = field(default_factory=dict)
    # The request's facts beside its stamps (deployment, replica, routing reason, tenant...): the
    # keys of `ATTRS` only.
    attrs: dict[str, object] = field(default_factory=dict)
    # The client's own id for the request, when it sent one (`request_id` is the server's, unique).
    client_request_id: str | None = None
    # `durations()` of a finished request, with the stamps it was computed from (their count, and
    # `received` and `finished`): a finished request's ending read it ~9 times (the reply, the
    # audit row, the log line, metrics, the dashboard), each a walk of the stage table (issue 37).
    _durations: tuple[tuple[int, float, float], dict[str, float]] | None = field(
        default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.stamps.setdefault("received", time.monotonic())

    def stamp(self, stage: str, at: float | None = None, **attrs: object) -> None:
        """Record the first time an event is reached (later calls keep the first stamp)."""
        self.stamps.setdefault(stage, time.monotonic() if at is None else at)
        self.attrs.update(attrs)

    def get(self, stage: str) -> float | None:
        return self.stamps.get(stage)

    def between(self, start: str, end: str) -> float | None:
        a, b = self.stamps.get(start), self.stamps.get(end)
        if a is None or b is None:
            return None
        return max(0.0, b - a)

    def durations(self) -> dict[str, float]:
        """Seconds per stage (see the module docstring) plus `total`, in `STAGES` order.

        Each stage runs from the previous event that was reached to its own end event, and
        `finished` closes the stage the request was in (a 400 ends in `gateway`); a stage never
        reached is left out. So a missing event folds its time into the next stage, and the stages
        always sum to `total`."""
        stamps = self.stamps
        finished = stamps.get("finished")
        key = (len(stamps), stamps["received"], finished) if finished is not None else None
        cached = self._durations
        if key is not None and cached is not None and cached[0] == key:
            return dict(cached[1])  # (a copy: callers may change theirs)
        out = self._durations_now(stamps)
        if key is not None:
            self._durations = (key, out)
            return dict(out)
        return out

    def _durations_now(self, stamps: dict[str, float]) -> dict[str, float]:
        prev = stamps["received"]
        out: dict[str, float] = {}
        current = "gateway"  # (where a request with no body read is: its upload is not a stage)
        for i, (name, _, end) in enumerate(STAGE_BOUNDS[:-1]):
            at = stamps.get(end)
            if at is not None and at >= prev:
                out[name] = at - prev
                prev = at
                current = STAGE_BOUNDS[i + 1][0]
        current = skips_reasoning(current, stamps)
        finished = stamps.get("finished")
        if finished is not None and finished >= prev:
            out[current] = out.get(current, 0.0) + finished - prev
        out["total"] = max(0.0, (finished or time.monotonic()) - stamps["received"])
        return {k: out[k] for k in STAGES if k in out}

    def own_path(self) -> dict[str, float] | None:
        """The gateway's own milliseconds on a URL replica's request's way to its first byte:
        `to_backend` (received -> sent) and `to_client`, from the backend's output that the
        first byte carried to `first_sent` (a stream's first token; a whole reply's last, i.e.
        `finished` when it came before the body). None unless these were stamped (another replica
        kind, or a request that ended before its reply)."""
        s = self.stamps
        sent, first, replied = s.get("sent"), s.get("first_token"), s.get("first_sent")
        if sent is None or first is None or replied is None:
            return None
        finished = s.get("finished")
        carried = finished if finished is not None and first <= finished <= replied else first
        return {"to_backend": round((sent - s["received"]) * 1000, 2),
                "to_client": round(max(0.0, replied - carried) * 1000, 2)}

    def server_timing(self) -> str:
        """The `Server-Timing` header value (milliseconds)."""
        return ", ".join(f"{k};dur={v * 1000:.1f}" for k, v in self.durations().items())
