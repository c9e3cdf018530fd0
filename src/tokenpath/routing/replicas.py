"""Replica pickers: which replica of a deployment serves this request?

Every policy sits behind one interface, `pick(request, states) -> Pick(state, reason)`, where
`request` is a `protocol.Routable` (all a picker may read: prompt ids, adapter, session id; the
gateway's `protocol.Submission` of a generation or an embedding alike) and `states` are the replicas that are healthy *and* have room
right now (the flow controller filters them, so a picker never has to think about saturation or
ejection). The `reason` is recorded on the request's Timeline and counted on /metrics, so every
routing decision can be explained later.

Policies:
- `round_robin`: the baseline; ignores load and caches.
- `least_loaded`: power of two choices on a load score (engine queue + running, normalised by the
  batch size, plus KV usage). Two random samples avoid the herd effect of always taking the global
  minimum from slightly stale state, which matters once state comes from polled /metrics.
- `prefix_aware` (default): the prompt's chained block hashes — computed with the engine's own
  hash and the replica's block size — matched against what each replica reported as cached and
  what this router recently sent it (remembered up to the replica's KV pool size, so what the
  engine must have evicted is forgotten too). Each replica is scored in prompt tokens still to
  prefill before this request's first token: its prefill backlog (uncached prompt tokens this
  gateway dispatched there that have not produced a first token) plus this prompt's uncached part,
  counted `cache_weight` times because a miss also costs everyone on that replica a full prefill
  and copies the prefix into a second cache. The cheapest wins: a hit on an idle replica, a
  cold start elsewhere only when the matched replica's backlog outweighs the prefill it saves. A
  replica more loaded than the least loaded one by `load_threshold` (load-score units: 1.0 = one
  full batch more, or a KV cache that much fuller) is escaped; a cold prompt goes to the least
  loaded.
- `session_affinity`: rendezvous hashing of the session id (`user` or `x-session-id`), with the
  same load escape. Rendezvous hashing needs no table and moves only the sessions of a replica
  that leaves, so several gateways agree without sharing state.

A request with a LoRA adapter: `prefix_aware` first narrows the replicas to those holding the
adapter, spreading a hot one (`routing.lora_affinity`), and records that reason (`lora_hit`,
`lora_spread`, `lora_cold`); its block hashes are the adapter's own (`block_hash.lora_root`).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TypedDict, Unpack

from tokenpath.admission.picker import Pick, ReplicaPicker
from tokenpath.config import DEFAULT_POLICY
from tokenpath.engine.block_hash import block_hashes, lora_root
from tokenpath.protocol import ReplicaState, Routable
from tokenpath.routing.lora_affinity import lora_candidates

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "session_affinity")
_DEFAULT_BATCH = 8  # normaliser when a replica does not report max_num_seqs


class PickerOptions(TypedDict, total=False):
    """A deployment's picker tunables (`Deployment.picker_options`; the routing YAML sets
    `load_threshold`), named as the pickers' constructor arguments, so `make_picker` passes them
    on checked. Each left out keeps its picker's default."""

    load_threshold: float  # prefix_aware, session_affinity: load gap that overrides locality
    min_match_blocks: int  # prefix_aware: fewer cached blocks than this do not count as a hit
    cache_weight: float  # prefix_aware: how much one cached block outweighs load


def load_score(state: ReplicaState) -> float:
    """Queue depth relative to the batch size, plus KV usage: both push TTFT up."""
    batch = state.max_num_seqs or _DEFAULT_BATCH
    return (state.waiting + state.running) / batch + state.kv_usage


def _least(states: Sequence[ReplicaState]) -> ReplicaState:
    return min(states, key=lambda s: (load_score(s), s.name))


def _require(states: Sequence[ReplicaState]) -> None:
    if not states:
        raise ValueError("pick() needs at least one candidate replica")


class RoundRobinPicker:
    policy = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, request: Routable, states: Sequence[ReplicaState]) -> Pick:
        _require(states)
        ordered = sorted(states, key=lambda s: s.name)
        state = ordered[self._next % len(ordered)]
        self._next += 1
        return Pick(state, "rotation")

    def forget(self, replica: str) -> None:
        pass


