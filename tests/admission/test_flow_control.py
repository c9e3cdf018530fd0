"""Admission, queueing and dispatch through `Deployment.generate`, on simulated replicas."""

import asyncio
import time

import pytest
from tests.simulated_replica import SimulatedConfig, SimulatedReplica

from tokenpath.admission.controller import AdmissionConfig
from tokenpath.errors import DeadlineExceededError, RateLimitError, ServiceUnavailableError
from tokenpath.protocol import GenerateRequest, Submission
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.replica.pool import PoolConfig
from tokenpath.routing.models import Deployment
from tokenpath.telemetry.timeline import Timeline

_ids = iter(range(10**9))


def req(tokens=(1, 2, 3), max_tokens=4, tenant="anonymous", priority=0, deadline_s=None):
    rid = f"req-{next(_ids)}"
    r = GenerateRequest(rid, list(tokens), SamplingParams(max_tokens=max_tokens), priority=priority, tenant=tenant)
    if deadline_s is not None:
        r.deadline = time.monotonic() + deadline_s
    return Submission(r, Timeline(rid))


def deployment(n=1, seqs=2, interval=0.01, policy="least_loaded", engine_waiting=0, **admission):
    reps = [SimulatedReplica(f"r{i}", SimulatedConfig(max_num_seqs=seqs, token_interval_s=interval))
            for i in range(n)]
    dep = Deployment("m", "chat", reps, policy=policy, admission=AdmissionConfig(**admission),
                     pool_config=PoolConfig(eject_base_s=0.2, max_engine_waiting=engine_waiting))
    return dep, reps


async def run(dep, r):
    return [o async for o in dep.generate(r)]


async def test_immediate_admission_stamps_every_decision():
    dep, _ = deployment()
    r = req()
    outs = await run(dep, r)
    assert outs[-1].finished and len(outs) == 4
    for stage in ("routed", "admitted", "dequeued", "dispatched"):
        assert r.timeline.get(stage) is not None
    a = r.timeline.attrs
    assert a["deployment"] == "m" and a["replica"] == "r0" and a["admission"] == "immediate"
    assert a["policy"] == "least_loaded" and a["reason"]


async def test_queued_requests_wait_in_gateway_not_in_engine():
    dep, (rep,) = deployment(seqs=2, interval=0.02, engine_waiting=2)
    peak_engine_waiting = 0

    async def watch():
        nonlocal peak_engine_waiting
        while True:
            peak_engine_waiting = max(peak_engine_waiting, rep.state().waiting)
            await asyncio.sleep(0.005)

    w = asyncio.create_task(watch())
    rs = [req() for _ in range(8)]  # 2 run, 2 wait in the engine, 4 wait in the gateway
    results = await asyncio.gather(*(run(dep, r) for r in rs))
    w.cancel()
    assert all(o[-1].finished for o in results)
    assert peak_engine_waiting <= dep.pool_config.max_engine_waiting
    assert sum(r.timeline.attrs["admission"] == "queued" for r in rs) == 8 - 2 - 2


async def test_full_queue_rejects_at_once_with_retry_after():
    dep, _ = deployment(seqs=1, interval=0.05, max_queue=2)
    running = [asyncio.create_task(run(dep, req(max_tokens=20))) for _ in range(3)]
    await asyncio.sleep(0.02)
    assert len(dep.flow.queue) == 2
    with pytest.raises(RateLimitError) as e:
        await run(dep, req())  # how fast: benchmarks/overload.py
    assert e.value.code == "queue_full"
    assert int(e.value.headers["Retry-After"]) >= 1 and e.value.retry_after > 0
    await asyncio.gather(*running)


async def test_retry_after_follows_predicted_drain():
    dep, _ = deployment(seqs=1, interval=0.05, max_queue=4, initial_service_s=3.0)
    running = [asyncio.create_task(run(dep, req(max_tokens=40))) for _ in range(5)]
    await asyncio.sleep(0.02)
    with pytest.raises(RateLimitError) as e:
        await run(dep, req())
    # 4 queued + this one over 1 slot at ~3 s per request.
    assert 10 <= e.value.retry_after <= 20
    for t in running:
        t.cancel()
    await asyncio.gather(*running, return_exceptions=True)


