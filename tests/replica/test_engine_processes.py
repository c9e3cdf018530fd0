"""Replicas as real `tokenpath engine` processes on the engine link: started the way `serve
--replicas 2` starts them, and a replica killed with SIGKILL mid-stream. Slow: starts two engine
processes."""

import asyncio
import os
import random
from pathlib import Path

import pytest
import pytest_asyncio

from tokenpath.config import EngineConfig
from tokenpath.errors import ServiceUnavailableError
from tokenpath.protocol import GenerateRequest, Submission
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.replica.processes import ENGINE_NICE
from tokenpath.routing.models import Deployment
from tokenpath.server.config import ServerConfig
from tokenpath.server.routing_config import serve_router
from tokenpath.telemetry.timeline import Timeline

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
_rng = random.Random(3)
_ids = iter(range(10**9))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tmp_path_factory):
    """Two engine processes, started the way `tokenpath serve --replicas 2` starts them."""
    config = ServerConfig(models=["smollm2-135m-instruct"], data_dir=str(tmp_path_factory.mktemp("data")),
                          engine=EngineConfig(num_kv_blocks=96, max_num_seqs=2))
    router, closers = await serve_router(config, replicas=2)
    dep = router.resolve("smollm2-135m-instruct", "chat")
    assert [p.args[p.args.index("--num-kv-blocks") + 1] for p in dep.processes] == ["96", "96"]
    assert all(r.state().max_num_seqs == 2 and r.state().healthy for r in dep.replicas)
    # Block size and pool size come from the engine over the link.
    assert all((r.state().block_size, r.state().num_blocks) == (16, 96) for r in dep.replicas)
    # Engines yield the CPU to the gateway: every one of their threads runs at a higher nice value.
    gateway_nice = os.getpriority(os.PRIO_PROCESS, 0)
    for p in dep.processes:
        threads = Path(f"/proc/{p.proc.pid}/task").iterdir()
        assert {int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in threads} == \
            {gateway_nice + ENGINE_NICE}
    yield dep.replicas, dep.processes
    for c in closers:
        await c()
    assert all(p.proc.returncode is not None for p in dep.processes)


def req(max_tokens=4):
    rid = f"proc-{next(_ids)}"
    ids = [_rng.randrange(1000, 40000) for _ in range(30)]
    return Submission(GenerateRequest(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True)), Timeline(rid))


async def drain(d, r):
    return [o async for o in d.generate(r)]


async def test_killed_replica_is_ejected_in_flight_fail_cleanly_new_ones_served_elsewhere(engines):
    replicas, procs = engines
    d = Deployment("smollm2-135m-instruct", "chat", list(replicas), policy="round_robin")
    streams = [d.generate(req(max_tokens=60)) for _ in range(2)]
    firsts = [await s.__anext__() for s in streams]
    assert all(not f.finished for f in firsts)
    on = {r: d.flow.pool.handles[r].inflight for r in ("engine-0", "engine-1")}
    assert on == {"engine-0": 1, "engine-1": 1}
    procs[0].kill()

    async def finish(s):
        try:
            async for _ in s:
                pass
            return "ok"
        except ServiceUnavailableError:
            return "failed"

    # Immediately after the kill, before any poll notices: new requests still succeed (a failure
    # before the first token is retried once on the other replica).
    fresh = [req() for _ in range(3)]
    results = await asyncio.gather(*(drain(d, r) for r in fresh))
    assert all(o[-1].finished for o in results)
    assert all(r.timeline.attrs["replica"] == "engine-1" for r in fresh)
    # Of the two in-flight streams, the one on the killed replica fails with a clean 503.
    assert sorted(await asyncio.gather(*(finish(s) for s in streams))) == ["failed", "ok"]
    assert not d.flow.pool.handles["engine-0"].state().healthy
    assert d.flow.pool.inflight() == 0
    more = req()
    await drain(d, more)
    assert more.timeline.attrs["replica"] == "engine-1"