class LeastLoadedPicker:
    policy = "least_loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, request: Routable, states: Sequence[ReplicaState]) -> Pick:
        _require(states)
        if len(states) <= 2:
            return Pick(_least(states), "least")
        a, b = self._rng.sample(list(states), 2)
        return Pick(_least((a, b)), "p2c")

    def forget(self, replica: str) -> None:
        pass


class PrefixIndex:
    """Block hashes this router recently sent to each replica, bounded per replica (LRU).

    A replica that reports what it caches (`ReplicaState.prefix_reported`: an in-process engine's
    index, the KV events of an engine process, a Ray actor or vLLM) is matched against its report;
    what this router sent there counts only for `bridge_s` after sending, the moments before the
    blocks are computed and their events arrive. A replica that reports nothing (a URL replica
    without KV events) is matched against this memory alone, as llm-d's approximate prefix scorer
    does: a prediction, and the routing reason says so (`prefix_predicted`).
    """

    def __init__(self, max_blocks_per_replica: int = 50_000, bridge_s: float = 10.0) -> None:
        self.max_blocks = max_blocks_per_replica
        self.bridge_s = bridge_s
        self._blocks: dict[str, OrderedDict[int, float]] = {}  # hash -> when last sent there

    def add(self, replica: str, hashes: Sequence[int], capacity: int = 0) -> None:
        """Remember `hashes` as most recent; keep at most `capacity` (the replica's KV pool, when
        known) so blocks the engine's own LRU must have evicted do not count as hits."""
        limit = min(self.max_blocks, capacity) if capacity > 0 else self.max_blocks
        lru = self._blocks.setdefault(replica, OrderedDict())
        now = time.monotonic()
        for h in hashes:
            lru[h] = now
            lru.move_to_end(h)
        while len(lru) > limit:
            lru.popitem(last=False)

    def __contains__(self, key: tuple[str, int]) -> bool:
        replica, h = key
        return h in self._blocks.get(replica, ())

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def forget(self, replica: str) -> None:
        self._blocks.pop(replica, None)

    def matched(self, state: ReplicaState, hashes: Sequence[int]) -> tuple[int, int]:
        """How many leading blocks of the prompt this replica holds: (reported or routed, of which
        reported). A reporting replica's routed blocks count only while fresh (`bridge_s`)."""
        known: dict[int, float] = self._blocks.get(state.name) or {}
        reported = state.prefix_hashes
        since = time.monotonic() - self.bridge_s if state.prefix_reported else float("-inf")
        n = confirmed = 0
        for h in hashes:
            if h in reported:
                if confirmed == n:
                    confirmed += 1
            elif h not in known or known[h] < since:
                break
            n += 1
        if n:  # touch the matched blocks so hot prefixes survive eviction
            self.add(state.name, hashes[:n], state.num_blocks)
        return n, confirmed


