"""The replicas of one deployment, as the gateway sees them: in-flight counts, room, ejection.

A replica's own `state()` can lag (a remote one is polled) and does not know what this gateway
just dispatched, so the pool overlays its own in-flight count. "Room" is what keeps the engines'
queues short: the gateway dispatches only while a replica holds fewer than `max_inflight`
of our requests, its engine queue is short and its KV cache is not full; everything else waits in
the gateway's fair queue, where priorities and deadlines can still act on it.

A replica that fails (an error before the first token, a dead stream, or `healthy=False` in its
state) is ejected for a backoff that doubles on each consecutive failure, then probed back: once
the backoff has passed and its state says healthy again, it takes traffic.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

from tokenpath.protocol import ReplicaState
from tokenpath.replica.base import Replica

# The pool reads a replica's name and state only, whatever it serves (a generation's or an
# embedding's pair): the deployment that owns it knows which, and calls `generate` itself.
AnyReplica = Replica[Any, Any]

log = logging.getLogger("tokenpath.replica")


@dataclass
class PoolConfig:
    # Per replica. None: its batch size (max_num_seqs, else 8) plus `max_engine_waiting`: a short
    # engine queue means the next request is ready the moment a sequence finishes, and it gives
    # prefix-aware routing room to keep a group on its replica instead of spilling it cold.
    max_inflight: int | None = None
    max_engine_waiting: int = 2  # the engine's own queue may hold at most this many of anyone's
    kv_limit: float = 0.98  # no dispatch above this KV usage
    eject_base_s: float = 1.0
    eject_max_s: float = 30.0


class ReplicaHandle:
    def __init__(self, replica: AnyReplica, config: PoolConfig) -> None:
        self.replica = replica
        self.config = config
        self.inflight = 0
        self.pending_prefill = 0  # uncached prompt tokens dispatched here, no first token yet
        self.failures = 0
        self.ejected_until = 0.0
        self.eject_reason: str | None = None
        self.last_raw: ReplicaState | None = None

    @property
    def name(self) -> str:
        return self.replica.name

    def raw_state(self) -> ReplicaState:
        error: Exception | None = None
        # A few tries: an in-process engine's state is read while its step thread mutates it, and
        # a transient "changed size during iteration" must not eject a healthy replica.
        for _ in range(3):
            try:
                return self.replica.state()
            except Exception as exc:
                error = exc
        # A replica that cannot even report is unhealthy, not a crash.
        return ReplicaState(name=self.name, healthy=False, detail=f"state() failed: {error}")

    def state(self, now: float | None = None) -> ReplicaState:
        """The replica's state with this gateway's view on top (in-flight count, ejection)."""
        s = self.last_raw = self.raw_state()
        now = time.monotonic() if now is None else now
        healthy = s.healthy and not self.is_ejected(now, s)
        # Our in-flight requests are in the engine somewhere; if its report has not caught up yet,
        # count the difference as waiting (that is where a just-dispatched request sits).
        # A shallow copy with four fields set: `dataclasses.replace` rebuilt all ~25 through
        # `__init__`, on every admission decision (several per request, issue 37).
        out = copy.copy(s)
        out.waiting = max(s.waiting, self.inflight - s.running)
        out.healthy = healthy
        out.pending_prefill_tokens = self.pending_prefill
        out.detail = s.detail if healthy or not self.eject_reason else self.eject_reason
        return out

    def is_ejected(self, now: float, state: ReplicaState | None = None) -> bool:
        if self.ejected_until == 0.0:
            return False
        if now < self.ejected_until:
            return True
        # Backoff over: probe. The state must say healthy before traffic returns.
        s = state or self.raw_state()
        if s.healthy:
            log.info("replica %s: healthy again after ejection (%s); taking traffic", self.name, self.eject_reason)
            self.ejected_until = 0.0
            self.eject_reason = None
            return False
        self.ejected_until = now + self._backoff()
        return True

    def _backoff(self) -> float:
        return min(self.config.eject_max_s, self.config.eject_base_s * 2 ** max(0, self.failures - 1))

    def eject(self, reason: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.failures += 1
        self.eject_reason = reason
        self.ejected_until = now + self._backoff()
        log.warning("replica %s: ejected for %.0fs after failure %d: %s", self.name, self._backoff(),
                    self.failures, reason)

    def succeeded(self) -> None:
        self.failures = 0

    def limit(self, state: ReplicaState) -> int:
        if self.config.max_inflight is not None:
            return self.config.max_inflight
        return (state.max_num_seqs or 8) + self.config.max_engine_waiting

    def has_room(self, state: ReplicaState) -> bool:
        """`state` is this handle's overlaid state; the engine-queue test uses the replica's own
        report, so our in-flight requests that it has not seen yet do not block dispatch. Nor do
        its preempted requests back in its queue (`waiting_preempted`): they are in flight already
        (`limit` counts them), and in a flood they are the flooding tenant's, which the engine
        queues behind another tenant's request (engine/kv_share.py); counted, they shut that
        tenant's requests out at the gateway instead (issue 41)."""
        raw = self.last_raw if self.last_raw is not None else state
        raw_waiting = raw.waiting - min(raw.waiting, raw.waiting_preempted)
        return (
            state.healthy
            and self.inflight < self.limit(state)
            and raw_waiting <= self.config.max_engine_waiting
            and state.kv_usage < self.config.kv_limit
        )


@dataclass(frozen=True)
class PoolView:
    """Every replica's overlaid state, read once (`ReplicaPool.view`): what one admission
    decision reads, where it read each replica's state up to five times per request before
    (the precheck's healthy and room passes, then admission's again and its room list)."""

    states: list[ReplicaState]
    room: list[ReplicaState]  # those with room for one more request (`ReplicaHandle.has_room`)

    @property
    def healthy(self) -> list[ReplicaState]:
        return [s for s in self.states if s.healthy]


class ReplicaPool:
    def __init__(self, replicas: list[AnyReplica], config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self.handles = {r.name: ReplicaHandle(r, self.config) for r in replicas}
        if len(self.handles) != len(replicas):
            raise ValueError("replica names within a deployment must be unique")

    def __len__(self) -> int:
        return len(self.handles)

    def states(self) -> list[ReplicaState]:
        now = time.monotonic()
        return [h.state(now) for h in self.handles.values()]

    def healthy(self) -> list[ReplicaState]:
        return [s for s in self.states() if s.healthy]

    def view(self) -> PoolView:
        """Each replica's state and whether it has room, from one read of each (`PoolView`)."""
        now = time.monotonic()
        states, room = [], []
        for h in self.handles.values():
            s = h.state(now)
            states.append(s)
            if h.has_room(s):
                room.append(s)
        return PoolView(states, room)

    def with_room(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[ReplicaState]:
        out = []
        now = time.monotonic()
        for name, h in self.handles.items():
            if name in exclude:
                continue
            s = h.state(now)
            if h.has_room(s):
                out.append(s)
        return out

    def slots(self) -> int:
        """How many requests the healthy replicas take at once (the dispatch capacity)."""
        return sum(self.handles[s.name].limit(s) for s in self.healthy())

    def run_slots(self) -> int:
        """How many requests the healthy replicas *run* at once: their batch sizes (capped by
        `max_inflight`), without the engines' short waiting rooms, where a request dispatched
        still waits for a running one to end. What tenants' shares divide (admission/share.py)."""
        return sum(min(lim, s.max_num_seqs or lim) for s in self.healthy()
                   for lim in (self.handles[s.name].limit(s),))

    def inflight(self) -> int:
        return sum(h.inflight for h in self.handles.values())
