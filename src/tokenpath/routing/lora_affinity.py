"""Adapter affinity: which replicas a request with a LoRA adapter should go to.

A replica that already holds the adapter serves it without a load (the load is tens of ms from
disk, and takes one of its `max_loras` slots), so those are preferred (`lora_hit`). But a hot
adapter must not be pinned to the one replica that first loaded it (ray#65691): once the
holders are busier than the least loaded replica by `spread_threshold` (load-score units: 1.0 =
one full batch), the request goes to the least loaded replica that has a free slot, which loads
the adapter and becomes a second holder (`lora_spread`). An adapter no replica holds goes to the
least loaded replica with a free slot (`lora_cold`), so adapters spread over the replicas instead of
evicting each other on one. The picker's own policy (prefix affinity, ...) then chooses among the
candidates returned here.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenpath.protocol import ReplicaState
from tokenpath.protocol.lora import LoraRef

SPREAD_THRESHOLD = 0.5


def _load(s: ReplicaState) -> float:
    return (s.waiting + s.running) / (s.max_num_seqs or 8) + s.kv_usage


def _has_slot(s: ReplicaState) -> bool:
    """Room for one more adapter without evicting one that running requests use."""
    return not s.max_loras or len(set(s.running_loras)) < s.max_loras


def lora_candidates(lora: LoraRef | None, states: Sequence[ReplicaState],
                    spread_threshold: float = SPREAD_THRESHOLD) -> tuple[list[ReplicaState], str | None]:
    """(the replicas to choose among, the routing reason) for a request with this adapter;
    (states, None) without one."""
    if lora is None or len(states) < 2:
        return list(states), None if lora is None else "lora_only_replica"
    name = lora.name
    holders = [s for s in states if name in s.loras]
    least = min(_load(s) for s in states)
    roomy = [s for s in states if _has_slot(s)] or list(states)
    if not holders:
        low = min(_load(s) for s in roomy)
        return [s for s in roomy if _load(s) <= low + 1e-9], "lora_cold"
    best = min(_load(s) for s in holders)
    if best - least > spread_threshold:
        others = [s for s in roomy if name not in s.loras]
        if others:
            low = min(_load(s) for s in others)
            return [s for s in others if _load(s) <= low + 1e-9], "lora_spread"
    return holders, "lora_hit"
