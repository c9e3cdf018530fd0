"""The tenant share of the KV pool: whose sequence a KV preemption takes, and who a free slot goes
to first (issue 41: one request never hurts another).

The gateway's tenant share caps the running *slots* a tenant is given; the pool's *blocks* had no
such rule. When the pool ran short, the scheduler preempted the latest arrival, and in a flood the
latest arrival is always the other tenant's newest request: tenant B's short requests, arriving
while tenant A's 200 streams filled a 64 MiB pool, were preempted again and again and took 37-41 s,
all of it in decode (benchmarks/results/slow_reader_flood.md).

So each tenant is held to a fair share of the pool (its blocks over `num_blocks / tenants`):
- **Victim** (`victim`): among the lowest-priority running sequences (a higher-priority request is
  never preempted for a lower one), the latest arrival (`Sequence.victim_key`) of the tenant
  furthest over its share of the running tenants; today's rule when nobody is over.
- **Admission** (`admission_order`): within a priority band, waiting sequences of tenants over their
  share (counting the tenants running or waiting) go after the others, so B's request is admitted
  before A's preempted ones, which would otherwise go first and take back the blocks just freed.
  Waiting ones that took a slot from the gateway's share preemption (`displaces`) still go first.

One tenant (or none over its share) behaves exactly as without this module: its share is the whole
pool, which no tenant can exceed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Seqs

from tokenpath.engine.sequence import Sequence


def tenant_blocks(running: Iterable[Sequence]) -> Counter[str]:
    """Per tenant, the KV blocks its running sequences hold (a prefix block shared by two
    sequences counts for each: both would need it back after a preemption)."""
    held: Counter[str] = Counter()
    for seq in running:
        held[seq.tenant] += len(seq.block_table)
    return held


def over_share(held: Counter[str], tenants: int, num_blocks: int) -> dict[str, float]:
    """Per tenant over its fair share (`num_blocks / tenants`), by how many blocks (> 0 only)."""
    share = num_blocks / max(1, tenants)
    return {t: n - share for t, n in held.items() if n > share}


def victim(running: Seqs[Sequence], num_blocks: int) -> Sequence:
    """The sequence a short pool preempts: see the module docstring."""
    lowest = max(s.priority for s in running)
    band = [s for s in running if s.priority == lowest]
    held = tenant_blocks(running)
    over = over_share(held, len(held), num_blocks) if len(held) > 1 else {}
    over_in_band = {t: v for t, v in over.items() if any(s.tenant == t for s in band)}
    if over_in_band:
        worst = max(over_in_band, key=lambda t: (over_in_band[t], t))
        band = [s for s in band if s.tenant == worst]
    return max(band, key=Sequence.victim_key)


def admission_order(waiting: list[Sequence], running: Iterable[Sequence], num_blocks: int) -> list[Sequence]:
    """The waiting queue in the order admission tries it: `waiting` itself (already in
    `Scheduler._wait_key` order) unless tenants over their share wait beside others."""
    if not waiting:
        return waiting
    held = tenant_blocks(running)
    tenants = set(held) | {s.tenant for s in waiting}
    if len(tenants) < 2:
        return waiting
    over = over_share(held, len(tenants), num_blocks)
    if not over or all(s.tenant in over for s in waiting):
        return waiting
    # A stable sort: within each group the queue keeps its own order (preempted first, then the
    # gateway's dispatch order).
    return sorted(waiting, key=lambda s: (0 if s.displaces else 1, s.priority, 1 if s.tenant in over else 0))
