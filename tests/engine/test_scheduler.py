"""The scheduling rule on its own (no model): grants per step under the budget and the chunk cap."""

from __future__ import annotations

from tokenpath.engine.block_manager import BlockManager
from tokenpath.engine.scheduler import Scheduler
from tokenpath.engine.sequence import Sequence
from tokenpath.protocol.sampling_params import SamplingParams


def _seq(name: str, prompt_len: int, arrival: float, first_token: int | None = None) -> Sequence:
    """A prompt of distinct tokens, unless two share `first_token` (then they share a prefix)."""
    start = int(arrival * 10_000) + 1 if first_token is None else first_token
    return Sequence(name, 0, list(range(start, start + prompt_len)), prompt_len, SamplingParams(max_tokens=4),
                    arrival_time=arrival)


def _advance(out) -> None:  # noqa: ANN001 - what the runner does after a step: the grants are computed
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n


def _grants(threshold: int) -> list[dict[str, int]]:
    """A 512-token prompt, then a 16-token one a step later; the grants of the next steps."""
    sched = Scheduler(BlockManager(256, 16), max_num_batched_tokens=1024, max_num_seqs=8,
                      long_prefill_token_threshold=threshold)
    sched.add(_seq("long", 512, 0.0))
    first = sched.schedule()
    _advance(first)
    sched.add(_seq("short", 16, 1.0))
    steps = [{s.request_id: n for s, n in first.scheduled}]
    for _ in range(3):
        out = sched.schedule()
        _advance(out)
        steps.append({s.request_id: n for s, n in out.scheduled})
    return steps


def test_without_a_cap_a_long_prompt_takes_the_whole_budget_in_one_step():
    steps = _grants(0)
    assert steps[0] == {"long": 512}
    assert steps[1] == {"short": 16}  # the long prompt is done: it wants no more prompt tokens


def test_the_cap_lets_a_short_prompt_in_beside_a_long_prefill():
    steps = _grants(128)
    assert steps[0] == {"long": 128}
    assert steps[1] == {"long": 128, "short": 16}  # no waiting for the other 384 tokens
    assert steps[2] == {"long": 128}  # short now waits for its sample (one token behind)
    assert steps[3] == {"long": 128}


def test_the_cap_does_not_touch_decodes_or_the_budget():
    sched = Scheduler(BlockManager(256, 16), max_num_batched_tokens=100, max_num_seqs=8,
                      long_prefill_token_threshold=64)
    for i in range(3):
        sched.add(_seq(f"s{i}", 40, float(i)))
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("s0", 40), ("s1", 40), ("s2", 20)]


def _twins(max_num_seqs: int) -> tuple[BlockManager, Scheduler, Sequence]:
    """`first` (a 512-token system prompt and a question) prefilled one 128-token chunk; then
    `twin` (the same system prompt, another question) and an unrelated `other` behind it."""
    blocks = BlockManager(256, 16)
    sched = Scheduler(blocks, max_num_batched_tokens=1024, max_num_seqs=max_num_seqs, long_prefill_token_threshold=128)
    sched.add(_seq("first", 512 + 16, 0.0, first_token=1))
    out = sched.schedule()
    _advance(out)
    blocks.commit_computed(out.scheduled[0][0])
    twin = Sequence("twin", 0, list(range(1, 513)) + list(range(90_000, 90_016)), 528,
                    SamplingParams(max_tokens=4), arrival_time=1.0)
    sched.add(twin)
    sched.add(_seq("other", 32, 2.0))
    return blocks, sched, twin


def test_a_prompt_waits_for_its_prefix_being_prefilled_instead_of_computing_it_twice():
    blocks, sched, twin = _twins(8)
    granted: list[dict[str, int]] = []
    while twin.num_computed_tokens < twin.num_prompt_tokens:
        out = sched.schedule()
        _advance(out)
        for seq, _ in out.scheduled:
            blocks.commit_computed(seq)
        granted.append({s.request_id: n for s, n in out.scheduled})
    assert granted[0] == {"first": 128, "other": 32}  # the unrelated prompt goes ahead meanwhile
    assert "twin" not in granted[1] and "twin" not in granted[2]  # first's blocks still in flight
    assert twin.num_cached_tokens == 512  # served from the cache, not computed again
    assert blocks.prefix_hits == 512


