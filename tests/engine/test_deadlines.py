"""The client's deadline in the engine: a request still waiting for its first schedule when its
deadline passes leaves the queue before it costs a prefill; a scheduled one is never cut.

The engine runs one sequence at a time (max_num_seqs 1), so a second request waits behind a long
one on cue. Every step's grants are recorded through the engine's own step observers: the
expired request must appear in none of them (no prefill token computed for it).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from tests.engine.tiny_models import save_tiny
from tokenpath.config import EngineConfig
from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.engine.block_manager import BlockManager
from tokenpath.engine.core import EngineCore
from tokenpath.engine.scheduler import Scheduler
from tokenpath.engine.sequence import Sequence
from tokenpath.errors import DeadlineExceededError
from tokenpath.protocol import GenerateRequest, SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny"))


def _config(tiny) -> EngineConfig:
    return EngineConfig(model=str(tiny), dtype="float32", num_kv_blocks=64, max_num_seqs=1)


def _seq(name: str, deadline: float | None) -> Sequence:
    seq = Sequence(name, 0, list(range(1, 17)), 16, SamplingParams(max_tokens=4))
    seq.deadline = deadline
    return seq


def test_the_scheduler_expires_only_never_scheduled_waiting_sequences():
    sched = Scheduler(BlockManager(64, 16), max_num_batched_tokens=256, max_num_seqs=1)
    running, waiting, patient = _seq("running", 1.0), _seq("waiting", 1.0), _seq("patient", None)
    for seq in (running, waiting, patient):
        sched.add(seq)
    assert [s.request_id for s, _ in sched.schedule().scheduled] == ["running"]
    assert sched.expired(0.5) == []  # nothing is late yet
    assert sched.expired(2.0) == ["waiting"]  # running holds its slot; patient has no deadline
    # A preempted sequence back in the queue was paid for already: never expired.
    sched.running.remove(running)
    sched.add(running)
    assert sched.expired(10.0) == []


def test_a_waiting_request_past_its_deadline_is_never_prefilled(tiny):
    core = EngineCore(_config(tiny))
    grants: list[set[str]] = []
    core.step_observers.append(lambda scheduled, start, end: grants.append({s.request_id for s, _ in scheduled}))
    prompt = core.tokenizer.encode("a b c d e f g")
    # The running request has a deadline too, already passed while it runs: it is never cut.
    core.add_request(GenerateRequest("long", prompt, LONG, deadline=time.monotonic() + 0.02))
    core.step()
    assert grants == [{"long"}]
    core.add_request(GenerateRequest("late", prompt, SHORT, deadline=time.monotonic() + 0.05))
    core.add_request(GenerateRequest("patient", prompt, SHORT))  # no deadline: waits as long as it takes
    time.sleep(0.06)
    outs = []
    while core.has_work():
        outs.extend(core.step())
    assert all("late" not in g for g in grants)  # not one of its tokens was computed
    assert [rid for rid, _ in core.rejected] == ["late"]
    error = core.rejected[0][1]
    assert isinstance(error, DeadlineExceededError) and error.code == "deadline_exceeded"
    assert error.status_code == 504 and "engine's queue" in error.message
    finished = {o.request_id: o for o in outs if o.finished}
    assert set(finished) == {"long", "patient"}
    assert len(core.requests) == 0 and core.blocks.num_free_blocks == core.blocks.num_blocks
    assert sum(1 for g in grants if "long" in g) == LONG.max_tokens  # every token of the running one


def test_a_request_one_of_whose_choices_runs_is_never_cut(tiny):
    """n=2 on one slot: the first choice runs while the second waits past the deadline. The
    request has started (tokens flow), so neither choice is dropped."""
    core = EngineCore(_config(tiny))
    prompt = core.tokenizer.encode("a b c d e f g")
    core.add_request(GenerateRequest("two", prompt, replace(SHORT, n=2), deadline=time.monotonic() + 0.02))
    outs = list(core.step())
    time.sleep(0.03)
    while core.has_work():
        outs.extend(core.step())
    assert core.rejected == []
    assert len(core.requests) == 0 and any(o.finished for o in outs)
    tokens = [0, 0]
    for o in outs:
        for c in o.outputs:
            tokens[c.index] += len(c.token_ids)  # (deltas)
    assert tokens == [4, 4]


async def test_the_async_engine_ends_it_with_the_deadline_error(tiny):
    engine = AsyncEngine(_config(tiny))
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("a b c d e f g")
        busy = asyncio.create_task(_drain(engine, GenerateRequest("busy", prompt, replace(LONG, max_tokens=400))))
        while engine.state().running == 0:
            await asyncio.sleep(0.01)
        late = GenerateRequest("late", prompt, SHORT, deadline=time.monotonic() + 0.1)
        with pytest.raises(DeadlineExceededError) as raised:
            await asyncio.wait_for(_drain(engine, late), 30)
        assert raised.value.code == "deadline_exceeded"
        assert not busy.done()  # dropped while the long one still held the engine
        assert (await busy)[-1].finished
    finally:
        await engine.shutdown()


async def _drain(engine: AsyncEngine, request: GenerateRequest) -> list:
    return [out async for out in engine.generate(request)]
