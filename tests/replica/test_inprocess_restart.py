"""An in-process engine whose step loop died is rebuilt: the replica reports itself unhealthy at
once (with why), restarts the engine in the background, counts the restart, and serves again."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.engine.tiny_models import save_tiny

from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.protocol import GenerateRequest, SamplingParams, Submission
from tokenpath.replica.local import InProcessReplica
from tokenpath.telemetry import series


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny"))


async def drain(replica: InProcessReplica, rid: str) -> list:
    req = GenerateRequest(rid, [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    return [o async for o in replica.generate(Submission(req))]


async def test_a_dead_step_loop_is_restarted(tiny):
    engine = AsyncEngine(model=str(tiny), dtype="float32", num_kv_blocks=32)
    await engine.start()
    replica = InProcessReplica(engine, name="local-tiny", deployment="tiny")
    before = series.REPLICA_RESTARTS.labels("tiny", "local-tiny")._value.get()
    try:
        assert (await drain(replica, "before"))[-1].finished

        def broken() -> bool:  # what a bug outside a step (the loop itself) looks like
            raise RuntimeError("injected loop fault")

        engine.core.has_work = broken
        engine._wake.set()
        deadline = time.monotonic() + 5
        while engine.healthy:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        state = replica.state()  # noticing it starts the restart
        assert not state.healthy and "injected loop fault" in (state.detail or "")
        deadline = time.monotonic() + 60
        while not replica.state().healthy:
            assert time.monotonic() < deadline, "the engine was not restarted"
            await asyncio.sleep(0.05)
        assert replica.engine is not engine and replica.restarts == 1
        assert series.REPLICA_RESTARTS.labels("tiny", "local-tiny")._value.get() == before + 1
        assert (await drain(replica, "after"))[-1].finished
    finally:
        await replica.close()
