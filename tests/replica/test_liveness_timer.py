"""The liveness timer sleeps until something can first be late, not on a fixed tick (issue 27's
link CPU: a 10 Hz tick per replica doubled the gateway's CPU per streamed token on a loaded
machine). Two sides of that, on `Liveness` alone with a poll that stands in for a healthy engine:
an idle healthy replica is judged about once a second, and a bound that falls due sooner than the
sleep already begun (a request tracked with a short first-token bound) is still honoured on time."""

from __future__ import annotations

import asyncio
import time

from tokenpath.replica.base import ProgressTimeoutError
from tokenpath.replica.liveness import Liveness, LivenessConfig


class HealthyEngine:
    """A poll that hears the engine every time it is asked, and counts the askings."""

    def __init__(self) -> None:
        self.polls = 0

    def __call__(self, live: Liveness) -> None:
        self.polls += 1
        live.heard(time.monotonic())


async def test_an_idle_healthy_replica_is_judged_about_once_a_second() -> None:
    engine = HealthyEngine()
    live = Liveness("r0", LivenessConfig(stall_after_s=4.0), poll=engine)
    live.start()
    try:
        await asyncio.sleep(2.5)
    finally:
        await live.stop()
    # Two polls a wake-up (before computing the next due time, and before judging): 5 polls in 2.5 s
    # when measured. The old 10 Hz tick polled 24 times.
    assert engine.polls <= 8, engine.polls
    assert not live.stalled


async def test_a_short_bound_tracked_during_a_long_sleep_is_judged_on_time() -> None:
    live = Liveness("r0", LivenessConfig(stall_after_s=4.0, first_token_s=0.2), poll=HealthyEngine())
    live.start()
    await asyncio.sleep(0.05)  # the timer is asleep now, until ~1 s from its start
    failed: list[tuple[float, BaseException]] = []
    t0 = time.monotonic()
    live.track("req-1", lambda e: failed.append((time.monotonic() - t0, e)))
    try:
        for _ in range(100):
            if failed:
                break
            await asyncio.sleep(0.01)
    finally:
        await live.stop()
    assert failed, "the request's first-token bound was never judged"
    at, err = failed[0]
    assert isinstance(err, ProgressTimeoutError)
    assert 0.2 <= at < 0.6, at  # its own bound, not the timer's 1 s sleep
