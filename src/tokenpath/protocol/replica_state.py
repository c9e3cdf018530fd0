"""`ReplicaState`: what routers, admission control and `/health` read about one replica."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReplicaState:
    """vLLM-compatible meanings, so the same routers can drive vLLM replicas."""

    name: str
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    kv_resident_bytes: int = 0  # the KV pool's bytes in the engine's memory (EngineState's); 0: not reported
    healthy: bool = True
    # Block hashes the replica reports it caches (group 0: an in-process engine's index, or the
    # KV events an engine process, a Ray actor or vLLM publishes); empty where it reports none.
    prefix_hashes: set[int] = field(default_factory=set)
    # True when `prefix_hashes` is the replica's own account (events or a snapshot), so a router's
    # memory of what it sent there only bridges the moments before the report catches up.
    prefix_reported: bool = False
    max_num_seqs: int = 0
    # Extensions read by routing/admission (defaults keep older constructors valid):
    block_size: int = 16  # the engine's KV block size: prefix-aware routing hashes prompts with it
    num_blocks: int = 0  # KV blocks in the pool (0: unknown)
    # Set by the gateway's pool, not the replica: uncached prompt tokens it dispatched there that
    # have not produced a first token yet (what a new request would wait behind).
    pending_prefill_tokens: int = 0
    detail: str | None = None  # why unhealthy, for logs and /health
    # Engine counters (cumulative), for /metrics; 0 where the replica does not report them.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    restarts: int = 0
    # LoRA adapters the engine holds loaded (what adapter-affinity routing prefers), those its
    # running and waiting requests use, and its `max_loras` (0: no adapters reported).
    loras: frozenset[str] = frozenset()
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0
    # Speculative decoding's counters (`EngineState.spec_decode`); empty where the engine does not speculate.
    spec_decode: tuple[int, ...] = ()
    # Of `waiting`, those deferred for a reason of their own, not capacity (`EngineState.waiting_deferred`).
    waiting_deferred: int = 0
    # Of `waiting`, those preempted and back in the queue (`EngineState.waiting_preempted`).
    waiting_preempted: int = 0
    # Mixture-of-experts counters (`EngineState.moe_experts`); empty for a dense model.
    moe_experts: tuple[int, ...] = ()
    # The engine honours a request's `preempts` (tokenpath's own engines, in-process or over the
    # engine link): admission's share may pause a request running there. A URL replica cannot
    # (vLLM has no such call), so admission never preempts on one.
    can_preempt: bool = False

    @property
    def load(self) -> int:
        """Requests the replica holds right now (queued in the engine or running)."""
        return self.waiting + self.running
