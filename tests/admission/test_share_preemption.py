"""Preemption for the tenant share (admission/preempt.py, issue 41): whom admission pauses, and
that the engine gives the paused request's running slot to the request that took it.

The victim rule and `SlotShare.over` are pure (explicit numbers); the controller's use of them
runs on simulated replicas that say they can pause a request; the engine's side is the
scheduler's `displace` on its own. The whole path, with real streams resuming token for token, is
tests/reliability/test_share_preemption.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from tests.admission.test_flow_control import deployment, req, run
from tests.admission.test_slot_share import share, until
from tests.simulated_replica import SimulatedReplica

from tokenpath.admission import preempt
from tokenpath.engine.block_manager import BlockManager
from tokenpath.engine.scheduler import Scheduler
from tokenpath.engine.sequence import Sequence, Status
from tokenpath.protocol import GenerateRequest, ReplicaState
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.protocol.wire import decode_request, encode_request


@dataclass
class Held:
    request_id: str
    tenant: str
    priority: int = 0
    dispatched_at: float = 0.0
    first_token_seen: bool = True
    preemptible: bool = True
    paused_by: str | None = None
    paused_at: float = 0.0
    replica: str = "r0"


def test_the_victim_is_the_over_share_tenants_lowest_priority_then_latest_running_request():
    held = [Held("a-old", "a", dispatched_at=1.0), Held("a-new", "a", dispatched_at=3.0),
            Held("a-urgent-newest", "a", priority=-5, dispatched_at=4.0), Held("b-1", "b", dispatched_at=5.0)]
    assert preempt.choose_victim(held, {"a": 2.0}, {"r0"}).request_id == "a-new"
    held.append(Held("a-batch", "a", priority=7, dispatched_at=0.5))  # lower priority beats recency
    assert preempt.choose_victim(held, {"a": 2.0}, {"r0"}).request_id == "a-batch"
    # The tenant furthest over its share goes first, whatever its requests' priorities.
    held.append(Held("c-1", "c", priority=-9, dispatched_at=0.1))
    assert preempt.choose_victim(held, {"a": 1.0, "c": 3.0}, {"r0"}).request_id == "c-1"


def test_no_victim_among_requests_not_running_paused_already_embeddings_or_on_a_replica_that_cannot():
    over, replicas = {"a": 3.0}, {"r0"}
    assert preempt.choose_victim([Held("queued-in-engine", "a", first_token_seen=False)], over, replicas) is None
    assert preempt.choose_victim([Held("paused", "a", paused_by="b-1")], over, replicas) is None
    assert preempt.choose_victim([Held("embedding", "a", preemptible=False)], over, replicas) is None
    assert preempt.choose_victim([Held("on-vllm", "a", replica="url")], over, replicas) is None
    assert preempt.choose_victim([Held("b-1", "b")], over, replicas) is None  # b is not over its share
    assert preempt.paused([Held("x", "a", paused_by="y"), Held("z", "a")]) == {"a": 1}


def test_over_names_tenants_a_whole_slot_past_their_share_counting_paused_ones_as_not_running():
    s = share()
    for _ in range(4):
        s.take("a", queued=0, now=0.0)
    assert s.over(lambda: 4, {}, now=0.0) == {}  # alone: every slot is a's
    assert s.over(lambda: 4, {}, now=0.0, asking="b") == {"a": 1.0}  # b asks for one: a's share is 3
    assert s.over(lambda: 4, {"b": 3}, now=0.0) == {"a": 2.0}
    assert s.over(lambda: 4, {"b": 3}, now=0.0, paused={"a": 2}) == {}  # two paused: a runs its share
    s.take("b", queued=0, now=0.0)
    assert s.over(lambda: 5, {"b": 2}, now=0.0) == {"a": 1.5}  # shares 2.5 each
    assert s.over(lambda: 5, {"b": 2}, now=0.0, paused={"a": 1}) == {}  # half a slot over: no change of hands


def test_preempts_crosses_the_engine_link():
    r = GenerateRequest("b-1", [1, 2, 3], SamplingParams(max_tokens=4), tenant="b", preempts="a-1")
    assert decode_request(encode_request(r)).preempts == "a-1"
    assert decode_request(encode_request(replace(r, preempts=None))).preempts is None


def _seq(name: str, arrival: float, prompt: int = 16, tenant: str = "a") -> Sequence:
    start = int(arrival * 1000) + 1
    return Sequence(name, 0, list(range(start, start + prompt)), prompt, SamplingParams(max_tokens=64),
                    tenant=tenant, arrival_time=arrival)


def test_the_engine_pauses_the_victim_and_runs_the_taker_in_its_slot_ahead_of_the_queue():
    sched = Scheduler(BlockManager(256, 16), max_num_batched_tokens=512, max_num_seqs=2)
    a1, a2, a3 = _seq("a1", 0.0), _seq("a2", 1.0), _seq("a3", 2.0)
    for s in (a1, a2, a3):
        sched.add(s)
    for seq, n in sched.schedule().scheduled:  # a1 and a2 run, a3 waits in the engine's queue
        seq.num_computed_tokens += n
        seq.token_ids.append(7)  # (a sampled token)
    b = _seq("b1", 3.0, tenant="b")
    sched.add(b)
    assert sched.displace([a2], [b]) == 1
    assert a2.status is Status.WAITING and not a2.block_table and a2.num_preemptions == 1
    assert a2.events.preempted[0][1] == "b1" and a2.events.preempted[0][2] == 16
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["a1", "b1"]  # b ahead of a3, a2
    assert b.displaces is None and [s.request_id for s in sched.waiting] == ["a2", "a3"]
    sched.remove(a1)  # the next slot to free goes to the paused one, before a3
    assert [s.request_id for s, _ in sched.schedule().scheduled if s.request_id != "b1"] == ["a2"]
    assert sched.blocks.check_consistency() == []


def test_a_victim_not_running_frees_nothing_and_the_taker_still_goes_first():
    sched = Scheduler(BlockManager(256, 16), max_num_batched_tokens=512, max_num_seqs=1)
    a1, a2 = _seq("a1", 0.0), _seq("a2", 1.0)
    sched.add(a1)
    sched.add(a2)
    sched.schedule()
    b = _seq("b1", 2.0, tenant="b")
    sched.add(b)
    assert sched.displace([a2], [b]) == 0 and a2.num_preemptions == 0
    assert [s.request_id for s in sched.waiting] == ["b1", "a2"]


def test_a_kv_preemption_takes_the_slot_the_share_handed_over_last():
    """The pool runs out of blocks: the latest arrival would go, and that is the request that
    just took its slot from the tenant over its share. Its blocks would go straight back to that
    tenant (the slow-reader flood in a 64 MiB pool: B's request, preempted again and again)."""
    sched = Scheduler(BlockManager(6, 16), max_num_batched_tokens=512, max_num_seqs=3)
    a1, a2, a3 = _seq("a1", 0.0, prompt=24), _seq("a2", 1.0, prompt=24), _seq("a3", 2.0, prompt=16)
    b = _seq("b1", 3.0, prompt=16, tenant="b")
    for s in (a1, a2, a3):
        sched.add(s)
    for step in range(2):
        out = sched.schedule()
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            seq.token_ids.append(7)  # (its sampled token)
        if step == 0:  # 5 of the 6 blocks held; b takes a3's slot (and its block)
            sched.add(b)
            assert sched.displace([a3], [b]) == 1
    assert [s.request_id for s, _ in out.scheduled] == ["a1", "a2", "b1"] and b.share_slot
    for seq in (a1, a2):  # both grow into a third block: one block short
        seq.token_ids.extend([7] * 8)
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["a2"]  # not b1, the latest arrival
    assert b.status is Status.RUNNING and a2.events.preempted[-1][1] == "a1"


class PausingReplica(SimulatedReplica):
    """A simulated replica that says it can pause a request (as tokenpath's engines do); it
    does not, so a taker waits in its queue: what is checked here is admission's decision."""

    def state(self) -> ReplicaState:
        return replace(super().state(), can_preempt=True)


def pausing_deployment(**admission):
    dep, reps = deployment(seqs=2, interval=0.01, max_queue=100, **admission)
    handle = next(iter(dep.flow.pool.handles.values()))
    handle.replica = PausingReplica("r0", reps[0].config)
    return dep


async def test_a_request_under_its_share_takes_the_slot_of_the_over_share_tenants_latest_request():
    dep = pausing_deployment()
    flood = [req(tenant="a", max_tokens=100_000) for _ in range(4)]
    tasks = [asyncio.create_task(run(dep, r)) for r in flood]
    b = req(tenant="b", max_tokens=2)
    try:
        running = flood[:2]
        await until(lambda: all(r.timeline.get("first_token") for r in running))
        b_task = asyncio.create_task(run(dep, b))
        await until(lambda: b.timeline.get("dispatched") is not None)
        taken = b.timeline.attrs["admission_preempted"]
        assert taken == {"request_id": running[1].request_id, "tenant": "a", "replica": "r0"}
        assert b.request.preempts == running[1].request_id  # what the engine acts on
        assert "admission_freed_by" not in b.timeline.attrs  # no request of a's ended for it
        paused = running[1].timeline.attrs["admission_paused"]
        assert paused == [{"by": b.request_id, "tenant": "b", "replica": "r0"}]
        assert dep.flow.share.held == {"a": 2, "b": 1} and len(dep.flow.queue) == 2
        b_task.cancel()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_preemption_off_or_the_share_off_leaves_the_request_waiting():
    for off in ({"tenant_preempt": False}, {"tenant_share": False}):
        dep = pausing_deployment(**off)
        flood = [req(tenant="a", max_tokens=100_000) for _ in range(4)]
        tasks = [asyncio.create_task(run(dep, r)) for r in flood]
        b = req(tenant="b", max_tokens=2)
        try:
            running = flood[:2]
            await until(lambda: all(r.timeline.get("first_token") for r in running))  # noqa: B023 (awaited here)
            tasks.append(asyncio.create_task(run(dep, b)))
            await asyncio.sleep(0.2)
            assert b.timeline.get("dispatched") is None and "admission_preempted" not in b.timeline.attrs
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
