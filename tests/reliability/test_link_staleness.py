"""An engine's late state push does not make it unhealthy; a wedged engine still does.

In the soak (benchmarks/results/soak_before.md) five requests got 503 `no_healthy_replica` with
both engines alive: on a busy machine the 100 ms state pushes, or the gateway's reading of them,
lagged by over a second, and a 1 s staleness limit turned both replicas unhealthy at once. Death
is seen at once through the link closing (tests/replica/test_engine_link.py); staleness is only
for an engine that is alive but silent, so a few seconds of lag must be tolerated.
"""

from __future__ import annotations

import time

from tokenpath.protocol import EngineState
from tokenpath.replica.link_client import STALE_AFTER_S, EngineLinkReplica


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
