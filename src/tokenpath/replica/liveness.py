"""Is the engine behind a replica still moving, and is each request on it? The one place a stalled
replica is found, ejected and let go of its requests, for every replica kind that uses it (the
in-process engine, engine processes and Ray actors over the engine link, embedding engines, remote
servers).

A replica can stop without dying: SIGSTOP, a VM pause, swap, a stuck kernel, a noisy neighbour. Its
socket stays open, so nothing closes and nothing fails; before this module its in-flight requests
waited for as long as it was frozen (150 s for a 150 s freeze, issue 23) while a healthy sibling
sat idle. A stall is a commoner fault than a crash, and it must cost a client no more than a crash.

`Liveness` runs one timer per replica, which sleeps until something can first be late (about once a
second on a healthy replica; per output it costs one attribute store):
- **The replica.** It is *stalled* when either of two things is late:
  - *its process*: nothing heard from it (a state push, an output, a pong) for `stall_after_s`
    (a SIGSTOPped or paused process; an engine in this process is always heard: `local.py`);
  - *its engine's step loop*, for engines that report it (`stepped`: the in-process engine, read
    by `local.py`; engine processes and Ray actors, in each state push over the link,
    `EngineState.step_age_s`): one turn of the loop (a step) running longer than `hang_bound`,
    the stall bound or `STEP_SLACK` times what a normal step of that engine takes if longer
    (`FIRST_STEP_S` before its first step has ended: that one pays one-time setup). This is a
    stuck kernel or a deadlock in a process whose event loop, and so its link, still runs: on the
    link alone it looked alive, and its requests waited for as long as the step hung. The step's
    age leaves out the time its thread waited for a CPU (`engine.cpu_wait`): on an oversubscribed
    machine a step runs slowly but is not hung, and ejecting a loaded host's only replica turned
    its slowness into 503s.
  One rule for every kind of replica, judged here and nowhere else. A stalled replica is ejected
  at once (its `state()` says unhealthy, so no picker can choose it, whatever its prefix score),
  logged once as `replica_ejected` with reason `stalled` (and `cause`: `silent` or `step`), and
  counted. Every request in flight on it is failed with `ReplicaStalledError`: the router retries
  those that sent no token yet on another replica (same request id) and ends the others with a
  clean 503. Their streams close, so the engine is sent `abort` for each; the socket holds the
  frames and a frozen engine (or a hung step loop) takes them when it wakes. It is recovered once
  neither is late any more: the first frame heard again, the first state saying the step ended.
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
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenpath.errors import DuplicateRequestIdError
from tokenpath.replica.base import ProgressTimeoutError, ReplicaStalledError
from tokenpath.telemetry import series as metrics

log = logging.getLogger("tokenpath.replica")

# 4 s, not 5: issue 23's target is that a frozen engine costs a request at most 5 s beyond its
# normal time, and that extra wait is the bound, plus up to one tick, plus the retry's dispatch.
STALL_AFTER_S = 4.0
FIRST_TOKEN_S = 600.0
NEXT_TOKEN_S = 300.0
LATE_TICK_S = 0.5  # a wake this late means the gateway itself was held up: judge after one more tick
MAX_TICK_S = 0.1  # after such a late wake, the wait before judging (the reader's catch-up)
MAX_SLEEP_S = 1.0  # the timer's longest sleep: a bound changed from outside is honoured within it
DUE_SLACK_S = 0.005  # wake just past a due time, so the bound it ends is exceeded, not met
HEARD_EVERY_S = 1.0  # a healthy engine process is heard at least this often (`link_server`'s heartbeat)
STEP_SLACK = 3.0  # a step is hung past this many times the most a normal step takes (and the bound)
FIRST_STEP_S = 30.0  # an engine's first step (one-time setup, no price per token yet) is hung only past this


def hang_bound(stall_after_s: float, step_allowance_s: float | None) -> float:
    """How long one step of an engine may run before it is hung: the stall bound, or `STEP_SLACK`
    times what a normal step of that engine takes (`AsyncEngine.step_allowance_s`; None before its
    first step has ended) if longer, so a big model's long prefill chunk is work, not a hang. The
    engine counts no step longer than this into what is normal (`AsyncEngine.step_ceiling_s`), so
    a hang that ended does not stretch the bound for every later one."""
    slack = FIRST_STEP_S if step_allowance_s is None else STEP_SLACK * step_allowance_s
    return max(stall_after_s, slack)


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
        self._config = config or LivenessConfig()
        self.deployment = ""  # for the log line and the metric; set by whoever builds the deployment
        # An engine that cannot push (one in this process) is read instead: `poll(self)` runs before
        # every judgement and calls `heard` and `stepped` (`local.py`).
        self.poll = poll
        self.heard_at = time.monotonic()
        # The engine's step loop, where it is reported (`stepped`): when the step running now began
        # (or when the loop was last seen waiting for work), and what a normal step of it may take.
        self.step_at: float | None = None
        self.step_allowance_s: float | None = None
        self.stalled_since: float | None = None
        self.reason = ""  # why it was ejected, while it is
        self.requests: dict[str, Progress] = {}
        self.ejections = 0
        self.active = True  # judged only while True (a link replica: while linked; a closed link is not a stall)
        self._task: asyncio.Task | None = None
        self._due = math.inf  # when the timer wakes next (-inf while it is awake)

    @property
    def config(self) -> LivenessConfig:
        return self._config

    @config.setter
    def config(self, config: LivenessConfig) -> None:
        """New bounds (set once the serve command knows them): judged by them from now on."""
        self._config = config
        self._sooner(time.monotonic())

    # -- what the replica tells it ----------------------------------------------------------------
    def heard(self, now: float) -> None:
        """Anything arrived from the engine (once per read, not per frame; a time no later than one
        already heard changes nothing)."""
        if now <= self.heard_at:
            return
        self.heard_at = now
        self._recover(now)

    def stepped(self, at: float, allowance_s: float | None) -> None:
        """The engine's step loop, as its engine reports it: the step running now began at `at` (a
        loop waiting for work reports the time it was seen waiting), and a normal step of it takes
        up to `allowance_s` (None: no step has ended yet)."""
        self.step_allowance_s = allowance_s
        if self.step_at is None or at > self.step_at:
            self.step_at = at
            self._recover(time.monotonic())
        self._sooner(self.step_at + self.bound)  # (a first allowance can shorten the bound)

    def forget_steps(self) -> None:
        """A new engine behind the replica (a restarted process): its old step reports say nothing."""
        self.step_at = self.step_allowance_s = None

    def silent_for(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.heard_at

    def step_running_for(self, now: float | None = None) -> float:
        """How long the engine's step running now has run (0 where steps are not reported)."""
        return 0.0 if self.step_at is None else (time.monotonic() if now is None else now) - self.step_at

    @property
    def bound(self) -> float:
        """A step running past this is hung (`hang_bound`); for a replica whose steps are not
        reported, the stall bound."""
        if self.step_at is None:
            return self.config.stall_after_s
        return hang_bound(self.config.stall_after_s, self.step_allowance_s)

    def _why(self, now: float) -> tuple[str, str, float] | None:
        """Why the replica counts as stalled at `now`, or None: (which of the two is late: `silent`
        or `step`, the reason in words, how long it has been)."""
        silent = now - self.heard_at
        if silent > self.config.stall_after_s:
            return "silent", f"nothing from the engine for {silent:.1f}s", silent
        if self.step_at is not None and (running := now - self.step_at) > self.bound:
            if silent > 2 * HEARD_EVERY_S:  # (its whole process went quiet too: a freeze, not one step)
                return "silent", f"nothing from the engine for {silent:.1f}s", silent
            return "step", f"one step of the engine has run for {running:.1f}s (hung)", running
        return None

    def _recover(self, now: float) -> None:
        if self.stalled_since is None or self._why(now) is not None:
            return
        log.info("replica %s: recovered: the engine answers again after %.1fs stalled; taking traffic",
                 self.name, now - self.stalled_since,
                 extra={"event": "replica_recovered", "replica": self.name, "deployment": self.deployment,
                        "reason": "stalled", "stalled_s": round(now - self.stalled_since, 3)})
        self.stalled_since = None

    def _poll(self) -> None:
        if self.poll is not None:
            self.poll(self)

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    def detail(self, now: float | None = None) -> str | None:
        """Why the replica is not healthy, as far as liveness goes (None: it is)."""
        self._poll()
        why = self._why(time.monotonic() if now is None else now)
        if why is not None and (self.active or self.stalled_since is not None):
            return f"stalled: {why[1]}"
        return None if self.stalled_since is None else f"stalled: {self.reason}"

    def track(self, request_id: str, fail: Callable[[BaseException], None]) -> Progress:
        """A request is being sent; refused at once while the replica is stalled, or while another
        request holds the id (tracking it would replace, then untrack, the other one's progress)."""
        if self.stalled_since is not None:
            raise self._stall_error(started=False)
        if request_id in self.requests:
            raise DuplicateRequestIdError(f"request id '{request_id}' is already in use")
        p = self.requests[request_id] = Progress(fail, time.monotonic())
        self.start()
        self._sooner(p.dispatched + self.config.first_token_s)
        return p

    def untrack(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    # -- the timer --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the timer (lazily: a replica may be built before the event loop runs)."""
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):
                self._task = asyncio.get_running_loop().create_task(self._watch())
                self._due = -math.inf  # (it computes its first due time when it runs)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    def _sooner(self, when: float) -> None:
        """Something may now fall due before the timer wakes (a new request with a short bound, a
        shorter bound, a step allowance learned): restart it, so it sleeps to the new due time."""
        if when < self._due and self._task is not None and not self._task.done():
            self._task.cancel()
            self._task = None
            self.start()

    def _next_due(self, now: float) -> float:
        """When the next judgement can first find something late: the silence bound from the last
        frame heard, the hang bound from the step running now, each request's own bound. Nothing
        can be late before then, so the timer sleeps until it (at most `MAX_SLEEP_S`)."""
        c = self.config
        due = now + MAX_SLEEP_S
        if self.active and self.stalled_since is None:
            due = min(due, self.heard_at + c.stall_after_s)
            if self.step_at is not None:
                due = min(due, self.step_at + self.bound)
        for p in self.requests.values():
            if not p.done:
                due = min(due, p.last + c.next_token_s if p.started else p.dispatched + c.first_token_s)
        return due + DUE_SLACK_S

    async def _watch(self) -> None:
        """Wakes when something can first be late (`_next_due`), not on a fixed tick: a 10 Hz tick
        per replica cost the gateway's event loop a wake-up per tick, and on a loaded machine that
        doubled its CPU per streamed token (`benchmarks/link_cpu.py`). Frames heard meanwhile only
        move the due time later, so a healthy replica is judged about once a second."""
        while True:
            self._due = -math.inf  # (awake: what `_sooner` would wake it for is judged below anyway)
            self._poll()
            now = time.monotonic()
            due = self._due = self._next_due(now)
            await asyncio.sleep(max(0.0, due - now))
            self._due = -math.inf
            now = time.monotonic()
            if now - due > LATE_TICK_S:  # the gateway was held up, not (necessarily) the engine:
                await asyncio.sleep(self.config.tick_s)  # let its reader catch up, then judge
                continue
            self._poll()
            if self.active and self.stalled_since is None and self._why(now) is not None:
                for _ in range(3):  # let the reader take what already arrived before judging
                    await asyncio.sleep(0)
                self._poll()
                now = time.monotonic()
                why = self._why(now)
                if self.active and why is not None:
                    self._stall(now, *why)
            self._check_requests(now)

    def _stall_error(self, started: bool) -> ReplicaStalledError:
        what = "its stream was cut" if started else "retry elsewhere"
        return ReplicaStalledError(f"replica '{self.name}' stalled ({self.reason}); {what}")

    def _stall(self, now: float, cause: str, reason: str, late_s: float) -> None:
        self.stalled_since = now
        self.reason = reason
        self.ejections += 1
        live = [p for p in self.requests.values() if not p.done]
        log.warning("replica %s: ejected: stalled, %s; %d in-flight request(s) released (%d to retry elsewhere)",
                    self.name, reason, len(live), sum(not p.started for p in live),
                    extra={"event": "replica_ejected", "replica": self.name, "deployment": self.deployment,
                           "reason": "stalled", "cause": cause,
                           "silent_s": round(late_s, 3), "inflight": len(live)})
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