async def test_precheck_refuses_without_a_prompt_and_counts_once():
    from tokenpath.telemetry import series as metrics

    dep, _ = deployment(seqs=1, interval=0.05, max_queue=1)
    running = [asyncio.create_task(run(dep, req(max_tokens=20))) for _ in range(2)]
    await asyncio.sleep(0.02)
    def rejections() -> float:
        return metrics.REGISTRY.get_sample_value("tokenpath:admission_rejections_total",
                                                 {"deployment": "m", "reason": "queue_full"}) or 0.0

    before = rejections()
    with pytest.raises(RateLimitError) as e:
        dep.precheck(priority=0, tenant="t", received=time.monotonic())
    assert e.value.code == "queue_full" and int(e.value.headers["Retry-After"]) >= 1
    assert rejections() == before + 1
    assert len(dep.flow.queue) == 1  # a check, not a queue entry
    await asyncio.gather(*running)
    dep.precheck(priority=0, tenant="t", received=time.monotonic())  # room again: passes


async def test_precheck_passes_when_a_fallback_has_room():
    dep, _ = deployment(seqs=1, interval=0.05, max_queue=0)
    spare, _ = deployment(seqs=1)
    spare.name = "spare"
    dep.fallbacks = [spare]
    running = asyncio.create_task(run(dep, req(max_tokens=20)))
    await asyncio.sleep(0.02)
    dep.precheck(priority=0, tenant="t", received=time.monotonic())
    with pytest.raises(RateLimitError):
        dep.flow.check(0, "t", time.monotonic() + 60)
    await running


async def test_precheck_uses_the_clients_deadline():
    dep, _ = deployment(seqs=1, interval=0.05, initial_service_s=5.0)
    first = asyncio.create_task(run(dep, req(max_tokens=10)))
    await asyncio.sleep(0.01)
    dep.precheck(priority=0, tenant="t", received=time.monotonic())  # default budget: 120 s
    with pytest.raises(RateLimitError) as e:
        dep.precheck(priority=0, tenant="t", received=time.monotonic(), deadline=time.monotonic() + 1.0)
    assert e.value.code == "deadline_unreachable"
    await first


async def test_unreachable_deadline_is_rejected_up_front():
    dep, _ = deployment(seqs=1, interval=0.05, initial_service_s=5.0)
    first = asyncio.create_task(run(dep, req(max_tokens=10)))
    await asyncio.sleep(0.01)
    with pytest.raises(RateLimitError) as e:
        await run(dep, req(deadline_s=1.0))
    assert e.value.code == "deadline_unreachable"
    await first


async def test_deadline_expires_in_queue_and_leaves_it():
    dep, _ = deployment(seqs=1, interval=0.05, initial_service_s=0.01)
    first = asyncio.create_task(run(dep, req(max_tokens=10)))
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        await run(dep, req(deadline_s=0.15))
    assert time.monotonic() - t0 < 0.4
    assert len(dep.flow.queue) == 0
    await first


async def test_disconnect_while_queued_leaves_the_queue_at_once():
    dep, (rep,) = deployment(seqs=1, interval=0.05)
    first = asyncio.create_task(run(dep, req(max_tokens=10)))
    await asyncio.sleep(0.01)
    queued = req()
    task = asyncio.create_task(run(dep, queued))
    await asyncio.sleep(0.01)
    assert len(dep.flow.queue) == 1
    task.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(dep.flow.queue) == 0
    await first
    assert queued.request_id not in rep.served
    assert dep.flow.pool.inflight() == 0


async def test_closing_the_stream_aborts_in_the_replica():
    dep, (rep,) = deployment(seqs=2, interval=0.02)
    gen = dep.generate(req(max_tokens=100))
    await gen.__anext__()
    assert rep.state().running == 1
    await gen.aclose()
    await asyncio.sleep(0.05)
    assert rep.state().running == 0 and dep.flow.pool.inflight() == 0


