"""Engine step series (step time, batch size in sequences and in tokens), kept by the engine itself.

Every engine, in the gateway's process or in a `tokenpath engine` process, counts its own steps
into cumulative histograms here (a few list increments per step, on the step thread). The
gateway reads them at scrape time, the same way whatever the engine's process: an in-process
replica reads its engine's `StepStats` directly, an engine-link replica reads the snapshot its
engine pushes with every state frame. Cumulative counts, not per-step samples, cross the link:
a lost or late state frame loses nothing, and the frame stays ~100 bytes whatever the step rate.

`/metrics` turns the snapshots into histograms named as vLLM names them, labelled by model and
replica (`metrics.EngineStepCollector`).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client.utils import floatToGoString

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)
BATCH_SEQS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# snapshot key -> (series name after the `tokenpath:` prefix, help, buckets)
SERIES: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "time": ("engine_step_seconds", "Wall time of one engine step (schedule, forward, sample).", STEP_BUCKETS),
    "seqs": ("iteration_seqs", "Sequences scheduled per engine step (batch size).", BATCH_SEQS_BUCKETS),
    "tokens": ("iteration_tokens_total", "Tokens scheduled per engine step.", BATCH_TOKENS_BUCKETS),
}

# The sparse layers' cumulative counters (`EngineState.moe_experts`, in this order: csrc/moe.h and
# engine/models/moe.py count them), as /metrics names them after the `tokenpath:` prefix.
MOE_COUNTERS: tuple[tuple[str, str], ...] = (
    ("moe_expert_rows", "(token, expert) pairs the sparse layers routed: tokens x top-k, per layer."),
    ("moe_experts_read", "Experts whose weights a sparse layer read (those that got a token), summed over "
                         "layer-steps."),
    ("moe_busiest_expert_rows", "Rows of each layer-step's busiest expert, summed over layer-steps."),
    ("moe_layer_steps", "Sparse layer-steps: engine steps times sparse layers."),
)


class CumulativeHistogram:
    """Per-bucket counts (the last one is +Inf) and the sum: Prometheus' histogram, without a lock
    (one writer, the step thread; a reader may see a step half-counted, never a wrong total later)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1  # first bucket with value <= le
        self.sum += value

    def snapshot(self) -> list:
        return [list(self.counts), self.sum]


class StepStats:
    """One engine's step histograms; `observe` has the signature of `EngineCore.step_observers`."""

    def __init__(self) -> None:
        self.hists = {key: CumulativeHistogram(buckets) for key, (_, _, buckets) in SERIES.items()}

    def observe(self, scheduled: list[tuple[Any, int]], started: float, ended: float) -> None:
        self.hists["time"].observe(ended - started)
        self.hists["seqs"].observe(len(scheduled))
        self.hists["tokens"].observe(sum(n for _, n in scheduled))

    def snapshot(self) -> dict[str, list]:
        """Plain lists and floats: what the engine link's state frame carries."""
        return {key: h.snapshot() for key, h in self.hists.items()}


def prometheus_buckets(key: str, snapshot: list) -> tuple[list[tuple[str, float]], float]:
    """A snapshot's per-bucket counts as Prometheus' cumulative `le` buckets, and its sum.
    A snapshot whose shape does not match the buckets (an engine of another version) is skipped."""
    buckets = SERIES[key][2]
    counts, total = snapshot
    if len(counts) != len(buckets) + 1:
        raise ValueError(f"step histogram '{key}' has {len(counts)} buckets, expected {len(buckets) + 1}")
    out, running = [], 0
    for le, n in zip((*[floatToGoString(b) for b in buckets], "+Inf"), counts, strict=True):
        running += int(n)
        out.append((le, float(running)))
    return out, float(total)
