"""The flow-control queue: priority bands, and weighted fair queueing across tenants inside a band.

Bands are strict: a lower band number (a more important request) always leaves first, among the
tenants under their share of the slots (below). Inside a
band, tenants share by self-clocked fair queueing (SCFQ): a ticket's virtual finish tag is
`max(V, tenant's last tag) + cost / weight`, where V is the tag of the ticket that left last.
A tenant that floods the queue pushes only its *own* tags forward, so a light tenant's next
request gets a tag near V and leaves almost at once: one tenant's burst cannot starve another's
trickle. The cost is the request's token estimate (prompt + max_tokens), so fairness is in work,
not in request counts.

The order decides which request gets the next free slot, not how many slots a tenant holds: that
is the flow controller's share (`share.py`), which passes over a tenant at its share with
`peek_where` (the best ticket of another tenant, band by band: a share is a tenant's whatever the
priority of its requests, so a tenant cannot buy more than its share with `x-priority`).

The queue is a plain data structure (no tasks, no clock of its own): the flow controller pushes,
pops, removes cancelled tickets and expires deadlines. Removal is O(1) by marking; popped dead
entries are skipped lazily.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Ticket:
    """One queued request. `future` resolves with the dispatch decision (or an exception)."""

    request_id: str
    tenant: str
    band: int
    cost: float = 1.0
    deadline: float | None = None  # monotonic seconds
    payload: Any = None  # the GenerateRequest
    enqueued_at: float = field(default_factory=time.monotonic)
    finish_tag: float = 0.0
    seq: int = 0
    live: bool = True
    future: asyncio.Future | None = None


class FairQueue:
    def __init__(self, tenant_weights: dict[str, float] | None = None, default_weight: float = 1.0) -> None:
        self.tenant_weights = dict(tenant_weights or {})
        self.default_weight = default_weight
        self._heaps: dict[int, list[tuple[float, int, Ticket]]] = {}
        self._virtual: dict[int, float] = {}  # band -> V
        self._last_tag: dict[tuple[int, str], float] = {}  # (band, tenant) -> last finish tag
        self._depth: Counter[tuple[int, str]] = Counter()
        self._live = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._live

    def weight(self, tenant: str) -> float:
        return max(1e-6, self.tenant_weights.get(tenant, self.default_weight))

    def push(self, ticket: Ticket) -> Ticket:
        band = ticket.band
        v = self._virtual.get(band, 0.0)
        start = max(v, self._last_tag.get((band, ticket.tenant), 0.0))
        ticket.finish_tag = start + max(ticket.cost, 1e-9) / self.weight(ticket.tenant)
        ticket.seq = next(self._seq)
        ticket.live = True
        self._last_tag[(band, ticket.tenant)] = ticket.finish_tag
        heapq.heappush(self._heaps.setdefault(band, []), (ticket.finish_tag, ticket.seq, ticket))
        self._depth[(band, ticket.tenant)] += 1
        self._live += 1
        return ticket

    def _drop_dead_heads(self, band: int) -> None:
        heap = self._heaps[band]
        while heap and not heap[0][2].live:
            heapq.heappop(heap)

    def peek(self) -> Ticket | None:
        for band in sorted(self._heaps):
            self._drop_dead_heads(band)
            if self._heaps[band]:
                return self._heaps[band][0][2]
        return None

    def pop(self) -> Ticket | None:
        """The next ticket: best band first, smallest finish tag within it."""
        ticket = self.peek()
        if ticket is None:
            return None
        return self.take(ticket)

    def peek_where(self, allowed: Callable[[str], bool]) -> Ticket | None:
        """The next ticket whose tenant is `allowed` (a tenant at its share of the slots is not:
        `share.py`): the head when it is, else the best of the others, band by band. O(queued)
        only when the head is passed over."""
        for band in sorted(self._heaps):
            self._drop_dead_heads(band)
            heap = self._heaps[band]
            if heap and allowed(heap[0][2].tenant):
                return heap[0][2]
            best = min(((tag, seq, t) for tag, seq, t in heap if t.live and allowed(t.tenant)), default=None)
            if best is not None:
                return best[2]
        return None

    def take(self, ticket: Ticket) -> Ticket:
        """Take `ticket` (from `peek` or `peek_where`) out as leaving for a slot."""
        heap = self._heaps[ticket.band]
        if heap and heap[0][2] is ticket:
            heapq.heappop(heap)  # (else it stays in the heap, dead, and is skipped later)
        self._virtual[ticket.band] = max(self._virtual.get(ticket.band, 0.0), ticket.finish_tag)
        self._mark_gone(ticket)
        return ticket

    def remove(self, ticket: Ticket) -> bool:
        """Take a ticket out (client gone, deadline passed). False if it already left."""
        if not ticket.live:
            return False
        self._mark_gone(ticket)
        return True

    def _mark_gone(self, ticket: Ticket) -> None:
        ticket.live = False
        self._live -= 1
        key = (ticket.band, ticket.tenant)
        self._depth[key] -= 1
        if self._depth[key] <= 0:
            del self._depth[key]
            if not self._depth_in_band(ticket.band):
                self._reset_band(ticket.band)

    def _depth_in_band(self, band: int) -> int:
        return sum(n for (b, _), n in self._depth.items() if b == band)

    def _reset_band(self, band: int) -> None:
        """An idle band forgets its history, so tags (floats) never grow without bound."""
        self._heaps[band] = []
        self._virtual[band] = 0.0
        for key in [k for k in self._last_tag if k[0] == band]:
            del self._last_tag[key]

    def expired(self, now: float | None = None) -> list[Ticket]:
        """Remove and return every live ticket whose deadline has passed."""
        now = time.monotonic() if now is None else now
        out = [t for heap in self._heaps.values() for _, _, t in heap
               if t.live and t.deadline is not None and t.deadline <= now]
        for t in out:
            self.remove(t)
        return out

    def ahead_of(self, band: int, tenant: str | None = None) -> int:
        """Live tickets that would leave before a new ticket in `band`. Without a `tenant`, the
        whole band (an upper bound within it). For a tenant, those of more important bands and, in
        its own band, those whose finish tag is at most the tag its next ticket would start from:
        under SCFQ another tenant's flood pushed only its own tags forward, so it is not ahead of
        this tenant's next request (the admission check's predicted wait refused a light tenant's
        request for a flood it would have passed; issue 41). O(tickets in the band) then."""
        before = sum(n for (b, _), n in self._depth.items() if b < band)
        if tenant is None:
            return before + self._depth_in_band(band)
        if not self._depth_in_band(band):
            return before
        start = max(self._virtual.get(band, 0.0), self._last_tag.get((band, tenant), 0.0))
        return before + sum(1 for tag, _, t in self._heaps.get(band, ()) if t.live and tag <= start)

    def depth(self) -> dict[tuple[int, str], int]:
        """Live tickets per (band, tenant): what /metrics exports as queue depth."""
        return dict(self._depth)

    def tenant_depth(self, tenant: str) -> int:
        return sum(n for (_, t), n in self._depth.items() if t == tenant)

    def tenant_depths(self) -> Counter[str]:
        """Live tickets per tenant, all bands together."""
        out: Counter[str] = Counter()
        for (_, tenant), n in self._depth.items():
            out[tenant] += n
        return out
