"""An engine's late state push does not make it unhealthy; a wedged engine still does, and so does
one whose state pushes say its step has hung (the link talks on: the step thread is stuck).

In the soak (benchmarks/results/soak_before.md) five requests got 503 `no_healthy_replica` with
both engines alive: on a busy machine the 100 ms state pushes, or the gateway's reading of them,
lagged by over a second, and a 1 s staleness limit turned both replicas unhealthy at once. Death
is seen at once through the link closing (tests/replica/test_engine_link.py); staleness is only
for an engine that is alive but silent, so a few seconds of lag must be tolerated.
"""

from __future__ import annotations

import asyncio
import time

from tokenpath.protocol import EngineState
from tokenpath.protocol.wire import encode
from tokenpath.replica.base import ReplicaStalledError
from tokenpath.replica.link_client import STALE_AFTER_S, EngineLinkReplica
from tokenpath.replica.liveness import FIRST_STEP_S, LivenessConfig


def replica_with_state_age(age_s: float) -> EngineLinkReplica:
    rep = EngineLinkReplica("engine-x", secret="unused")
    rep._down_reason = None  # linked, as `connect()` leaves it (no engine needed for this check)
    rep.liveness.active = True
    rep._state = EngineState(running=1, kv_usage=0.1)  # the engine's last state message
    rep.liveness.heard_at = time.monotonic() - age_s
    return rep


def test_a_state_push_two_seconds_late_is_still_healthy():
    assert STALE_AFTER_S >= 3.0
    state = replica_with_state_age(2.0).state()
    assert state.healthy and state.detail is None


def test_an_engine_silent_past_the_limit_is_unhealthy_and_says_why():
    state = replica_with_state_age(STALE_AFTER_S + 1).state()
    assert not state.healthy and "stalled: nothing from the engine" in (state.detail or "")


# -- a step hung while the link talks on (the engine's state pushes say how long its step has run) --
def pushed(rep: EngineLinkReplica, step_age_s: float, allowance_s: float | None = 0.01) -> None:
    """One state frame from the engine, as the reader takes it: heard, then dispatched."""
    rep.liveness.heard(time.monotonic())
    rep._dispatch(encode(EngineState(running=1, step_age_s=step_age_s, step_allowance_s=allowance_s)))


def test_a_step_running_past_the_bound_is_unhealthy_though_the_link_talks():
    rep = replica_with_state_age(0.0)
    pushed(rep, STALE_AFTER_S + 1)
    state = rep.state()
    assert not state.healthy and "one step of the engine has run" in (state.detail or ""), state.detail
    pushed(rep, 0.0)  # that step ended (or the loop waits for work): healthy again
    assert rep.state().healthy


def test_a_long_step_is_work_where_the_engine_normally_takes_that_long():
    rep = replica_with_state_age(0.0)
    pushed(rep, STALE_AFTER_S + 1, allowance_s=None)  # the first step: one-time setup (FIRST_STEP_S)
    assert rep.state().healthy
    pushed(rep, STALE_AFTER_S + 1, allowance_s=(STALE_AFTER_S + 1) / 2)  # within 3x a normal step
    assert rep.state().healthy
    first = replica_with_state_age(0.0)
    pushed(first, FIRST_STEP_S + 1, allowance_s=None)  # even a first step has a bound
    assert not first.state().healthy


async def test_the_watcher_ejects_on_a_hung_step_releases_the_request_and_recovers():
    rep = EngineLinkReplica("engine-h", secret="unused", liveness=LivenessConfig(stall_after_s=0.4))
    rep._down_reason = None
    rep.liveness.active = True
    released: list[BaseException] = []
    rep.liveness.track("r1", released.append)
    began = time.monotonic()
    try:
        while not released:
            assert time.monotonic() - began < 3, "never ejected"
            pushed(rep, time.monotonic() - began)  # the link talks every 50 ms; the step never ends
            await asyncio.sleep(0.05)
        took = time.monotonic() - began
        assert 0.4 <= took < 1.5, took
        assert isinstance(released[0], ReplicaStalledError) and "one step" in str(released[0])
        assert rep.liveness.stalled and rep.liveness.ejections == 1
        pushed(rep, 0.0)
        assert not rep.liveness.stalled and rep.state().healthy
    finally:
        await rep.liveness.stop()
