import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.simulated_replica import SimulatedConfig, SimulatedReplica

from tokenpath.admission.capacity import CapacityEstimator
from tokenpath.admission.controller import AdmissionConfig
from tokenpath.errors import RateLimitError
from tokenpath.protocol import GenerateRequest, ReplicaState, Submission
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.replica.pool import PoolConfig, ReplicaHandle
from tokenpath.routing.models import Deployment
from tokenpath.telemetry import series as metrics
from tokenpath.telemetry.timeline import Timeline


def test_capacity_estimator_learns_service_time_and_predicts_wait():
    c = CapacityEstimator(initial_service_s=2.0, alpha=0.5, window_s=10.0)
    assert c.predicted_wait(ahead=4, slots=2) == pytest.approx(4.0)  # 4 requests / (2 slots / 2 s)
    c.observe(1.0, now=100.0)
    c.observe(1.0, now=101.0)
    assert c.service_s == pytest.approx(1.25)
    assert c.throughput(now=101.0) == pytest.approx(0.2)
    assert c.throughput(now=200.0) == 0.0  # the window forgets


def test_cautious_wait_grows_with_the_swing_of_service_times():
    """A client's timeout is checked against mean + 2 deviations of the service time: with steady
    service times it is the plain prediction, with swinging ones it is longer."""
    steady = CapacityEstimator(initial_service_s=2.0, alpha=0.5)
    for t in range(6):
        steady.observe(2.0, now=float(t))
    assert steady.cautious_wait(ahead=4, slots=2) == pytest.approx(steady.predicted_wait(ahead=4, slots=2))
    swinging = CapacityEstimator(initial_service_s=2.0, alpha=0.5)
    for t, s in enumerate([1.0, 3.0, 1.0, 3.0, 1.0, 3.0]):
        swinging.observe(s, now=float(t))
    assert swinging.service_dev > 0.5
    assert swinging.cautious_wait(ahead=4, slots=2) > swinging.predicted_wait(ahead=4, slots=2) * 1.5


class StaticReplica:
    def __init__(self, state: ReplicaState) -> None:
        self.name = state.name
        self._state = state

    def state(self) -> ReplicaState:
        return self._state

    async def abort(self, request_id: str) -> None: ...

    def generate(self, submission):  # pragma: no cover - not used here
        raise NotImplementedError


def test_room_counts_gateway_inflight_engine_queue_and_kv():
    h = ReplicaHandle(StaticReplica(ReplicaState("a", max_num_seqs=2)), PoolConfig(max_engine_waiting=1))
    assert h.limit(h.state()) == 3
    h.inflight = 3
    assert not h.has_room(h.state())
    h.inflight = 0
    busy = ReplicaHandle(StaticReplica(ReplicaState("b", waiting=2, max_num_seqs=2)), PoolConfig(max_engine_waiting=1))
    assert not busy.has_room(busy.state())  # someone else filled its engine queue
    full = ReplicaHandle(StaticReplica(ReplicaState("c", kv_usage=0.99)), PoolConfig())
    assert not full.has_room(full.state())


def test_preempted_requests_back_in_the_engine_queue_leave_room_for_new_ones():
    """Issue 41: a flooding tenant's KV-preempted requests wait in the engine's queue (they are in
    flight already, `limit` counts them). Counted as queue, they shut every tenant out at the
    gateway, and the other tenant's request waited there instead of in the engine."""
    state = ReplicaState("a", waiting=3, waiting_preempted=3, running=2, max_num_seqs=8)
    h = ReplicaHandle(StaticReplica(state), PoolConfig(max_engine_waiting=1))
    h.inflight = 5
    assert h.has_room(h.state())
    h.inflight = 9
    assert not h.has_room(h.state())  # (the in-flight limit, 8 + 1, still holds)
    fresh = ReplicaHandle(StaticReplica(ReplicaState("b", waiting=3, waiting_preempted=1, max_num_seqs=4)),
                          PoolConfig(max_engine_waiting=1))
    assert not fresh.has_room(fresh.state())  # two new ones queued: over the engine-queue bound


def test_ejection_backoff_doubles_and_probe_needs_health():
    rep = StaticReplica(ReplicaState("a"))
    h = ReplicaHandle(rep, PoolConfig(eject_base_s=1.0, eject_max_s=3.0))
    h.eject("boom", now=0.0)
    assert h.is_ejected(0.5) and h.state(0.5).detail == "boom"
    rep._state = ReplicaState("a", healthy=False)
    assert h.is_ejected(1.5)  # backoff over but still unhealthy: stays out
    h.eject("again", now=2.0)
    assert h.ejected_until == pytest.approx(4.0)  # 2 s: doubled
    h.eject("thrice", now=5.0)
    assert h.ejected_until == pytest.approx(8.0)  # capped at 3 s
    rep._state = ReplicaState("a")
    assert not h.is_ejected(8.5)
    h.succeeded()
    assert h.failures == 0


def _sample(name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


async def test_rejections_routing_decisions_and_queue_depth_are_exported():
    rep = SimulatedReplica("r0", SimulatedConfig(max_num_seqs=1, token_interval_s=0.02))
    dep = Deployment("metrics-test", "chat", [rep], policy="round_robin",
                     admission=AdmissionConfig(max_queue=1), pool_config=PoolConfig(max_engine_waiting=0))

    def req(rid, tenant="t"):
        return Submission(GenerateRequest(rid, [1, 2], SamplingParams(max_tokens=5), tenant=tenant), Timeline(rid))

    async def run(r):
        return [o async for o in dep.generate(r)]

    first = asyncio.create_task(run(req("a")))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(run(req("b", tenant="gold")))
    await asyncio.sleep(0.01)
    assert _sample("tokenpath:queue_depth", deployment="metrics-test", band="0", tenant="gold") == 1
    with pytest.raises(RateLimitError):
        await run(req("c"))
    await asyncio.gather(first, second)
    assert _sample("tokenpath:admission_rejections_total", deployment="metrics-test", reason="queue_full") == 1
    assert _sample("tokenpath:routing_decisions_total", deployment="metrics-test", policy="round_robin",
                   outcome="rotation") == 2
    assert _sample("tokenpath:queue_depth", deployment="metrics-test", band="0", tenant="gold") == 0


class FlakyReplica(StaticReplica):
    def __init__(self, state: ReplicaState, failures: int) -> None:
        super().__init__(state)
        self.failures = failures

    def state(self) -> ReplicaState:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("dictionary changed size during iteration")
        return self._state


def test_a_transient_state_error_does_not_make_a_replica_unhealthy():
    assert ReplicaHandle(FlakyReplica(ReplicaState("a"), failures=2), PoolConfig()).state().healthy
    broken = ReplicaHandle(FlakyReplica(ReplicaState("a"), failures=10), PoolConfig()).state()
    assert not broken.healthy and "changed size" in (broken.detail or "")


def test_series_can_join_another_registry():
    from prometheus_client import CollectorRegistry, generate_latest

    metrics.REJECTIONS.labels("joined", "queue_full").inc()
    other = CollectorRegistry()
    other.register(metrics.RoutingMetricsCollector())
    text = generate_latest(other).decode()
    assert 'tokenpath:admission_rejections_total{deployment="joined",reason="queue_full"} 1.0' in text
