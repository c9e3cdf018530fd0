"""Preemption for the tenant share: an under-share tenant's request takes a running slot back from
a tenant over its share (issue 41).

The share (`share.py`) caps what a tenant is *given*; it cannot take back what a tenant already
holds. A tenant that flooded an idle deployment holds every running slot, and another tenant's
first request then waited for one of the flood's requests to end: 54-59 s in the slow-reader flood
(its socket filling, then the stall bound), however short the request. vLLM and SGLang answer a
full batch the same way at the KV level: preempt the lowest-priority, latest request by recompute.

So admission decides "request X yields its running slot to Y", once, where the share is known:
- **When:** Y is being dispatched (at once, or from the head of the queue while no replica has
  room) and no replica it may go to has a running slot free; its tenant is under its share (the
  share's allowance already said so), and another tenant holds at least one whole running slot
  more than its own share (`SlotShare.over`, with its paused requests not counted as running).
- **Who:** among that tenant's running requests on a replica whose engine can pause one
  (`ReplicaState.can_preempt`: tokenpath's own; a URL replica cannot), the tenant furthest over
  its share first, then the lowest priority (the highest number), then the most recently
  dispatched (the least work to recompute). Only a request that has produced a token is known
  to be running; one still in an engine's queue holds no running slot, and pausing it frees none.
- **How:** Y goes to X's replica with `GenerateRequest.preempts = X`, past the room check (the
  slot is X's, not a new one). The engine pauses X by recompute (its KV freed, back to the front
  of its band, its stream silent meanwhile, resumed where it stopped with no token lost or
  repeated) and runs Y in its place (`Scheduler.displace`). X resumes when a slot frees; its
  gateway slot stays held (it is still X's tenant's request), so its tenant gets nothing new
  while over its share.

The Timeline says it on both sides: X's `admission_paused` (by whom, which tenant) beside the
engine's own preemption record naming Y (its `preempted` cause), and Y's `admission_preempted`
(whose slot dispatched it). Pure bookkeeping, no I/O: the controller (`controller.py`) calls it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Protocol


class Holder(Protocol):
    """What the victim choice reads of a slot holder (`controller.Admission`)."""

    request_id: str
    tenant: str
    priority: int
    dispatched_at: float
    first_token_seen: bool
    preemptible: bool  # a generation (an embedding is one short step: never worth pausing)
    paused_by: str | None  # the request it yielded its running slot to, until it resumes
    paused_at: float  # when (monotonic, this process)

    @property
    def replica(self) -> str: ...


def paused(holders: Iterable[Holder]) -> Counter[str]:
    """Per tenant, its requests paused now: they hold a gateway slot but no running one."""
    return Counter(h.tenant for h in holders if h.paused_by is not None)


def paused_on(holders: Iterable[Holder], replica: str) -> int:
    return sum(1 for h in holders if h.paused_by is not None and h.replica == replica)


def choose_victim(holders: Iterable[Holder], over: Mapping[str, float], replicas: Collection[str]) -> Holder | None:
    """The running request to pause (the module docstring's rule), or None when there is none.
    `over`: tenant -> running slots held beyond its share (only tenants at least one over);
    `replicas`: those whose engine can pause a request and that the taker may go to."""
    best: Holder | None = None
    best_key: tuple[float, int, float] | None = None
    for h in holders:
        excess = over.get(h.tenant)
        if excess is None or h.paused_by is not None or not h.first_token_seen or not h.preemptible:
            continue
        if h.replica not in replicas:
            continue
        key = (excess, h.priority, h.dispatched_at)
        if best_key is None or key > best_key:
            best, best_key = h, key
    return best


def resumed(holder: Holder, engine_preempted: Any) -> bool:
    """Whether a paused request runs again: the engine closed a preemption record of it after the
    pause (`EngineEvents.preempted`, in this process's clock: [at, by whom, tokens, recomputed
    at]). Any record, not only the one naming its taker: a request the KV pool had preempted
    already when the pause came was not paused again, and runs again when that record closes."""
    if not isinstance(engine_preempted, list):
        return False
    return any(isinstance(r, list | tuple) and len(r) >= 4 and isinstance(r[3], int | float)
               and r[3] >= holder.paused_at for r in engine_preempted)
