"""Each tenant's share of the dispatch slots while tenants compete (issue 41).

The fair queue (`queue.py`) orders what waits; it cannot take back a slot already running. So a
tenant that floods an idle deployment takes every slot, and another tenant's short request waits
for one of the flood's requests to end (in the slow-reader flood: 44-98 s). This module bounds
what one tenant holds while another wants slots: **weighted max-min fairness** over the
deployment's running slots (the replicas' batch sizes, not the engines' short waiting rooms, where
a request still waits for a running one to end).

- A tenant's **demand** is the slots it holds plus its requests queued. It is *active* while that
  is above zero, and for `active_s` after its demand last stood at its recent peak: a client that
  sends its next request a moment after its last one ended (a closed loop, an agent's next turn)
  keeps its place, rather than finding every slot retaken by the flood in between. (LiteLLM's
  dynamic rate limiter counts a project as active for its minute the same way.)
- Shares are filled like water: a tenant that wants less than its weighted share gets what it
  wants, and the rest is split among the others by weight. With one tenant active its share is
  every slot (work-conserving); a tenant that only lingers reserves no more than it just used.
- A tenant at or over its share gets **no new slot** while the others want theirs: its next
  request waits in the queue (others' requests pass it there) until one of its own slots ends or
  the others' demand falls. The README's "Tenant share of the slots" says why capping suffices
  for a tenant's *later* requests.
- Capping cannot take back what a tenant already holds: a tenant that flooded an idle deployment
  holds every running slot when another's first request comes. For that one, `over` names the
  tenants holding a whole running slot or more beyond their share, and admission pauses one of
  their requests in the engine for it (`preempt.py`).

Pure bookkeeping: no clock of its own (the caller passes `now`), no tasks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass
class _Recent:
    peak: int  # the most slots + queued requests the tenant wanted lately
    at: float  # the last time its demand stood at that peak (monotonic seconds)
    last: int  # its demand since the last change


class SlotShare:
    def __init__(self, weight: Callable[[str], float], active_s: float) -> None:
        self.weight = weight
        self.active_s = active_s
        self.held: Counter[str] = Counter()
        self._recent: dict[str, _Recent] = {}

    def take(self, tenant: str, queued: int, now: float) -> None:
        """`tenant` got a slot (`queued`: its requests still waiting after this one left)."""
        self.held[tenant] += 1
        self.note(tenant, queued, now)

    def give_back(self, tenant: str, queued: int, now: float) -> None:
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]
        self.note(tenant, queued, now)

    def note(self, tenant: str, queued: int, now: float) -> None:
        """The tenant's demand changed (a slot taken or given back, a request queued): its slots
        held plus `queued`, its requests waiting now."""
        current = self.held.get(tenant, 0) + queued
        recent = self._recent.get(tenant)
        if recent is None:
            self._recent[tenant] = _Recent(current, now, current)
            return
        if recent.last >= recent.peak:  # it stood at its peak until now
            recent.at = now
        if current >= recent.peak or now - recent.at > self.active_s:
            recent.peak, recent.at = current, now
        recent.last = current

    def demands(self, queued: Mapping[str, int], now: float) -> dict[str, int]:
        """Each active tenant's demand: held + queued, or its recent peak while that is fresh."""
        out: dict[str, int] = {}
        for tenant in set(self.held) | set(queued) | set(self._recent):
            current = self.held.get(tenant, 0) + queued.get(tenant, 0)
            recent = self._recent.get(tenant)
            if recent is not None and now - recent.at <= self.active_s:
                current = max(current, recent.peak)
            elif recent is not None and current == 0:
                del self._recent[tenant]  # idle past the window: forgotten
            if current > 0:
                out[tenant] = current
        return out

    def shares(self, capacity: int, demands: Mapping[str, int]) -> dict[str, float]:
        """Weighted max-min fair shares of `capacity` slots for these demands (water-filling)."""
        out: dict[str, float] = {}
        left, pending = float(capacity), dict(demands)
        while pending:
            level = left / sum(self.weight(t) for t in pending)  # slots per unit of weight
            satisfied = {t: d for t, d in pending.items() if d <= level * self.weight(t)}
            if not satisfied:
                out.update({t: level * self.weight(t) for t in pending})
                break
            for t, d in satisfied.items():
                out[t] = float(d)
                left -= d
                del pending[t]
        return out

    def allowance(self, capacity: Callable[[], int], queued: Mapping[str, int], now: float,
                  asking: str | None = None) -> Callable[[str], bool]:
        """Which tenants may take one more slot now: all of them while at most one is active
        (`capacity`, the running slots, is read only when shares are needed). `asking`: a tenant
        whose new request is not queued yet, counted in its demand."""
        if asking is not None:
            queued = Counter(queued)
            queued[asking] += 1
        demands = self.demands(queued, now)
        if len(demands) <= 1:
            return lambda tenant: True
        shares = self.shares(capacity(), demands)
        return lambda tenant: self.held.get(tenant, 0) < shares.get(tenant, 0.0)

    def over(self, capacity: Callable[[], int], queued: Mapping[str, int], now: float, asking: str | None = None,
             paused: Mapping[str, int] | None = None) -> dict[str, float]:
        """Tenants holding at least one whole running slot more than their share while others
        want slots, and by how much: whom a preemption may take a slot from (`preempt.py`).
        `paused`: per tenant, its requests paused now (held, but not running). A fraction over
        is not enough: the slot would only change hands, and the other would be a fraction over.
        `capacity` (the running slots) is read only when shares are needed, as in `allowance`."""
        if asking is not None:
            queued = Counter(queued)
            queued[asking] += 1
        demands = self.demands(queued, now)
        if len(demands) <= 1:
            return {}
        shares = self.shares(capacity(), demands)
        paused = paused or {}
        out: dict[str, float] = {}
        for tenant, held in self.held.items():
            excess = held - paused.get(tenant, 0) - shares.get(tenant, 0.0)
            if excess >= 1 - 1e-9:
                out[tenant] = excess
        return out

    def snapshot(self, capacity: int, queued: Mapping[str, int], now: float) -> dict[str, dict[str, float]]:
        """Per active tenant: slots held, demand and share (a held-back request's `admission_share`)."""
        demands = self.demands(queued, now)
        shares = self.shares(capacity, demands) if len(demands) > 1 else {t: float(capacity) for t in demands}
        return {t: {"held": self.held.get(t, 0), "demand": d, "share": round(shares.get(t, 0.0), 2)}
                for t, d in sorted(demands.items())}