async def test_closing_the_stream_releases_its_slot_before_aclose_returns():
    """One generator from the replica's stream to the caller: its close runs the abort and the
    release itself (a forwarding layer left them to the inner generator's finalizer, a task later)."""
    dep, (rep,) = deployment(seqs=2, interval=0.02)
    gen = dep.generate(req(max_tokens=100))
    await gen.__anext__()
    assert dep.flow.pool.inflight() == 1
    await gen.aclose()
    assert dep.flow.pool.inflight() == 0 and rep.state().running == 0


async def test_no_healthy_replica_is_503():
    dep, (rep,) = deployment()
    rep.kill()
    with pytest.raises(ServiceUnavailableError) as e:
        await run(dep, req())
    assert "Retry-After" in e.value.headers


async def test_light_tenant_latency_stays_bounded_while_heavy_floods():
    dep, _ = deployment(seqs=2, interval=0.01, max_queue=500)
    heavy = [asyncio.create_task(run(dep, req(tenant="heavy", max_tokens=10))) for _ in range(120)]
    await asyncio.sleep(0.05)
    waits = []
    for _ in range(5):
        r = req(tenant="light", max_tokens=10)
        await run(dep, r)
        waits.append(r.timeline.between("received", "dispatched"))
        await asyncio.sleep(0.02)
    assert len(dep.flow.queue) > 50  # the flood is still queued
    # FIFO would put each light request behind ~100 heavy ones (~0.5 s per 100 at 2 slots x 0.1 s).
    assert max(waits) < 0.3, waits
    for t in heavy:
        t.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)


async def test_priority_band_leaves_first():
    dep, (rep,) = deployment(seqs=1, interval=0.01)
    first = asyncio.create_task(run(dep, req(max_tokens=5)))
    await asyncio.sleep(0.005)
    low = [req(priority=1) for _ in range(3)]
    tasks = [asyncio.create_task(run(dep, r)) for r in low]
    await asyncio.sleep(0.005)
    high = req(priority=0)
    tasks.append(asyncio.create_task(run(dep, high)))
    await asyncio.gather(first, *tasks)
    assert rep.served.index(high.request_id) < min(rep.served.index(r.request_id) for r in low)


async def test_failure_before_first_token_retries_once_elsewhere_and_ejects():
    dep, (a, b) = deployment(n=2, seqs=2, policy="round_robin")
    a.fail_before_first = 1
    b.fail_before_first = 0
    r = req()
    outs = await run(dep, r)
    assert outs[-1].finished
    assert r.timeline.attrs["retried_after"] == "r0" and r.timeline.attrs["replica"] == "r1"
    assert not dep.flow.pool.handles["r0"].state().healthy  # ejected
    await asyncio.sleep(0.25)  # backoff over, state healthy: probed back in
    assert dep.flow.pool.handles["r0"].state().healthy


async def test_retry_happens_only_once():
    dep, (a, b) = deployment(n=2, seqs=2, policy="round_robin")
    a.fail_before_first = b.fail_before_first = 1
    with pytest.raises(ServiceUnavailableError):
        await run(dep, req())
    assert dep.flow.pool.inflight() == 0


async def test_killed_replica_fails_in_flight_cleanly_and_new_requests_go_elsewhere():
    dep, (a, b) = deployment(n=2, seqs=4, interval=0.02, policy="round_robin")
    streams = [dep.generate(req(max_tokens=50)) for _ in range(4)]
    for s in streams:
        await s.__anext__()
    a.kill()
    failed = 0
    for s in streams:
        try:
            async for _ in s:
                pass
        except ServiceUnavailableError:
            failed += 1
    assert failed == 2
    for _ in range(4):
        r = req()
        assert (await run(dep, r))[-1].finished
        assert r.timeline.attrs["replica"] == "r1"
    assert dep.flow.pool.inflight() == 0


async def test_a_busy_replica_is_retried_elsewhere_but_not_ejected():
    dep, (a, b) = deployment(n=2, seqs=2, policy="round_robin")
    a.busy_next = 1
    r = req()
    assert (await run(dep, r))[-1].finished
    assert r.timeline.attrs["retry_reason"] == "busy" and r.timeline.attrs["replica"] == "r1"
    assert dep.flow.pool.handles["r0"].state().healthy


