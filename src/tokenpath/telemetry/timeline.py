"""The Timeline: one source of truth for where a request's time went.

Created when the HTTP request arrives and carried down to the engine and back. Traces, metrics,
the audit row and the Server-Timing header are all *derived* from it, so they cannot disagree.
Times are `time.monotonic()` seconds; `wall_start` anchors them to the wall clock for logs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STAGES = (
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


@dataclass
class Timeline:
    request_id: str
    wall_start: float = field(default_factory=time.time)
    stamps: dict[str, float] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)
    # Free-form facts about decisions (deployment, replica, routing policy and reason, tenant...).
    attrs: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stamps.setdefault("received", time.monotonic())

    def stamp(self, stage: str, at: float | None = None, **attrs: object) -> None:
        """Record the first time a stage is reached (later calls keep the first stamp)."""
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
        """Seconds spent per stage: queue (received->scheduled), prefill (scheduled->first token),
        decode (first token->finished), total. Missing stages are left out."""
        out: dict[str, float] = {}
        end = self.stamps.get("finished") or time.monotonic()
        for name, a, b in (
            ("queue", "received", "scheduled"),
            ("prefill", "scheduled", "first_token"),
            ("decode", "first_token", "finished"),
        ):
            d = self.between(a, b)
            if d is not None:
                out[name] = d
        out["total"] = max(0.0, end - self.stamps["received"])
        return out

    def server_timing(self) -> str:
        """The `Server-Timing` header value (milliseconds)."""
        return ", ".join(f"{k};dur={v * 1000:.1f}" for k, v in self.durations().items())
