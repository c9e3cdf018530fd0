"""AsyncEngine: deltas stream off the event loop; abort (explicit, or by closing the iterator)
removes the request before the next step and frees its blocks."""

from __future__ import annotations

import asyncio
import json

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


# Most of a second or more to compile (the API caps an enum at 500 entries; an engine takes any).
# Two enums of 1,900 objects: ~0.85 s to compile on a quiet 2-core AVX2 host, 239k characters (the
# cap is 256 Ki). One enum took 0.37 s there, too little to tell a stalled step loop from a busy one
# (llguidance refuses rows over 2,000 items); the test's own check says when a machine compiles it
# too fast to test anything, rather than pass.
BOMB = json.dumps({"type": "object", "required": ["p0", "p1"], "properties": {
    f"p{k}": {"enum": [{"id": i, "name": f"item number {i}", "tags": [i, i + 1]} for i in range(k * 1900, k * 1900 + 1900)]}
    for k in range(2)}})


async def test_a_grammar_compile_never_stalls_the_step_loop(tiny):
    """A grammar the engine has not compiled yet (an engine process: the gateway compiled it in its
    own cache) is compiled on a worker thread, and the request queued when it is ready: the other
    streams keep stepping meanwhile (issue 41: one compile stalled every stream for seconds)."""
    from tokenpath.protocol.sampling_params import StructuredOutput

    engine = AsyncEngine(model=str(tiny), dtype="float32", num_kv_blocks=64)
    await engine.start()
    engine.tokenizer.grammars  # noqa: B018 - the vocabulary read once, as a warm engine has it
    prompt = engine.tokenizer.encode("a b c d e f g")
    times: list[float] = []
    loop = asyncio.get_running_loop()

    async def stream() -> None:
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        async for _ in engine.generate(GenerateRequest("steady", prompt, params)):
            times.append(loop.time())

    steady = asyncio.create_task(stream())
    while len(times) < 5 and not steady.done():
        await asyncio.sleep(0.01)
    t0 = loop.time()
    bomb = SamplingParams(temperature=0, max_tokens=2, structured=StructuredOutput("json", BOMB))
    outs = [o async for o in engine.generate(GenerateRequest("bomb", prompt, bomb))]
    took = loop.time() - t0
    during = [t for t in times if t >= t0]
    gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
    steady.cancel()
    await asyncio.gather(steady, return_exceptions=True)
    await engine.shutdown()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    before = sorted(b - a for a, b in zip(times, times[1:], strict=False) if b < t0)
    step = before[len(before) // 2]
    assert took > 0.3 and took > 10 * step, f"the compile took only {took:.2f} s (a step {step:.3f} s): not a test"
    assert len(during) > 5 and max(gaps) < took / 2, (took, max(gaps), len(during))