async def test_prefill_backlog_counts_dispatched_prompts_until_their_first_token():
    dep, (rep,) = deployment(seqs=1, interval=0.05, engine_waiting=2)
    handle = dep.flow.pool.handles["r0"]
    first = asyncio.create_task(run(dep, req(tokens=range(40), max_tokens=10)))
    await asyncio.sleep(0.15)  # running: its first token (after 0.05 s) is out
    assert handle.pending_prefill == 0
    second = asyncio.create_task(run(dep, req(tokens=range(100, 130), max_tokens=2)))
    await asyncio.sleep(0.02)  # waiting in the engine behind the first
    assert handle.pending_prefill == 30
    assert dep.flow.pool.states()[0].pending_prefill_tokens == 30  # what the picker sees
    await asyncio.gather(first, second)
    assert handle.pending_prefill == 0 and handle.inflight == 0


async def test_a_timeout_shorter_than_the_recent_first_token_time_is_refused_up_front():
    """Issue 10, defect 10: with room on a replica but first tokens taking ~0.3 s after dispatch,
    a request whose `timeout` is 0.1 s gets 429 at once, not a 504 after waiting it out. Before
    the fix the check counted only the gateway queue's wait, so this request was admitted."""
    dep, _ = deployment(seqs=4, interval=0.3)
    for _ in range(3):  # learn the dispatch -> first token time
        await run(dep, req(max_tokens=1))
    assert dep.flow.capacity.first_token_s >= 0.25
    with pytest.raises(RateLimitError) as e:
        dep.precheck(priority=0, tenant="t", received=time.monotonic(), deadline=time.monotonic() + 0.1)
    assert e.value.code == "deadline_unreachable"
    with pytest.raises(RateLimitError) as e:
        await run(dep, req(deadline_s=0.1))
    assert e.value.code == "deadline_unreachable" and "first token" in e.value.message
    assert len(await run(dep, req(max_tokens=1, deadline_s=5.0))) >= 1  # a timeout that fits is served


async def test_another_tenants_backlog_does_not_make_a_light_tenants_deadline_unreachable():
    """The predicted wait counts what the fair queue puts ahead of *this* tenant's request: tenant
    a's backlog of 20 (5 s of service each, one slot: ~100 s) refuses a's next request with a 60 s
    deadline, while b's, which the queue would dispatch next, passes."""
    dep, _ = deployment(seqs=1, interval=0.05, initial_service_s=5.0)
    tasks = [asyncio.create_task(run(dep, req(max_tokens=10, tenant="a"))) for _ in range(21)]
    await asyncio.sleep(0.02)
    assert len(dep.flow.queue) == 20
    deadline = time.monotonic() + 60
    with pytest.raises(RateLimitError) as e:
        dep.flow.check(0, "a", deadline, record=False)
    assert e.value.code == "deadline_unreachable"
    dep.flow.check(0, "b", deadline, record=False)  # passes: nothing of a's is tagged before it
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_each_replica_state_is_read_once_per_decision(monkeypatch):
    """The precheck reads each replica's state once, and admission once more (it read them five
    times between them: healthy and room passes in each check, then the room list; issue 37)."""
    dep, reps = deployment(n=2, seqs=4)
    reads = {r.name: 0 for r in reps}
    for r in reps:
        real = r.state

        def counted(real=real, name=r.name):
            reads[name] += 1
            return real()

        monkeypatch.setattr(r, "state", counted)
    dep.precheck(priority=0, tenant="t", received=time.monotonic())
    assert reads == {"r0": 1, "r1": 1}
    r = req()
    await dep._admit(r)
    assert reads == {"r0": 2, "r1": 2}
    assert r.timeline.attrs["admission"] == "immediate"


async def test_a_pool_view_keeps_the_room_rule():
    """`PoolView.room` is `with_room`'s answer and `healthy` is `healthy()`'s, from one read."""
    dep, (full, free) = deployment(n=2, seqs=1)
    await dep._admit(req())  # one of the two is now full (one running slot each)
    view = dep.flow.pool.view()
    assert [s.name for s in view.room] == [s.name for s in dep.flow.pool.with_room()]
    assert len(view.room) == 1
    assert [s.name for s in view.healthy] == [s.name for s in dep.flow.pool.healthy()] == ["r0", "r1"]
