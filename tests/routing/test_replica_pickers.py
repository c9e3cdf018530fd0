import random
import time

import pytest

from tokenpath.engine.block_hash import block_hashes
from tokenpath.protocol import EmbeddingRequest, GenerateRequest, ReplicaState, Routable, Submission
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.routing.replicas import (
    LeastLoadedPicker,
    PrefixAwarePicker,
    PrefixIndex,
    RoundRobinPicker,
    SessionAffinityPicker,
    load_score,
    make_picker,
)
from tokenpath.telemetry.timeline import Timeline


def req(tokens, session=None, rid="r"):
    return Submission(GenerateRequest(rid, list(tokens), SamplingParams()), Timeline(rid), session_id=session)


def st(name, waiting=0, running=0, kv=0.0, hashes=(), block_size=16, max_num_seqs=8):
    return ReplicaState(name, waiting=waiting, running=running, kv_usage=kv, prefix_hashes=set(hashes),
                        block_size=block_size, max_num_seqs=max_num_seqs)


SYSTEM = list(range(1000, 1000 + 16 * 8))  # an 8-block shared prefix


def test_round_robin_rotates_over_all():
    p = RoundRobinPicker()
    states = [st("b"), st("a"), st("c")]
    assert [p.pick(req([1]), states).name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_prefers_shorter_queue_and_lower_kv():
    p = LeastLoadedPicker(random.Random(0))
    assert p.pick(req([1]), [st("a", waiting=3), st("b", waiting=1)]).name == "b"
    assert p.pick(req([1]), [st("a", running=2, kv=0.9), st("b", running=2, kv=0.1)]).name == "b"


def test_least_loaded_power_of_two_never_picks_the_worst():
    p = LeastLoadedPicker(random.Random(1))
    states = [st("a", waiting=0), st("b", waiting=5), st("c", waiting=9)]
    picks = {p.pick(req([1]), states).name for _ in range(200)}
    assert "c" not in picks and picks == {"a", "b"}
    assert all(p.pick(req([1]), states).reason == "p2c" for _ in range(3))


def test_prefix_aware_reported_hashes_win():
    tokens = SYSTEM + [1, 2, 3]
    hs = block_hashes(tokens, 16)
    p = PrefixAwarePicker()
    pick = p.pick(req(tokens), [st("a"), st("b", running=1, hashes=hs[:5])])
    assert (pick.name, pick.reason, pick.matched_blocks) == ("b", "prefix_hit", 5)


def test_prefix_aware_uses_replica_block_size():
    tokens = SYSTEM
    p = PrefixAwarePicker()
    a = st("a", hashes=block_hashes(tokens, 16), block_size=32)  # hashes of the wrong block size
    b = st("b", running=1, hashes=block_hashes(tokens, 32), block_size=32)
    assert p.pick(req(tokens), [a, b]).name == "b"


def test_prefix_aware_longest_match_wins_and_routed_blocks_are_remembered():
    p = PrefixAwarePicker()
    states = [st("a"), st("b")]
    first = p.pick(req(SYSTEM + [7, 7]), states)
    assert first.reason == "cold"
    # Same long prefix, different tail: follows the first request, even if now slightly busier.
    busier = [st(s.name, running=1 if s.name == first.name else 0) for s in states]
    for tail in ([8], [9, 9], [10] * 20):
        pick = p.pick(req(SYSTEM + tail), busier)
        # (these replicas report nothing: the hit is predicted from what this router sent there)
        assert (pick.name, pick.reason) == (first.name, "prefix_predicted")
        assert pick.matched_blocks == 8


def test_prefix_aware_spreads_cold_prompts():
    p = PrefixAwarePicker()
    load = {"a": 0, "b": 0}
    for i in range(10):
        states = [st(n, running=load[n]) for n in load]
        pick = p.pick(req([i * 7919 + j for j in range(40)]), states)
        assert pick.reason == "cold"
        load[pick.name] += 1
    assert load == {"a": 5, "b": 5}


def test_prefix_aware_load_escape():
    p = PrefixAwarePicker(load_threshold=0.5)
    hs = block_hashes(SYSTEM, 16)
    states = [st("a", running=8, waiting=2, hashes=hs), st("b", running=1)]
    pick = p.pick(req(SYSTEM), states)
    assert (pick.name, pick.reason) == ("b", "load_escape")


def test_prefix_index_is_bounded_lru():
    idx = PrefixIndex(max_blocks_per_replica=3)
    idx.add("a", [1, 2, 3])
    idx.add("a", [1])  # touch 1
    idx.add("a", [4])  # evicts 2, the least recently used
    assert ("a", 1) in idx and ("a", 2) not in idx and ("a", 4) in idx
    assert idx.size("a") == 3
    idx.forget("a")
    assert idx.size("a") == 0


def test_session_affinity_is_sticky_and_escapes_load():
    p = SessionAffinityPicker(load_threshold=0.5)
    states = [st("a"), st("b"), st("c")]
    homes = {s: p.pick(req([1], session=s), states).name for s in ("u1", "u2", "u3", "u4", "u5", "u6")}
    for s, home in homes.items():
        assert p.pick(req([2], session=s), states).name == home
    assert len(set(homes.values())) > 1  # sessions spread over replicas
    home = homes["u1"]
    loaded = [st(s.name, running=8 if s.name == home else 0) for s in states]
    assert p.pick(req([1], session="u1"), loaded).reason == "load_escape"
    # Removing a replica moves only its own sessions.
    rest = [s for s in states if s.name != "c"]
    for s, h in homes.items():
        if h != "c":
            assert p.pick(req([1], session=s), rest).name == h


def test_session_affinity_without_session_is_least_loaded():
    p = SessionAffinityPicker()
    pick = p.pick(req([1]), [st("a", running=3), st("b")])
    assert (pick.name, pick.reason) == ("b", "no_session")


def test_load_score_and_factory():
    assert load_score(st("a", waiting=4, running=4, kv=0.5, max_num_seqs=8)) == pytest.approx(1.5)
    assert make_picker("round_robin").policy == "round_robin"
    assert make_picker("prefix_aware", load_threshold=2.0).load_threshold == 2.0
    assert make_picker("session_affinity", load_threshold=3.0).load_threshold == 3.0
    assert make_picker("session_affinity").load_threshold == 1.0
    with pytest.raises(ValueError, match="cache_weight"):  # a prefix_aware option, not its own
        make_picker("session_affinity", cache_weight=1.0)
    with pytest.raises(ValueError):
        make_picker("random")
    with pytest.raises(ValueError):
        RoundRobinPicker().pick(req([1]), [])


def test_prefix_aware_spreads_cold_prompts_over_idle_replicas():
    p = PrefixAwarePicker()
    idle = [st("a"), st("b")]
    names = [p.pick(req([i * 7919 + j for j in range(40)]), idle).name for i in range(6)]
    assert names.count("a") == names.count("b") == 3


def test_prefix_aware_stays_on_a_busy_hit_until_its_backlog_outweighs_a_cold_start():
    tokens = SYSTEM + [1, 2, 3]  # 131 tokens, 8 cached blocks on "a": 3 uncached there
    hs = block_hashes(tokens, 16)
    p = PrefixAwarePicker(load_threshold=10)
    # "a" is prefilling another 200 tokens: 200 + 2*3 beats a cold start on idle "b" (2*131).
    busy = [st("a", running=1, hashes=hs[:8]), st("b")]
    busy[0].pending_prefill_tokens = 200
    pick = p.pick(req(tokens), busy)
    assert (pick.name, pick.reason, pick.matched_blocks) == ("a", "prefix_hit", 8)
    # With 300 tokens of backlog on "a", starting cold on "b" gets the first token sooner.
    busy[0].pending_prefill_tokens = 300
    pick = p.pick(req(tokens), busy)
    assert (pick.name, pick.reason, pick.matched_blocks) == ("b", "backlog_escape", 0)


def test_prefix_aware_forgets_what_the_replica_cannot_hold():
    p = PrefixAwarePicker()
    small = [st("a"), st("b")]
    for s in small:
        s.num_blocks = 8  # each replica's KV pool holds 8 blocks
    first = p.pick(req(SYSTEM), small)  # 8 blocks remembered on one replica
    other = list(range(5000, 5000 + 16 * 8))
    for _ in range(2):  # two more 8-block prompts routed to the same replica push SYSTEM out
        for s in small:
            s.pending_prefill_tokens = 0 if s.name == first.name else 10_000
        p.pick(req(other), small)
        other = [t + 1000 for t in other]
    assert p.index.size(first.name) == 8
    assert p.pick(req(SYSTEM), small).reason == "cold"


def test_an_embedding_is_routed_like_a_generation_of_its_tokens():
    """A submission of either request kind is `Routable` (what a picker reads); an embedding has no
    adapter, and its inputs hash like a generation's prompt, so identical inputs land on the
    replica holding them."""
    emb = Submission(EmbeddingRequest("e", [SYSTEM[:64], SYSTEM[64:]]), Timeline("e"), session_id="s1")
    assert isinstance(emb, Routable) and isinstance(req([1]), Routable) and emb.lora is None
    hs = block_hashes(SYSTEM, 16)
    states = [st("a"), st("b", running=1, hashes=hs)]
    pick = PrefixAwarePicker().pick(emb, states)
    assert (pick.name, pick.reason, pick.matched_blocks) == ("b", "prefix_hit", 8)
    home = SessionAffinityPicker().pick(req([1], session="s1"), states).name
    assert SessionAffinityPicker().pick(emb, states).name == home


def test_a_reporting_replica_is_matched_on_its_report_and_fresh_routing_only():
    """A replica that reports its cache (KV events, an in-process index) is matched against the
    report: what the router sent there bridges only `bridge_s`, after which a block the engine
    never stored (or evicted) stops counting. Confirmed hits are `prefix_hit`, guesses
    `prefix_predicted` (issue 37: routing said nothing of which it was)."""
    hs = block_hashes(SYSTEM, 16)
    p = PrefixAwarePicker(index=PrefixIndex(bridge_s=0.2))
    a, b = st("a"), st("b")
    a.prefix_reported = b.prefix_reported = True
    first = p.pick(req(SYSTEM), [a, b])
    assert first.reason == "cold"
    again = p.pick(req(SYSTEM + [1]), [a, b])  # within the bridge: the events have not come yet
    assert (again.name, again.reason, again.matched_blocks) == (first.name, "prefix_predicted", 8)
    time.sleep(0.3)  # the engine never reported those blocks: the guess expires
    assert p.pick(req(SYSTEM + [2]), [a, b]).reason == "cold"
    held = a if first.name == "a" else b
    held.prefix_hashes = set(hs[:6])  # its events: six blocks stored
    time.sleep(0.3)  # (the cold pick's own routing memory, wherever it went, expires too)
    hit = p.pick(req(SYSTEM + [3]), [a, b])
    assert (hit.name, hit.reason, hit.matched_blocks) == (held.name, "prefix_hit", 6)
