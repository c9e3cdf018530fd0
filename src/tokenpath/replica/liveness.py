"""Is the engine behind a replica still moving, and is each request on it? The one place a stalled
replica is found, ejected and let go of its requests, for every replica kind that uses it (the
in-process engine, engine processes and Ray actors over the engine link, embedding engines, remote
servers).

A replica can stop without dying: SIGSTOP, a VM pause, swap, a stuck kernel, a noisy neighbour. Its
socket stays open, so nothing closes and nothing fails; before this module its in-flight requests
waited for as long as it was frozen (150 s for a 150 s freeze, issue 23) while a healthy sibling
sat idle. A stall is a commoner fault than a crash, and it must cost a client no more than a crash.

`Liveness` runs one timer per replica (every `tick_s`; per output it costs one attribute store):
- **The replica.** Nothing heard from it (a state push, an output, a pong; for an engine in this
  process, no turn of its step thread's loop: `local.py`) for the bound (`stall_after_s`, or longer
  for an engine whose normal steps are long: `slack_s`):
  it is *stalled*. It is ejected at once (its `state()` says unhealthy, so no picker can choose it,
  whatever its prefix score), logged once as `replica_ejected` with reason `stalled`, and counted.
  Every request in flight on it is failed with `ReplicaStalledError`: the router retries those
  that sent no token yet on another replica (same request id) and ends the others with a clean
  503. Their streams close, so the engine is sent `abort` for each; the socket holds the frames
  and a frozen engine reads them when it wakes. The first frame heard again recovers it.
- **Each request.** No first output within `first_token_s` of dispatch, or no next output within
  `next_token_s` of the last: `ProgressTimeoutError` for that request only (a request stuck in a
  live engine). The defaults are minutes, far past what a healthy engine takes.

A healthy engine is heard from at least once a second (its state heartbeat, `link_server.py`).
The gateway's own event loop can lag behind too, and frames that wait unread in its socket would
then look like silence; so a tick that runs late judges nothing (the next one, after the reader
has caught up, does), and a replica is only declared stalled after the loop has had a few turns to
read what already arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenpath.replica.base import ProgressTimeoutError, ReplicaStalledError
from tokenpath.telemetry import series as metrics

log = logging.getLogger("tokenpath.replica")

# 4 s, not 5: issue 23's target is that a frozen engine costs a request at most 5 s beyond its
# normal time, and that extra wait is the bound, plus up to one tick, plus the retry's dispatch.
STALL_AFTER_S = 4.0
FIRST_TOKEN_S = 600.0
NEXT_TOKEN_S = 300.0
LATE_TICK_S = 0.5  # a tick this late means the gateway itself was held up: judge on the next one
MAX_TICK_S = 0.1  # detection latency past the bound: at most this (one timer wake per replica)


@dataclass
class LivenessConfig:
    """The bounds (`tokenpath serve --stall-timeout / --first-token-timeout / --token-timeout`)."""

    stall_after_s: float = STALL_AFTER_S
    first_token_s: float = FIRST_TOKEN_S
    next_token_s: float = NEXT_TOKEN_S

    @property
    def tick_s(self) -> float:
        return max(0.02, min(MAX_TICK_S, self.stall_after_s / 20))


class Progress:
    """One request in flight on the replica: when it was sent and when it last produced output."""

    __slots__ = ("dispatched", "done", "fail", "last", "started")

    def __init__(self, fail: Callable[[BaseException], None], now: float) -> None:
        self.fail = fail  # hands the error to whoever reads the request's stream
        self.dispatched = self.last = now
        self.started = False
        self.done = False  # failed already (a stream is failed once)

    def advance(self, now: float) -> None:
        self.last = now
        self.started = True


class Liveness:
    def __init__(self, name: str, config: LivenessConfig | None = None,
                 poll: Callable[[Liveness], None] | None = None) -> None:
        self.name = name
        self.config = config or LivenessConfig()
        self.deployment = ""  # for the log line and the metric; set by whoever builds the deployment
        # An engine that cannot push (one in this process) is read instead: `poll(self)` runs before
        # every judgement and calls `heard` with when the engine last moved (`local.py`).
        self.poll = poll
        # Silence this long is not a stall either, where it exceeds `stall_after_s`: an engine whose
        # normal steps are long (a big model on a slow CPU: a 10 s prefill chunk is work, not a
        # stall). Set from the engine's own record of its steps (`local.py`).
        self.slack_s = 0.0
        self.heard_at = time.monotonic()
        self.stalled_since: float | None = None
        self.requests: dict[str, Progress] = {}
        self.ejections = 0
        self.active = True  # judged only while True (a link replica: while linked; a closed link is not a stall)
        self._task: asyncio.Task | None = None

    # -- what the replica tells it ----------------------------------------------------------------
    def heard(self, now: float) -> None:
        """Anything arrived from the engine (once per read, not per frame), or the engine was last
        seen moving at `now` (a polled engine; a time no later than one already heard changes nothing)."""
        if now <= self.heard_at:
            return
        self.heard_at = now
        if self.stalled_since is not None:
            log.info("replica %s: recovered: the engine answers again after %.1fs stalled; taking traffic",
                     self.name, now - self.stalled_since,
                     extra={"event": "replica_recovered", "replica": self.name, "deployment": self.deployment,
                            "reason": "stalled", "stalled_s": round(now - self.stalled_since, 3)})
            self.stalled_since = None

    def silent_for(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.heard_at

    @property
    def bound(self) -> float:
        """Silence past this is a stall: the configured bound, or the engine's slack if longer."""
        return max(self.config.stall_after_s, self.slack_s)

    def _poll(self) -> None:
        if self.poll is not None:
            self.poll(self)

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    def detail(self, now: float | None = None) -> str | None:
        """Why the replica is not healthy, as far as liveness goes (None: it is)."""
        self._poll()
        silent = self.silent_for(now)
        if self.stalled_since is not None or (self.active and silent > self.bound):
            return f"stalled: nothing from the engine for {silent:.1f}s"
        return None

    def track(self, request_id: str, fail: Callable[[BaseException], None]) -> Progress:
        """A request is being sent; refused at once while the replica is stalled."""
        if self.stalled_since is not None:
            raise self._stall_error(started=False)
        p = self.requests[request_id] = Progress(fail, time.monotonic())
        self.start()
        return p

    def untrack(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    # -- the timer --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the timer (lazily: a replica may be built before the event loop runs)."""
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):
                self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        due = time.monotonic()
        while True:
            tick = self.config.tick_s
            due += tick
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            if now - due > LATE_TICK_S:  # the gateway was held up, not (necessarily) the engine
                due = now
                continue
            self._poll()
            if self.active and self.stalled_since is None and self.silent_for(now) > self.bound:
                for _ in range(3):  # let the reader take what already arrived before judging
                    await asyncio.sleep(0)
                self._poll()
                now = time.monotonic()
                if self.active and self.silent_for(now) > self.bound:
                    self._stall(now)
            self._check_requests(now)

    def _stall_error(self, started: bool) -> ReplicaStalledError:
        silent = self.silent_for()
        what = "its stream was cut" if started else "retry elsewhere"
        return ReplicaStalledError(f"replica '{self.name}' stalled (nothing from its engine for {silent:.1f}s); "
                                   f"{what}")

    def _stall(self, now: float) -> None:
        self.stalled_since = now
        self.ejections += 1
        live = [p for p in self.requests.values() if not p.done]
        log.warning("replica %s: ejected: stalled, nothing from the engine for %.1fs; %d in-flight request(s) "
                    "released (%d to retry elsewhere)", self.name, self.silent_for(now), len(live),
                    sum(not p.started for p in live),
                    extra={"event": "replica_ejected", "replica": self.name, "deployment": self.deployment,
                           "reason": "stalled", "silent_s": round(self.silent_for(now), 3),
                           "inflight": len(live)})
        metrics.REPLICA_EJECTIONS.labels(self.deployment, self.name).inc()
        for p in live:
            p.done = True
            p.fail(self._stall_error(p.started))

    def _check_requests(self, now: float) -> None:
        c = self.config
        for p in list(self.requests.values()):
            if p.done:
                continue
            if not p.started and now - p.dispatched > c.first_token_s:
                p.done = True
                p.fail(ProgressTimeoutError(f"replica '{self.name}' produced no first token within "
                                            f"{c.first_token_s:g}s of dispatch"))
            elif p.started and now - p.last > c.next_token_s:
                p.done = True
                p.fail(ProgressTimeoutError(f"replica '{self.name}' produced no token for {c.next_token_s:g}s "
                                            "in the middle of a request"))
