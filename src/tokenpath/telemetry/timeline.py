"""The Timeline: the one per-request timing record, and where a request's time went.

Created when the HTTP request arrives; every layer stamps the events it sees onto it, and the
replica boundary (`tokenpath.replica.events.stamp_events`) stamps the engine's events, in this
process's clock, whether the engine runs in-process or in an engine process. Server-Timing, the
body's `tokenpath.timing`, the audit row, `/metrics` and traces are all *derived* from
`durations()`, so they cannot disagree. Times are `time.monotonic()` seconds; `wall_start`
anchors them to the wall clock for logs and traces.

Stages (`STAGES`), the same in-process and with engine processes (`--replicas N`):

| stage          | from -> to              | what it holds                                   |
|----------------|-------------------------|-------------------------------------------------|
| `gateway`      | received -> admitted    | auth, routing, tokenizing, rate limits          |
| `queue`        | admitted -> dispatched  | the gateway's admission (fair) queue            |
| `engine_queue` | dispatched -> scheduled | the link and the engine's own waiting queue     |
| `prefill`      | scheduled -> first_token| prompt compute (chunks, prefix-cache hits)      |
| `decode`       | first_token -> finished | every later token                               |
| `total`        | received -> finished    | the whole request (the sum of the above)        |

A stage whose two events were not both reached (an error, an embedding request) is left out;
`total` is always present. Events are kept in order by their stampers, so the stages sum to
`total` whenever all are present.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

EVENTS = (
    "received",
    "authenticated",
    "routed",
    "admitted",
    "dequeued",
    "dispatched",
    "scheduled",
    "first_token",
    "finished",
)

# (stage, from event, to event); `total` is received -> finished.
STAGE_BOUNDS = (
    ("gateway", "received", "admitted"),
    ("queue", "admitted", "dispatched"),
    ("engine_queue", "dispatched", "scheduled"),
    ("prefill", "scheduled", "first_token"),
    ("decode", "first_token", "finished"),
)
STAGES = (*(s for s, _, _ in STAGE_BOUNDS), "total")


@dataclass
class Timeline:
    request_id: str
    wall_start: float = field(default_factory=time.time)
    stamps: dict[str, float] = field(default_factory=dict)
    # Free-form facts about decisions (deployment, replica, routing policy and reason, tenant...).
    attrs: dict[str, object] = field(default_factory=dict)

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
        """Seconds per stage (see the module docstring), in `STAGES` order; missing ones left out."""
        out: dict[str, float] = {}
        end = self.stamps.get("finished") or time.monotonic()
        for name, a, b in STAGE_BOUNDS:
            d = self.between(a, b)
            if d is not None:
                out[name] = d
        out["total"] = max(0.0, end - self.stamps["received"])
        return out

    def server_timing(self) -> str:
        """The `Server-Timing` header value (milliseconds)."""
        return ", ".join(f"{k};dur={v * 1000:.1f}" for k, v in self.durations().items())
