"""A step that raises fails only the requests in it; the engine keeps serving.

Before issue 10's fix one exception in `EngineCore.step` killed the step loop for good: every
request in flight failed and the model answered 503 until a restart. The fault is injected by
wrapping the real runner's `execute` (a test double around the real forward, in tests/ only).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.tiny_models import save_tiny
from tokenpath import SamplingParams
from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.errors import RequestFailedError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny"))


class Poison:
    """Wraps `runner.execute`: raises when a batch holds a sequence of a poisoned request."""

    def __init__(self, execute, poisoned: set[str]) -> None:
        self.execute, self.poisoned, self.raised = execute, poisoned, 0

    def __call__(self, scheduled):
        if any(seq.request_id in self.poisoned for seq, _ in scheduled):
            self.raised += 1
            raise RuntimeError("injected kernel fault")
        return self.execute(scheduled)


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
    ids: list[int] = []
    async for out in engine.generate(prompt, params, rid):
        for c in out.outputs:
            ids.extend(c.token_ids)
    return ids


async def test_a_failing_step_fails_its_requests_only_and_the_engine_serves_on(tiny):
    engine = AsyncEngine(model=str(tiny), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("a b c d e f g")
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        expected = await collect(engine, prompt, params, "before")
        poison = Poison(engine.core.runner.execute, {"bad"})
        engine.core.runner.execute = poison

        # A long request decoding when the poisoned one arrives shares its step, and fails with it.
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        victim = asyncio.create_task(collect(engine, prompt, long, "victim"))
        while engine.state().running == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(RequestFailedError) as err:
            await collect(engine, prompt, params, "bad")
        assert err.value.status_code == 500 and err.value.code == "engine_failed"
        assert "injected kernel fault" in err.value.message
        with pytest.raises(RequestFailedError):
            await asyncio.wait_for(victim, 30)
        assert poison.raised == 1

        # The engine is alive, holds nothing, and serves the next request exactly as before.
        assert engine.healthy
        state = engine.state()
        assert state.running == state.waiting == 0 and state.kv_usage == 0.0
        assert await collect(engine, prompt, params, "after") == expected
        assert engine.core.failed_steps == 1
    finally:
        await engine.shutdown()
