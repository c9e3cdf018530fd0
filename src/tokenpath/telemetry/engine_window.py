"""Engine figures over a window, not since start: what `tokenpath diagnose --since 10m` (and
`GET /diagnose`) says about the engines is about the same ten minutes as the audit rows it reads.

An engine's own counters are cumulative (steps, step seconds, sequences and tokens scheduled,
preemptions, prefix-cache queries and hits: `telemetry.engine_steps` and its state), so a window's
figures are the counters now minus the counters at the window's start. `EngineHistory` keeps a
sample of every replica's counters every `SAMPLE_S` seconds for `KEEP_S` (one small record per
replica per sample: ~1,400 per replica at the defaults), and answers a window with the newest
sample taken at or before its start, so a window starts at most `SAMPLE_S` early (and
`window_s` says exactly what it covers). KV usage is a gauge: its mean and maximum over the
samples inside the window come with it. A replica whose counters went backwards (its engine was
restarted) counts from zero since the restart; one older than the history counts from the oldest
sample.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from tokenpath.telemetry.diagnose import MOE_FIELDS, EngineFigures

SAMPLE_S = 5.0
KEEP_S = 2 * 3600.0
_COUNTERS = ("steps", "step_seconds", "seqs_scheduled", "tokens_scheduled", "preemptions",
             "prefix_cache_queries", "prefix_cache_hits", *MOE_FIELDS)


class EngineHistory:
    """Samples of every replica's cumulative figures (one writer: the app's sampler task)."""

    def __init__(self, sample_s: float = SAMPLE_S, keep_s: float = KEEP_S) -> None:
        self.sample_s = sample_s
        self.samples: deque[tuple[float, dict[str, EngineFigures]]] = deque(maxlen=int(keep_s / sample_s) + 1)

    def add(self, now: float, figures: list[EngineFigures]) -> None:
        self.samples.append((now, {e.replica: e for e in figures}))

    def window(self, since: float, now: float, current: list[EngineFigures]) -> list[EngineFigures]:
        """Each replica's figures over [since, now] (wall seconds): counters as differences, KV usage
        as the mean and maximum of the samples in the window and now. `current` holds the counters
        now, with `uptime_s` the seconds since the server started."""
        started = now - max((e.uptime_s for e in current), default=0.0)
        base_t, base = started, {}  # a window reaching back to the start: the counters as they are
        if since > started:
            for t, figs in self.samples:  # the newest sample at or before `since`, else the oldest
                if t > since and base:
                    break
                base_t, base = t, figs
        out = []
        for e in current:
            b = base.get(e.replica)
            if b is not None and e.steps < b.steps:  # restarted since: its counters began again at zero
                b = None
            kv = [figs[e.replica].kv_usage for t, figs in self.samples if t >= base_t and e.replica in figs]
            kv.append(e.kv_usage)
            delta = {k: getattr(e, k) - (getattr(b, k) if b is not None else 0) for k in _COUNTERS}
            out.append(replace(e, **delta, window_s=round(max(1e-9, now - base_t), 3),
                               kv_usage_mean=round(sum(kv) / len(kv), 4), kv_usage_max=round(max(kv), 4)))
        return out
