import asyncio

import pytest
from tests.simulated_replica import SimulatedConfig, SimulatedReplica

from tokenpath.admission.controller import AdmissionConfig
from tokenpath.errors import (
    DuplicateRequestIdError,
    InvalidRequestError,
    NotFoundError,
    RateLimitError,
    RequestFailedError,
    ServiceUnavailableError,
)
from tokenpath.protocol import GenerateRequest, Submission
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.replica.pool import PoolConfig
from tokenpath.routing.models import Deployment, ModelRouter
from tokenpath.telemetry.timeline import Timeline


def req(rid, max_tokens=3):
    return Submission(GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens)), Timeline(rid))


def dep(name, task="chat", n=1, seqs=2, **adm):
    reps = [SimulatedReplica(f"{name}-{i}", SimulatedConfig(max_num_seqs=seqs, token_interval_s=0.01))
            for i in range(n)]
    return Deployment(name, task, reps, admission=AdmissionConfig(**adm),
                      pool_config=PoolConfig(max_engine_waiting=0))


def test_aliases_and_tasks():
    chat, emb = dep("smollm2-135m-instruct"), dep("minilm", task="embedding", n=0)
    router = ModelRouter([chat, emb], aliases={"gpt-4o-mini": "smollm2-135m-instruct"})
    assert router.resolve("gpt-4o-mini", "chat") is chat
    assert router.resolve("smollm2-135m-instruct", "completion") is chat
    assert router.resolve("minilm", "embedding") is emb
    with pytest.raises(InvalidRequestError):
        router.resolve("minilm", "chat")  # an embedding model never reaches a chat engine
    with pytest.raises(InvalidRequestError):
        router.resolve("gpt-4o-mini", "embedding")
    with pytest.raises(NotFoundError):
        router.resolve("gpt-5", "chat")
    assert router.names() == ["smollm2-135m-instruct", "minilm"]


def test_bad_configs_are_refused():
    a, b, e = dep("a"), dep("b"), dep("e", task="embedding", n=0)
    with pytest.raises(ValueError):
        ModelRouter([a], aliases={"x": "nope"})
    with pytest.raises(ValueError):
        ModelRouter([a, e], fallbacks={"a": ["e"]})  # a fallback must do the same task
    with pytest.raises(ValueError):
        ModelRouter([a], fallbacks={"a": ["a"]})
    with pytest.raises(ValueError):
        ModelRouter([a, b], aliases={"b": "a"})


async def test_fallback_when_primary_is_down():
    primary, backup = dep("primary"), dep("backup")
    primary.replicas[0].kill()
    router = ModelRouter([primary, backup], aliases={"alias": "primary"}, fallbacks={"primary": ["backup"]})
    r = req("r1")
    outs = [o async for o in router.resolve("alias", "chat").generate(r)]
    assert outs[-1].finished
    assert r.timeline.attrs["deployment"] == "backup" and r.timeline.attrs["fallback_from"] == "primary"
    assert r.timeline.attrs["fallback_reason"] == "no_healthy_replica"
    assert backup.replicas[0].served == ["r1"]


async def test_fallback_when_primary_is_saturated_and_order_is_kept():
    primary = dep("primary", seqs=1, max_queue=0)
    second, third = dep("second"), dep("third")
    router = ModelRouter([primary, second, third], fallbacks={"primary": ["second", "third"]})
    second.replicas[0].kill()
    busy = asyncio.create_task(_drain(primary, req("busy", max_tokens=30)))
    await asyncio.sleep(0.01)
    r = req("r2")
    await _drain(router.resolve("primary", "chat"), r)
    assert r.timeline.attrs["deployment"] == "third"
    await busy


async def test_all_fallbacks_failing_raises_the_primary_error():
    primary, backup = dep("primary", seqs=1, max_queue=0), dep("backup")
    backup.replicas[0].kill()
    router = ModelRouter([primary, backup], fallbacks={"primary": ["backup"]})
    busy = asyncio.create_task(_drain(primary, req("busy", max_tokens=30)))
    await asyncio.sleep(0.01)
    with pytest.raises(RateLimitError):
        await _drain(router.resolve("primary", "chat"), req("r3"))
    await busy
    primary.replicas[0].kill()
    with pytest.raises(ServiceUnavailableError):
        await _drain(router.resolve("primary", "chat"), req("r4"))


async def _drain(deployment, r):
    return [o async for o in deployment.generate(r)]


async def test_a_request_s_own_exception_fails_it_alone_and_ejects_nothing():
    """An exception raised for one request (here the OverflowError a 2**64 value raised in the
    engine link's codec) is that request's 500 `request_failed`: not retried elsewhere, and no
    replica ejected (issue 41: 19 such requests once ejected both engines)."""
    d = dep("m", n=2)
    first, second = d.replicas
    for replica in d.replicas:
        replica.raise_for["bad"] = OverflowError("Integer value out of range")
    with pytest.raises(RequestFailedError) as err:
        _ = [o async for o in d.generate(req("bad"))]
    assert err.value.code == "request_failed" and "bad" in str(err.value)
    assert len(first.served) + len(second.served) == 1  # not retried on the other replica
    handles = d.flow.pool.handles.values()
    assert all(h.ejected_until == 0.0 and h.failures == 0 for h in handles)
    for i in range(4):  # both replicas keep serving
        outs = [o async for o in d.generate(req(f"ok{i}"))]
        assert outs[-1].finished
    assert all(h.ejected_until == 0.0 and h.failures == 0 for h in handles)
    assert len(first.served) + len(second.served) == 5


async def test_a_refused_duplicate_id_aborts_nothing_it_did_not_start():
    """A replica that refuses an id already running took nothing on: the deployment must not follow
    the refusal with `abort(id)`, which would stop the request holding the id (issue 41; the
    gateway mints unique ids, so this is defense in depth)."""
    d = dep("m", seqs=2)
    replica = d.replicas[0]
    holder = asyncio.create_task(_drain(d, req("same", max_tokens=30)))
    while "same" not in replica.running:
        await asyncio.sleep(0.005)
    with pytest.raises(DuplicateRequestIdError):
        await _drain(d, req("same", max_tokens=3))
    outs = await holder
    assert len(outs) == 30 and outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
