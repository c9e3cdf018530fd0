"""The kernels' step buffers go back to the OS when the engine goes idle (issue 41: "gateway RSS
back within 10% afterwards").

The native step buffers (csrc/forward.cpp Model: activations, qkv / gate-up outputs, their int8
copies) grow to the widest step seen and stay, so a steady step allocates nothing. In the
slow-reader flood the widest steps are the recompute prefills of KV-preempted 1,500-token streams
(1,024 rows), which the warm-up never runs: SmolLM2's buffers grew by ~30 MiB and stayed for
good, most of the gateway's RSS growth after the flood. Now AsyncEngine releases them when it has
no work left (`EngineCore.release_step_buffers`), and the next step grows what it needs again.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.tiny_models import save_tiny
from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.protocol import GenerateRequest, SamplingParams

WIDE = 480  # prompt tokens: one prefill step of this many rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny"), hidden_size=256, intermediate_size=1024)


async def _run(engine: AsyncEngine, rid: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    async for _ in engine.generate(GenerateRequest(rid, prompt, params)):
        pass


async def _idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        if engine.idle and not engine.core.has_work() and engine.core.runner.step_buffer_bytes() == 0:
            return
        await asyncio.sleep(0.01)


async def test_wide_step_buffers_are_released_when_idle(tiny):
    engine = AsyncEngine(model=str(tiny), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=512,
                         max_model_len=1024)
    native = engine.core.runner.native
    assert native is not None
    held: list[int] = []  # after each step, on the step thread (between steps)
    engine.core.step_observers.append(lambda *_: held.append(native.step_buffer_bytes()))
    await engine.start()
    try:
        one = engine.tokenizer.encode("Hi")
        await _run(engine, "small", one, 4)
        small = max(held)  # a one-sequence request's widest step (its prompt)

        held.clear()
        await _run(engine, "wide", (engine.tokenizer.encode("a b c d e f g h ") * WIDE)[:WIDE], 2)
        wide = max(held)
        assert wide > 8 * small, (wide, small)  # the 480-row prefill grew them

        await _idle(engine)
        assert native.step_buffer_bytes() == 0, "idle: the wide step's buffers are still held"

        held.clear()  # and the engine runs on, growing back only what a small request needs
        await _run(engine, "small-again", one, 4)
        assert 0 < max(held) <= small, (max(held), small)
    finally:
        await engine.shutdown()
