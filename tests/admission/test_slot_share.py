"""Each tenant's share of the dispatch slots while tenants compete (admission/share.py, issue 41).

The shares themselves are pure arithmetic (checked with explicit clocks); the flow controller's
use of them runs on simulated replicas through `Deployment.generate`, as test_flow_control does.
"""

import asyncio
from collections import Counter

import pytest
from tests.admission.test_flow_control import deployment, req, run

from tokenpath.admission.queue import FairQueue, Ticket
from tokenpath.admission.share import SlotShare


def share(weights: dict[str, float] | None = None, active_s: float = 5.0) -> SlotShare:
    return SlotShare(lambda t: (weights or {}).get(t, 1.0), active_s)


def test_shares_are_weighted_max_min_fair():
    s = share({"a": 3.0})
    assert s.shares(8, {"a": 100, "b": 100}) == {"a": 6.0, "b": 2.0}
    # A tenant that wants less than its share keeps what it wants; the rest goes to the others.
    assert s.shares(64, {"a": 200, "b": 1}) == {"a": 63.0, "b": 1.0}
    assert s.shares(9, {"a": 2, "b": 100, "c": 100}) == {"a": 2.0, "b": 3.5, "c": 3.5}
    assert share().shares(4, {"a": 1, "b": 1}) == {"a": 1.0, "b": 1.0}  # wanting less than there is


def test_one_active_tenant_may_take_every_slot():
    s = share()
    for _ in range(64):
        assert s.allowance(lambda: 64, {"a": 100}, now=0.0)("a")
        s.take("a", queued=100, now=0.0)
    assert s.allowance(lambda: 64, {"a": 100}, now=0.0)("a")  # (the slots' own count is the pool's)


def test_a_tenant_between_requests_keeps_its_share_until_it_has_been_idle_long_enough():
    s = share(active_s=5.0)
    s.note("b", queued=1, now=0.0)
    s.take("b", queued=0, now=0.0)
    s.give_back("b", queued=0, now=10.0)  # a 10 s request: its demand stood at 1 until now
    for _ in range(3):
        s.take("a", queued=10, now=10.0)
    allowed = s.allowance(lambda: 4, {"a": 10}, now=12.0)
    assert not allowed("a") and allowed("b")  # 2 s after b's request ended: b keeps its one slot
    assert s.allowance(lambda: 4, {"a": 10}, now=15.5)("a")  # b idle past 5 s: a may take all four
    assert s.demands({"a": 10}, now=15.5) == {"a": 13}  # and b is forgotten


def test_a_burst_is_reserved_only_for_the_window_after_it():
    s = share(active_s=5.0)
    s.note("b", queued=10, now=0.0)  # b wanted ten at once...
    s.note("b", queued=1, now=1.0)   # ...then one
    assert s.demands({"b": 1}, now=5.0) == {"b": 10}
    assert s.demands({"b": 1}, now=6.5) == {"b": 1}


def test_the_queue_passes_over_a_tenant_at_its_share_and_keeps_the_order_of_the_rest():
    q = FairQueue()
    a = [q.push(Ticket(f"a{i}", "a", 0, cost=10)) for i in range(3)]
    b = [q.push(Ticket(f"b{i}", "b", 0, cost=10)) for i in range(2)]
    assert q.peek() is a[0]  # a's first tag is the smallest
    assert q.peek_where(lambda t: t != "a") is b[0]
    q.take(b[0])
    assert len(q) == 4 and q.tenant_depths() == Counter({"a": 3, "b": 1})
    assert [q.pop() for _ in range(4)] == [a[0], a[1], b[1], a[2]]  # (tags 10, 20, 20, 30)
    assert q.pop() is None and q.peek_where(lambda t: True) is None


async def until(condition, within: float = 30.0) -> None:
    """Wait for `condition` (a bound on failure only: it holds within milliseconds when it holds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def inflight(dep) -> int:
    return sum(h.inflight for h in dep.flow.pool.handles.values())


async def test_a_client_between_requests_keeps_its_slot_through_another_tenants_flood():
    """B's closed loop (one request, then the next) goes on at once while A floods with requests
    that run for minutes. Without the share A takes all four slots between two of B's requests,
    and B's next one waits for one of A's to end (here: never, within the test)."""
    dep, _ = deployment(seqs=4, interval=0.01, max_queue=500, tenant_active_s=60.0)
    await run(dep, req(tenant="b", max_tokens=2))
    flood = [asyncio.create_task(run(dep, req(tenant="a", max_tokens=100_000))) for _ in range(20)]
    try:
        await until(lambda: len(dep.flow.queue) + inflight(dep) == 20)
        assert dep.flow.share.held["a"] == 3  # b's one slot stays b's
        for _ in range(3):
            b = req(tenant="b", max_tokens=2)
            outs = await asyncio.wait_for(run(dep, b), timeout=60)
            assert outs[-1].finished
            assert "admission_freed_by" not in b.timeline.attrs  # it waited for no slot to free
        assert dep.flow.share.held["a"] == 3 and len(dep.flow.queue) == 17
    finally:
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)


async def test_alone_again_a_tenant_takes_every_slot():
    dep, _ = deployment(seqs=4, interval=0.01, max_queue=500, tenant_active_s=0.2)
    await run(dep, req(tenant="b", max_tokens=2))
    flood = [asyncio.create_task(run(dep, req(tenant="a", max_tokens=100_000))) for _ in range(8)]
    try:
        await until(lambda: dep.flow.share.held["a"] == 4)  # once b has been idle for 0.2 s
        assert inflight(dep) == 4
    finally:
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)


async def test_the_share_off_is_the_fair_queue_alone():
    dep, _ = deployment(seqs=4, interval=0.01, max_queue=500, tenant_share=False)
    await run(dep, req(tenant="b", max_tokens=2))
    flood = [asyncio.create_task(run(dep, req(tenant="a", max_tokens=100_000))) for _ in range(8)]
    try:
        await until(lambda: inflight(dep) == 4 and len(dep.flow.queue) == 4)
    finally:
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)


async def test_weights_divide_the_slots_while_both_tenants_flood():
    """B floods first and holds all eight slots; A's flood then takes only what B gives back, up
    to A's weighted share (6 of 8 at 3:1), and B, over its share, gets no new slot meanwhile."""
    dep, _ = deployment(seqs=8, interval=0.002, max_queue=1000, tenant_weights={"a": 3.0})
    b = [asyncio.create_task(run(dep, req(tenant="b", max_tokens=10))) for _ in range(200)]
    await until(lambda: dep.flow.share.held["b"] == 8)
    a = [asyncio.create_task(run(dep, req(tenant="a", max_tokens=10))) for _ in range(200)]
    seen: list[tuple[int, int]] = []
    try:
        while not all(t.done() for t in a):
            held = dep.flow.share.held
            if dep.flow.queue.tenant_depth("a") and dep.flow.queue.tenant_depth("b"):
                seen.append((held["a"], held["b"]))
            await asyncio.sleep(0.001)
    finally:
        await asyncio.gather(*a, *b)
    assert seen and max(h_a for h_a, _ in seen) <= 6, Counter(seen)
    assert (6, 2) in seen, Counter(seen)  # both at their shares while both wait


@pytest.mark.parametrize("weights", [{}, {"a": 2.0}])
def test_shares_never_hand_out_more_than_the_slots(weights):
    s = share(weights)
    for demands in ({"a": 5, "b": 5, "c": 5}, {"a": 1, "b": 50}, {"a": 7, "b": 3}):
        assert sum(s.shares(8, demands).values()) <= 8 + 1e-9
