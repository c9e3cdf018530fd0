"""Both ends of the engine link for a hung step, in one process: a real `AsyncEngine` (a tiny model)
behind a real `LinkServer` on a loopback socket, linked by a real `EngineLinkReplica`.

The state pushes say how long the step thread has been in its current step and what a normal step
takes; the gateway's stall bound reaches the engine (`StallBound`), which then counts no step past
the hang bound as a normal one (`AsyncEngine.step_ceiling_s`, as in process). A step blocked past
the bound, while the link talks on, releases its request and makes the replica unhealthy for its
step; the step's return recovers it, and the hang did not stretch what a normal step is. The same
through a real engine process and the whole gateway: tests/reliability/test_engine_stall.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from tests.engine.tiny_models import save_tiny

from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.protocol import GenerateRequest, SamplingParams, Submission
from tokenpath.replica.base import ReplicaStalledError
from tokenpath.replica.link_client import EngineLinkReplica
from tokenpath.replica.link_server import LinkServer
from tokenpath.replica.liveness import LivenessConfig, hang_bound

BOUND_S = 0.8


class Gate:
    """Wraps `runner.execute`: a step waits while the gate is shut (as in a native call that hangs)."""

    def __init__(self, execute) -> None:  # noqa: ANN001
        self.execute, self.open = execute, threading.Event()
        self.open.set()

    def __call__(self, scheduled):  # noqa: ANN001, ANN204
        self.open.wait(30)
        return self.execute(scheduled)


async def until(cond, what: str, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def request(rid: str, tokens: int = 4) -> Submission[GenerateRequest]:
    return Submission(GenerateRequest(rid, [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=tokens,
                                                                        ignore_eos=True)))


@pytest.fixture
async def linked(tmp_path):
    engine = AsyncEngine(model=str(save_tiny("llama", tmp_path / "tiny")), dtype="float32", num_kv_blocks=32)
    gate = engine.core.runner.execute = Gate(engine.core.runner.execute)
    await engine.start()
    server = LinkServer(engine, "s3cret")
    sock = socket.create_server(("127.0.0.1", 0))
    await server.start(sock)
    replica = EngineLinkReplica("engine-t", "s3cret", liveness=LivenessConfig(stall_after_s=BOUND_S))
    await replica.connect("127.0.0.1", sock.getsockname()[1])
    try:
        yield engine, server, replica, gate
    finally:
        gate.open.set()
        await replica.close()
        await server.close()
        await engine.shutdown()


async def test_the_step_beat_crosses_the_link_and_a_hung_step_is_judged_by_it(linked):
    engine, server, replica, gate = linked
    assert [o async for o in replica.generate(request("first"))][-1].finished
    # The state says the loop waits for work, and what a normal step takes; the bound reached the engine.
    await until(lambda: replica._state.step_allowance_s is not None, "no step allowance in the state")
    # (a state pushed while the first request's last step ran says that step's age: wait for an idle one)
    await until(lambda: replica._state.step_age_s == 0.0, "the state never said the loop waits for work")
    await until(lambda: server.stall_after_s == BOUND_S, "the gateway's bound never reached the engine")
    await until(lambda: engine.step_ceiling_s == hang_bound(BOUND_S, engine.step_beat()[1]), "no ceiling set")
    assert replica.state().healthy

    gate.open.clear()
    started = time.monotonic()
    with pytest.raises(ReplicaStalledError, match="one step"):
        await asyncio.wait_for(replica.generate(request("hung")).__anext__(), 10)
    took = time.monotonic() - started
    assert BOUND_S <= took < BOUND_S + 1.5, took
    state = replica.state()
    assert not state.healthy and "one step of the engine has run" in (state.detail or ""), state.detail
    assert replica.liveness.silent_for() < 1.5  # (its link talked on all along)
    await asyncio.sleep(0.5)
    gate.open.set()
    await until(lambda: replica.state().healthy, "not recovered when the step returned")
    assert [o async for o in replica.generate(request("after"))][-1].finished
    assert engine.longest_step_s < BOUND_S  # the hung step was not counted as a normal one


async def test_an_engine_that_stops_ends_its_gateways_link_and_leaves_no_handler_behind(linked):
    """`LinkServer.close` with a gateway still linked (an engine told to stop: SIGTERM, or its Ray
    actor's shutdown) ends the link itself: the gateway sees it close at once, and no connection
    handler is left for the loop to cancel at exit (on Python 3.11 that cancellation logged
    "Exception in callback ... CancelledError" from asyncio's own done callback at every stop)."""
    engine, server, replica, _ = linked
    assert [o async for o in replica.generate(request("before-stop"))][-1].finished
    await asyncio.wait_for(server.close(), 5)
    handlers = [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__name__", "") == "_handle"]
    assert handlers == [], handlers
    await until(lambda: not replica.state().healthy, "the gateway never saw the link close", timeout=3)
    assert "link closed" in (replica.state().detail or ""), replica.state().detail
