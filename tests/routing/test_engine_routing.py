"""The middle of the path against real engine replicas (two in-process SmolLM2 engines with small
KV budgets and batches, so saturation is quick). Slow: loads the model twice."""

import asyncio
import random
import time

import pytest
import pytest_asyncio

from tokenpath.admission.controller import AdmissionConfig
from tokenpath.config import EngineConfig
from tokenpath.errors import DeadlineExceededError, InvalidRequestError, RateLimitError
from tokenpath.protocol import GenerateRequest, Submission
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.replica.pool import PoolConfig
from tokenpath.routing.models import Deployment, ModelRouter
from tokenpath.telemetry.timeline import Timeline

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
_rng = random.Random(7)
_ids = iter(range(10**9))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401  (lazy import is not thread-safe)

    from tokenpath.engine.async_engine import AsyncEngine
    from tokenpath.replica.local import InProcessReplica

    cfg = EngineConfig(num_kv_blocks=96, max_num_seqs=2, max_num_batched_tokens=512)
    engines = await asyncio.gather(*(asyncio.to_thread(AsyncEngine, cfg) for _ in range(2)))
    for e in engines:
        await e.start()
    yield [InProcessReplica(e, name=f"e{i}") for i, e in enumerate(engines)]
    for e in engines:
        await e.shutdown()


def tokens(n):
    return [_rng.randrange(1000, 40000) for _ in range(n)]


def req(prompt=None, max_tokens=4, tenant="t", deadline_s=None):
    rid = f"e2e-{next(_ids)}"
    r = GenerateRequest(rid, prompt or tokens(24), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True), tenant=tenant)
    if deadline_s is not None:
        r.deadline = time.monotonic() + deadline_s
    return Submission(r, Timeline(rid))


def dep(name, reps, inflight=1, policy="least_loaded", **adm):
    return Deployment(name, "chat", list(reps), policy=policy, admission=AdmissionConfig(**adm),
                      pool_config=PoolConfig(max_inflight=inflight))


async def drain(d, r):
    return [o async for o in d.generate(r)]


async def wait_for(cond, timeout=60.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout
        await asyncio.sleep(0.01)


async def test_aliases_and_fallback_when_saturated(replicas):
    primary = dep("primary", replicas[:1], max_queue=0)
    backup = dep("backup", replicas[1:])
    router = ModelRouter([primary, backup], aliases={"gpt-4o-mini": "primary"}, fallbacks={"primary": ["backup"]})
    with pytest.raises(InvalidRequestError):
        router.resolve("gpt-4o-mini", "embedding")
    busy = asyncio.create_task(drain(primary, req(max_tokens=24)))
    await wait_for(lambda: primary.flow.pool.inflight() == 1)
    r = req()
    outs = await drain(router.resolve("gpt-4o-mini", "chat"), r)
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 4
    assert r.timeline.attrs["deployment"] == "backup" and r.timeline.attrs["replica"] == "e1"
    assert r.timeline.attrs["fallback_from"] == "primary"
    await busy


async def test_saturated_with_full_queue_answers_429_with_retry_after_fast(replicas):
    d = dep("m", replicas[:1], max_queue=1)
    running = asyncio.create_task(drain(d, req(max_tokens=24)))
    await wait_for(lambda: d.flow.pool.inflight() == 1)
    queued = asyncio.create_task(drain(d, req()))
    await wait_for(lambda: len(d.flow.queue) == 1)
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        with pytest.raises(RateLimitError) as e:
            await drain(d, req())
        took.append(time.perf_counter() - t0)
    assert sorted(took)[2] < 0.010, took  # the median: one preemption of a shared CPU is not a failure
    assert int(e.value.headers["Retry-After"]) >= 1 and e.value.code == "queue_full"
    await asyncio.gather(running, queued)


async def test_deadline_expires_while_queued(replicas):
    d = dep("m", replicas[:1], initial_service_s=0.05)
    # Long enough to hold the only slot past the deadline, however fast the engine's kernels are.
    running = asyncio.create_task(drain(d, req(max_tokens=400)))
    await wait_for(lambda: d.flow.pool.inflight() == 1)
    with pytest.raises(DeadlineExceededError):
        await drain(d, req(deadline_s=0.3))
    assert len(d.flow.queue) == 0
    running.cancel()  # closing the stream aborts it in the engine
    await asyncio.gather(running, return_exceptions=True)


async def test_queued_client_disconnect_leaves_queue_and_never_reaches_engine(replicas):
    d = dep("m", replicas[:1])
    engine = replicas[0].engine
    first = req(max_tokens=16)
    before = engine.state().prompt_tokens
    running = asyncio.create_task(drain(d, first))
    await wait_for(lambda: d.flow.pool.inflight() == 1)
    task = asyncio.create_task(drain(d, req(prompt=tokens(40))))
    await wait_for(lambda: len(d.flow.queue) == 1)
    task.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(d.flow.queue) == 0
    await running
    await asyncio.sleep(0.2)
    assert engine.state().prompt_tokens - before == len(first.prompt_token_ids)
    assert d.flow.pool.inflight() == 0


async def test_wfq_bounds_light_tenant_latency_under_a_flood(replicas):
    d = dep("m", replicas, inflight=1, max_queue=1000)
    heavy = [asyncio.create_task(drain(d, req(max_tokens=16, tenant="heavy"))) for _ in range(30)]
    await wait_for(lambda: d.flow.pool.inflight() == 2)
    waits, behind = [], []
    for _ in range(2):
        r = req(max_tokens=4, tenant="light")
        await drain(d, r)
        waits.append(r.timeline.between("received", "dispatched"))
        behind.append(len(d.flow.queue))
    service = d.flow.capacity.service_s
    for t in heavy:
        t.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)
    # FIFO would have put each light request behind >= 20 heavy ones: >= 10 service times at 2 slots.
    assert min(behind) >= 20
    assert max(waits) < max(8.0, 3 * service), (waits, service)


async def test_prefix_aware_keeps_a_shared_prefix_on_one_replica_and_spreads_cold_prompts(replicas):
    d = dep("m", replicas, inflight=2, policy="prefix_aware")
    system = tokens(16 * 10)
    homes, cached = [], []
    for _ in range(4):
        r = req(prompt=system + tokens(8), max_tokens=2)
        outs = await drain(d, r)
        homes.append(r.timeline.attrs["replica"])
        cached.append(outs[0].num_cached_tokens)
    assert len(set(homes)) == 1
    assert all(c >= 16 * 9 for c in cached[1:]), cached
    cold = []
    for _ in range(4):
        r = req(prompt=tokens(40), max_tokens=2)
        await drain(d, r)
        cold.append((r.timeline.attrs["replica"], r.timeline.attrs["reason"]))
    assert {name for name, _ in cold} == {"e0", "e1"}
    assert all(reason == "cold" for _, reason in cold)