def test_a_request_preempted_by_its_own_growth_names_the_one_holding_the_pool():
    """Five blocks: `big` (40 tokens, 3 blocks, room for 8 more) and `late` (32 tokens, 2 full
    blocks). `late` needs a third block for its first decode token, none is free, and it is the
    latest arrival: it is the victim of its own growth, and its record names `big`, whose blocks it
    waited for (the cause's culprit), not nobody."""
    sched = Scheduler(BlockManager(5, 16), max_num_batched_tokens=1024, max_num_seqs=8)
    big, late = _seq("big", 40, 0.0), _seq("late", 32, 1.0)
    sched.add(big)
    sched.add(late)
    _advance(sched.schedule())
    for seq in (big, late):
        seq.token_ids.append(7)  # (each sampled its first token)
    out = sched.schedule()
    assert out.preempted == [late] and [s.request_id for s, _ in out.scheduled] == ["big"]
    assert [r[1] for r in late.events.preempted] == ["big"]


def test_waiting_requests_keep_the_order_the_gateway_dispatched_them_in():
    """The gateway's fair queue sends tenant B's new request ahead of tenant A's older backlog;
    A's requests then come one by one as slots free. The engine's waiting queue keeps that order:
    sorted by arrival, each older A request went back ahead of B, which waited for A's whole
    backlog (tests/reliability/test_stall_tenants.py). Preempted ones still go first."""
    sched = Scheduler(BlockManager(256, 16), max_num_batched_tokens=1024, max_num_seqs=1)
    sched.add(_seq("a-running", 16, 0.0))
    _advance(sched.schedule())
    sched.add(_seq("b-new", 16, 5.0))  # dispatched first, arrived last
    sched.add(_seq("a-old", 16, 1.0))  # dispatched after it, arrived before it
    assert [s.request_id for s in sched.waiting] == ["b-new", "a-old"]
    preempted = _seq("p", 16, 9.0)
    preempted.num_preemptions = 1
    sched.add(preempted)
    assert [s.request_id for s in sched.waiting] == ["p", "b-new", "a-old"]


def test_waiting_sequences_passed_over_for_their_own_reason_are_deferred_not_waiting_for_capacity():
    """vLLM's num_requests_waiting_by_reason: `twin` waits for `first`'s prefix blocks in flight
    (deferred) while `other` goes ahead; once the sequence cap is reached, what waits waits for
    capacity (deferred 0)."""
    _, sched, _ = _twins(3)
    out = sched.schedule()
    assert {s.request_id for s, _ in out.scheduled} == {"first", "other"}
    assert sched.deferred == 1 and [s.request_id for s in sched.waiting] == ["twin"]
    _advance(out)
    sched.add(_seq("late", 32, 3.0))  # the cap: first and other running, twin passed over, late admitted
    sched.add(_seq("later", 32, 4.0))
    out = sched.schedule()
    assert "late" in {s.request_id for s, _ in out.scheduled} and sched.deferred == 1
    _advance(out)
    out = sched.schedule()  # three running now: nobody is looked at, so nobody is deferred
    assert len(sched.running) == 3 and sched.deferred == 0 and len(sched.waiting) == 2


def test_blocks_without_a_hash_are_reused_first_and_cached_ones_evicted_last():
    """A pool run by turns touches only the blocks the most tokens held at once need (issue 42's
    peak RSS: each block's pages become resident when first written), and a prompt's partial last
    block, which no later prompt can find, is reused before any cached block is evicted."""
    plain = BlockManager(8, 16, enable_prefix_caching=False)
    touched: set[int] = set()
    for n in (40, 100, 20):  # three requests one after another: 3, 7, then 2 blocks
        seq = _seq(f"r{n}", n, n / 1000)
        assert plain.allocate(seq, n)
        touched |= set(seq.block_tables[0])
        plain.release(seq)
    assert touched == set(range(7))  # before: the least recently freed first, all 8 by the third
    assert plain.touched == 7  # what /metrics' kv_cache_resident_bytes counts: those blocks' pages
    cached = BlockManager(8, 16)
    first = _seq("first", 40, 0.0)  # 2 full blocks (hashed once computed) and a partial one
    cached.lookup_prefix(first)
    assert cached.allocate(first, 40)
    first.num_computed_tokens = 40
    cached.commit_computed(first)
    full, partial = first.block_tables[0][:2], first.block_tables[0][2]
    cached.release(first)
    other = _seq("other", 16 * 6, 1.0)  # every free block but the two cached ones
    assert cached.allocate(other, 16 * 6)
    assert partial in other.block_tables[0] and not set(full) & set(other.block_tables[0])
    assert len(cached.cached) == 2
    assert cached.touched == 8  # (every block handed out once: the pool is wholly resident)
