"""AsyncEngine: deltas stream off the event loop; abort (explicit, or by closing the iterator)
removes the request before the next step and frees its blocks."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.tiny_models import save_tiny
from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.errors import ContextLengthError
from tokenpath.protocol import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny"))


async def test_stream_abort_and_close_free_blocks(tiny):
    engine = AsyncEngine(model=str(tiny), dtype="float32", num_kv_blocks=64)
    await engine.start()
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    prompt = engine.tokenizer.encode("a b c d e f g")

    # 1. explicit abort: the stream ends with finish_reason "abort"
    reasons = []
    async def consume():
        async for out in engine.generate(GenerateRequest("r1", prompt, long)):
            reasons.extend(c.finish_reason for c in out.outputs if c.finish_reason)
    task = asyncio.create_task(consume())
    while engine.state().running == 0:
        await asyncio.sleep(0.01)
    await engine.abort("r1")
    await asyncio.wait_for(task, 10)
    assert reasons == ["abort"]

    # 2. closing the iterator (what a disconnect does) aborts too
    gen = engine.generate(GenerateRequest("r2", prompt, long))
    n = 0
    async for _ in gen:
        n += 1
        if n == 3:
            break
    await gen.aclose()
    for _ in range(200):
        if engine.state().running == 0 and engine.state().kv_usage == 0:
            break
        await asyncio.sleep(0.01)
    state = engine.state()
    assert state.running == 0 and state.waiting == 0 and state.kv_usage == 0.0

    # 3. a prompt that can never fit fails at submission, before anything is queued
    with pytest.raises(ContextLengthError, match="1024"):
        async for _ in engine.generate(GenerateRequest("r3", prompt * 200, SamplingParams(max_tokens=10))):
            pass

    # 4. concurrent requests all complete with their own text
    async def one(i: int) -> str:
        text = ""
        req = GenerateRequest(f"c{i}", prompt + [i + 100], SamplingParams(temperature=0, max_tokens=8))
        async for out in engine.generate(req):
            text += out.outputs[0].text
        return text
    texts = await asyncio.gather(*(one(i) for i in range(6)))
    assert all(texts)
    assert engine.state().kv_usage == 0.0
    await engine.shutdown()