class PrefixAwarePicker:
    policy = "prefix_aware"

    def __init__(self, load_threshold: float = 1.0, min_match_blocks: int = 1, cache_weight: float = 2.0,
                 index: PrefixIndex | None = None) -> None:
        self.load_threshold = load_threshold
        self.min_match_blocks = min_match_blocks
        self.cache_weight = cache_weight
        self.index = index or PrefixIndex()
        self._turn = 0

    def _least_rotating(self, states: Sequence[ReplicaState]) -> ReplicaState:
        """The least loaded; ties rotate, so cold prompts spread even over idle replicas."""
        low = min(load_score(s) for s in states)
        tied = sorted((s for s in states if load_score(s) <= low + 1e-9), key=lambda s: s.name)
        self._turn += 1
        return tied[self._turn % len(tied)]

    def pick(self, request: Routable, states: Sequence[ReplicaState]) -> Pick:
        _require(states)
        everyone = states
        lora = request.lora  # (None for the base model, and always for an embedding)
        states, lora_reason = lora_candidates(lora, states)
        root = None if lora is None else lora_root(lora.name, lora.path)
        by_size: dict[int, list[int]] = {}
        scored: list[tuple[float, int, ReplicaState]] = []  # (cost in tokens, matched blocks, state)
        reported: dict[str, int] = {}  # matched blocks the replica itself reports holding
        n = len(request.prompt_token_ids)
        for s in states:
            hashes = by_size.get(s.block_size)
            if hashes is None:
                hashes = by_size[s.block_size] = block_hashes(request.prompt_token_ids, s.block_size, root=root)
            matched, confirmed = self.index.matched(s, hashes)
            if matched < self.min_match_blocks:
                matched = confirmed = 0
            reported[s.name] = confirmed
            uncached = max(1, n - matched * s.block_size)
            scored.append((s.pending_prefill_tokens + self.cache_weight * uncached, matched, s))
        if not any(m for _, m, _ in scored):
            low = min(c for c, _, _ in scored)
            chosen, reason, matched = self._least_rotating([s for c, _, s in scored if c <= low]), "cold", 0
        else:
            _, matched, chosen = min(scored, key=lambda x: (x[0], -x[1], load_score(x[2]), x[2].name))
            # A hit the replica's own report confirms, or one predicted from what we sent there.
            reason = ("prefix_hit" if reported[chosen.name] == matched else "prefix_predicted") if matched \
                else "backlog_escape"
        least = _least(everyone)
        if load_score(chosen) - load_score(least) > self.load_threshold:
            chosen, reason, matched = least, "load_escape", 0
            by_size.setdefault(chosen.block_size, block_hashes(request.prompt_token_ids, chosen.block_size, root=root))
        elif lora_reason is not None:
            reason = lora_reason
        self.index.add(chosen.name, by_size[chosen.block_size], chosen.num_blocks)
        return Pick(chosen, reason, matched, _passed_over(scored, chosen, reason))

    def forget(self, replica: str) -> None:
        self.index.forget(replica)


def _passed_over(scored: list[tuple[float, int, ReplicaState]], chosen: ReplicaState,
                 reason: str) -> dict | None:
    """The replica holding the most of this prompt, when it was not the one chosen, and why:
    the load threshold (`load_escape`), or its prefill backlog outweighing the blocks it held."""
    _, best_blocks, best = max(scored, key=lambda x: (x[1], -x[0]))
    held = next((m for _, m, s in scored if s is chosen), 0)  # (0: escaped to one outside the candidates)
    if best is chosen or best_blocks <= held:
        return None
    why = "load_threshold" if reason == "load_escape" else "backlog"
    return {"replica": best.name, "blocks": best_blocks, "chosen_blocks": held, "why": why,
            "block_size": best.block_size, "backlog_tokens": best.pending_prefill_tokens}


def _hrw(session: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{session}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class SessionAffinityPicker:
    policy = "session_affinity"

    def __init__(self, load_threshold: float = 1.0) -> None:
        self.load_threshold = load_threshold

    def pick(self, request: Routable, states: Sequence[ReplicaState]) -> Pick:
        _require(states)
        least = _least(states)
        if not request.session_id:
            return Pick(least, "no_session")
        home = max(states, key=lambda s: _hrw(request.session_id or "", s.name))
        if load_score(home) - load_score(least) > self.load_threshold:
            return Pick(least, "load_escape")
        return Pick(home, "affinity")

    def forget(self, replica: str) -> None:
        pass


def make_picker(policy: str = DEFAULT_POLICY, **options: Unpack[PickerOptions]) -> ReplicaPicker:
    """Build a picker by policy name; `options` go to its constructor (the round-robin and
    least-loaded pickers have none, and ignore them). Session affinity takes `load_threshold`
    only: another option for it is a mistake in the configuration, and raises."""
    if policy == "round_robin":
        return RoundRobinPicker()
    if policy == "least_loaded":
        return LeastLoadedPicker()
    if policy == "prefix_aware":
        return PrefixAwarePicker(**options)
    if policy == "session_affinity":
        if unused := sorted(options.keys() - {"load_threshold"}):
            raise ValueError(f"routing policy 'session_affinity' takes no {', '.join(unused)}")
        threshold = options.get("load_threshold")
        return SessionAffinityPicker() if threshold is None else SessionAffinityPicker(threshold)
    raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
