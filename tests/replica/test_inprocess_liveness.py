"""The in-process replica's liveness, on a real engine and its real step thread (a tiny model): a
step blocked past the bound releases its requests with `ReplicaStalledError` and makes the replica
unhealthy, and the step's return recovers it; a step that is slow but no slower than the engine's
normal steps of its size (3x) is work, not a stall, nor is a slow first step (one-time setup). The server-level behaviour is in
tests/reliability/test_inprocess_stall.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest
from tests.engine.tiny_models import save_tiny

from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.protocol import GenerateRequest, SamplingParams, Submission
from tokenpath.replica.base import ReplicaStalledError
from tokenpath.replica.liveness import LivenessConfig
from tokenpath.replica.local import InProcessReplica

BOUND_S = 0.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny"))


class Gate:
    """Wraps `runner.execute`: each step first sleeps `delay` seconds and waits for `open`."""

    def __init__(self, execute) -> None:  # noqa: ANN001
        self.execute, self.delay, self.open = execute, 0.0, threading.Event()
        self.open.set()

    def __call__(self, scheduled):  # noqa: ANN001, ANN204
        time.sleep(self.delay)
        self.open.wait(30)
        return self.execute(scheduled)


async def run(replica: InProcessReplica, rid: str, tokens: int = 4, prompt: tuple = (5, 6, 7, 8)) -> list:
    req = GenerateRequest(rid, list(prompt), SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    outs = [o async for o in replica.generate(Submission(req, prompt=f"text of {rid}"))]
    # The engine sees ids only: the replica puts its submission's text back on every output.
    assert all(o.prompt == f"text of {rid}" for o in outs)
    return outs


@pytest.fixture
async def gated(tiny):
    engine = AsyncEngine(model=str(tiny), dtype="float32", num_kv_blocks=32)
    gate = engine.core.runner.execute = Gate(engine.core.runner.execute)
    await engine.start()
    replica = InProcessReplica(engine, name="local-tiny", deployment="tiny",
                               liveness=LivenessConfig(stall_after_s=BOUND_S))
    try:
        yield replica, gate
    finally:
        gate.open.set()
        await replica.close()


async def test_a_blocked_step_releases_its_request_and_the_replica_recovers_when_it_returns(gated):
    replica, gate = gated
    assert (await run(replica, "before"))[-1].finished and replica.state().healthy
    gate.open.clear()
    started = time.monotonic()
    with pytest.raises(ReplicaStalledError):
        await asyncio.wait_for(run(replica, "hung", prompt=(9,)), 10)  # (a one-token step)
    took = time.monotonic() - started
    assert BOUND_S <= took < replica.liveness.bound + 1.5, (took, replica.liveness.bound)  # (3x a slow first step)
    state = replica.state()
    assert not state.healthy and "stalled" in (state.detail or "")
    with pytest.raises(ReplicaStalledError):  # refused at once while stalled
        await run(replica, "refused")
    await asyncio.sleep(1.5)  # hung for 2 s in all: priced per token, that step would cost 2 s a token
    gate.open.set()
    deadline = time.monotonic() + 5
    while not replica.state().healthy:
        assert time.monotonic() < deadline, "not recovered"
        await asyncio.sleep(0.02)
    assert (await run(replica, "after"))[-1].finished
    assert replica.liveness.ejections == 1
    assert replica.engine.longest_step_s < 1.0  # the hung step (2 s) did not stretch the bound


async def test_steps_as_slow_as_the_engine_normally_is_are_not_a_stall(gated):
    replica, gate = gated
    gate.delay = 1.0  # the first step ever: one-time setup, not priced yet
    assert (await run(replica, "first", tokens=1))[-1].finished and replica.liveness.ejections == 0
    gate.delay = 0.3  # every step: the engine's normal is 0.3 s
    assert (await run(replica, "slow-normal", tokens=3))[-1].finished
    assert replica.engine.longest_step_s >= 0.3 and replica.liveness.bound >= 0.9
    gate.delay = 0.7  # past the 0.5 s bound, within 3x the normal step
    outs = await asyncio.wait_for(run(replica, "slower", tokens=2), 10)
    assert outs[-1].finished and replica.liveness.ejections == 0


class Starved:
    """Wraps `runner.execute`: while `cpu_s` > 0, a step first runs that many seconds of CPU (by its
    own thread's clock) on CPU 0, where hog processes compete for it: a step slowed by a crowded
    machine, running all along, as the 1024-token prefill chunks of a loaded host were. The work
    releases the GIL, as the kernels do: a Python loop holding it would wait on the event loop's
    thread too, which this test is not about."""

    def __init__(self, execute) -> None:  # noqa: ANN001
        self.execute, self.cpu_s, self.walls, self.block = execute, 0.0, [], bytes(1 << 20)

    def __call__(self, scheduled):  # noqa: ANN001, ANN204
        if self.cpu_s > 0:
            mask = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {0})  # (this thread only)
            started, end = time.monotonic(), time.thread_time() + self.cpu_s
            while time.thread_time() < end:
                hashlib.sha256(self.block)  # (without the GIL, as the native kernels run)
            self.walls.append(time.monotonic() - started)
            os.sched_setaffinity(0, mask)
        return self.execute(scheduled)


def start_hogs(n: int = 4) -> list[subprocess.Popen]:
    """`n` processes spinning on CPU 0: a crowded CPU for the step thread (and the loop's) pinned there."""
    return [subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"])
            for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
        h.wait()


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no per-thread schedstat")
async def test_a_step_slowed_by_a_crowded_cpu_is_running_not_hung(tiny):
    """Issue 41's rule that only the replica's own faults eject it, for a step that is slow because
    the machine is oversubscribed: the step thread waits in a run queue, and that wait is not
    counted as the step's age (engine/cpu_wait.py). On the old rule (wall clock only) the replica
    was ejected here, as a loaded host's only replica was, failing its 32 requests with 503s."""
    engine = AsyncEngine(model=str(tiny), dtype="float32", num_kv_blocks=32)
    starved = engine.core.runner.execute = Starved(engine.core.runner.execute)
    await engine.start()
    replica = InProcessReplica(engine, name="local-tiny", deployment="tiny",
                               liveness=LivenessConfig(stall_after_s=BOUND_S))
    hogs = start_hogs()
    try:
        assert (await run(replica, "warm", tokens=3))[-1].finished  # (the first step's allowance, then a price)
        starved.cpu_s = 0.25
        outs = await asyncio.wait_for(run(replica, "crowded", tokens=2), 30)
        assert outs[-1].finished and replica.liveness.ejections == 0 and replica.state().healthy
        # The steps did take longer than the bound by the wall clock (5 threads on one CPU).
        assert max(starved.walls) > 2 * BOUND_S, starved.walls
    finally:
        stop_hogs(hogs)
        await replica.close()


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no per-thread schedstat")
async def test_a_step_waiting_for_the_gil_of_a_crowded_loop_thread_is_not_hung(tiny):
    """The same crowded CPU, but the step's Python work holds the GIL, and the event loop's thread
    shares the crowded CPU and runs Python too: the step thread then also sleeps on the GIL while
    the loop's thread waits in a run queue with it, which the step thread's own run-queue wait
    does not show. The loop thread's wait is counted too (engine/cpu_wait.py); on the step
    thread's alone, this replica was ejected (as one was in a test at load 17)."""
    engine = AsyncEngine(model=str(tiny), dtype="float32", num_kv_blocks=32)
    starved = engine.core.runner.execute = Starved(engine.core.runner.execute)
    starved.block = bytes(1 << 12)  # short hashes: the step thread takes the GIL back thousands of times
    await engine.start()
    replica = InProcessReplica(engine, name="local-tiny", deployment="tiny",
                               liveness=LivenessConfig(stall_after_s=BOUND_S))
    busy = True

    async def python_on_the_loop() -> None:  # the loop's thread: Python work, a yield every 2 ms
        while busy:
            end = time.thread_time() + 0.002
            while time.thread_time() < end:
                pass
            await asyncio.sleep(0)

    mask = os.sched_getaffinity(0)
    hogs = start_hogs()
    try:
        assert (await run(replica, "warm", tokens=3))[-1].finished
        os.sched_setaffinity(0, {0})  # (this thread, the loop's, only)
        spinner = asyncio.create_task(python_on_the_loop())
        starved.cpu_s = 0.25
        outs = await asyncio.wait_for(run(replica, "crowded", tokens=2), 60)
        busy = False
        await spinner
        assert outs[-1].finished and replica.liveness.ejections == 0 and replica.state().healthy
        assert max(starved.walls) > 2 * BOUND_S, starved.walls
    finally:
        busy = False
        os.sched_setaffinity(0, mask)
        stop_hogs(hogs)
        await replica.close()
