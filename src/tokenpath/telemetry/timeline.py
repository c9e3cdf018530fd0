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
    "scheduled",
    "first_token",
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
    # Free-form facts about decisions (deployment, replica, routing policy and reason, tenant...).
    attrs: dict[str, object] = field(default_factory=dict)
    # The client's own id for the request, when it sent one (`request_id` is the server's, unique).
    client_request_id: str | None = None

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

    def server_timing(self) -> str:
        """The `Server-Timing` header value (milliseconds)."""
        return ", ".join(f"{k};dur={v * 1000:.1f}" for k, v in self.durations().items())
