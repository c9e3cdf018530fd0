"""The tenant share of the KV pool (`engine.kv_share`, issue 41): a tenant filling a small pool is
the one its shortage preempts, and another tenant's request is admitted before its preempted ones.
Without it, the latest arrival was the victim, in a flood always the other tenant's newest request
(benchmarks/results/slow_reader_flood.md: tenant B's later requests took 37-41 s in decode)."""

from __future__ import annotations

from tokenpath.engine.block_manager import BlockManager
from tokenpath.engine.scheduler import Scheduler
from tokenpath.engine.sequence import Sequence
from tokenpath.protocol.sampling_params import SamplingParams


def _seq(name: str, tenant: str, prompt_len: int, arrival: float, priority: int = 0) -> Sequence:
    start = int(arrival * 10_000) + 1
    seq = Sequence(name, 0, list(range(start, start + prompt_len)), prompt_len, SamplingParams(max_tokens=8),
                   arrival_time=arrival, priority=priority)
    seq.tenant = tenant
    return seq


def _step(sched: Scheduler):  # noqa: ANN202 - the runner's part: grants computed, each decode samples a token
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens >= seq.num_tokens:
            seq.token_ids.append(7)
    return out


def _names(seqs) -> list[str]:  # noqa: ANN001
    return [s.request_id for s in seqs]


def test_the_tenant_over_its_share_of_the_pool_is_preempted_not_the_later_arrival():
    """Eight blocks: tenant A's three 32-token prompts hold six, B's later 24-token prompt two.
    Each A sequence then needs a third block: B, the latest arrival, was the victim; now A, four
    blocks over a share of four, gives its own latest sequence."""
    sched = Scheduler(BlockManager(8, 16), max_num_batched_tokens=1024, max_num_seqs=4)
    a = [_seq(f"a{i}", "A", 32, float(i)) for i in range(3)]
    b = _seq("b", "B", 24, 3.0)
    for seq in (*a, b):
        sched.add(seq)
    _step(sched)
    out = _step(sched)
    assert _names(out.preempted) == ["a2"]
    assert set(_names(s for s, _ in out.scheduled)) == {"a0", "a1", "b"}


def test_another_tenants_request_is_admitted_before_the_over_share_tenants_preempted_ones():
    """A fills the pool (four 32-token prompts, eight blocks); B's request arrives and waits. A's
    growth preempts two of its own, which went back ahead of B (preempted first): B then waited
    for them. While A is over its share (half the pool, B waiting), B goes first."""
    sched = Scheduler(BlockManager(8, 16), max_num_batched_tokens=1024, max_num_seqs=4)
    for i in range(4):
        sched.add(_seq(f"a{i}", "A", 32, float(i)))
    _step(sched)
    sched.add(_seq("b", "B", 16, 9.0))
    out = _step(sched)
    assert _names(out.preempted) == ["a3", "a2"]
    out = _step(sched)
    assert "b" in _names(s for s, _ in out.scheduled)
    assert _names(sched.running) == ["a0", "a1", "b"]
    assert sorted(_names(sched.waiting)) == ["a2", "a3"]


def test_a_higher_priority_request_is_never_preempted_for_the_share():
    """A's sequences are over the share but run at a higher priority (a lower number) than B's:
    B's is the victim, as before."""
    sched = Scheduler(BlockManager(8, 16), max_num_batched_tokens=1024, max_num_seqs=4)
    for i in range(3):
        sched.add(_seq(f"a{i}", "A", 32, float(i), priority=0))
    sched.add(_seq("b", "B", 24, 3.0, priority=1))
    _step(sched)
    out = _step(sched)
    assert "b" in _names(out.preempted)


def test_one_tenant_keeps_the_latest_arrival_rule():
    sched = Scheduler(BlockManager(8, 16), max_num_batched_tokens=1024, max_num_seqs=4)
    for i in range(4):
        sched.add(_seq(f"a{i}", "A", 32 if i < 3 else 24, float(i)))
    _step(sched)
    out = _step(sched)
    assert _names(out.preempted)[0] == "a3"
