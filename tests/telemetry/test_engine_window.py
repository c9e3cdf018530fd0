"""Per-window engine figures (`telemetry.engine_window`): a window's counters are the differences
from the sample at its start, its KV usage the mean and max of the samples inside it, and a
restarted engine counts from zero; `diagnose` reads them as the window's, not since start."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tokenpath.telemetry.diagnose import EngineFigures, diagnose
from tokenpath.telemetry.engine_window import EngineHistory


def figs(steps: int, step_s: float, seqs: float, pre: int, kv: float, up: float, name: str = "r0") -> EngineFigures:
    return EngineFigures(replica=name, max_num_seqs=8, steps=steps, step_seconds=step_s, seqs_scheduled=seqs,
                         preemptions=pre, kv_usage=kv, waiting=0, running=1, uptime_s=up,
                         tokens_scheduled=seqs * 2)


def history() -> EngineHistory:
    """A server started at t=1000; samples every 5 s from t=1005 (the counters grow 10 steps/s
    for the first 50 s, then stop; one preemption at t=1030)."""
    h = EngineHistory(sample_s=5.0)
    for i in range(1, 21):
        t = 1000 + 5 * i
        busy = min(t - 1000, 50)
        h.add(t, [figs(10 * busy, 0.05 * busy, 40 * busy, int(t >= 1030), 0.2 + 0.01 * i, t - 1000)])
    return h


def test_a_window_is_the_difference_from_the_sample_at_its_start():
    h = history()
    now = 1102.0
    current = [figs(500, 2.5, 2000, 1, 0.1, now - 1000)]
    (w,) = h.window(1040.0, now, current)  # the sample at 1040: 400 steps, 2.0 s, 1 preemption
    assert w.window_s == pytest.approx(62.0)
    assert (w.steps, w.step_seconds, w.seqs_scheduled, w.preemptions) == (100, pytest.approx(0.5), 400, 0)
    assert w.tokens_scheduled == 800
    assert w.kv_usage_max == pytest.approx(0.4) and 0.1 < w.kv_usage_mean < 0.4
    s = w.summary()
    assert s["mean_step_ms"] == pytest.approx(5.0) and s["mean_batch_seqs"] == pytest.approx(4.0)
    assert s["busy_fraction"] == pytest.approx(0.5 / 62, abs=1e-4)
    # Between samples: the newest one at or before the start (the window starts at most 5 s early).
    (w2,) = h.window(1043.0, now, current)
    assert w2.window_s == pytest.approx(62.0) and w2.steps == 100
    # Quiet lately: nothing in the last 5 s.
    (quiet,) = h.window(now - 1, now, [figs(500, 2.5, 2000, 1, 0.1, now - 1000)])
    assert quiet.steps == 0 and quiet.window_s < 6.0


def test_a_window_back_to_the_start_is_since_start_and_a_restart_counts_from_zero():
    h = history()
    now = 1102.0
    (whole,) = h.window(900.0, now, [figs(500, 2.5, 2000, 1, 0.1, now - 1000)])
    assert whole.steps == 500 and whole.window_s == pytest.approx(102.0)
    (restarted,) = h.window(1040.0, now, [figs(30, 0.1, 60, 0, 0.05, now - 1000)])  # counters went backwards
    assert restarted.steps == 30 and restarted.preemptions == 0
    fresh = h.window(1040.0, now, [figs(7, 0.01, 7, 0, 0.0, now - 1000, name="r1")])  # not in the samples
    assert fresh[0].steps == 7


def test_diagnose_speaks_of_the_window():
    h = history()
    now = 1102.0
    (w,) = h.window(1040.0, now, [figs(500, 2.5, 2000, 1, 0.1, now - 1000)])
    found = {f.kind: f for f in diagnose([], [w])}
    busy = found["engine_busy"]
    assert "of the last 62 s" in busy.figure and "mean step 5.0 ms" in busy.figure, busy.figure
    assert busy.evidence["window_s"] == pytest.approx(62.0) and busy.evidence["preemptions"] == 0
    assert "kv_pressure" not in found  # its one preemption was before the window
    (since_start,) = h.window(900.0, now, [figs(500, 2.5, 2000, 1, 0.1, now - 1000)])
    assert diagnose([], [since_start])[0].kind in ("engine_busy", "batches_not_forming", "kv_pressure")
    assert "kv_pressure" in {f.kind for f in diagnose([], [since_start])}
    hot = replace(w, kv_usage_max=0.95)
    assert "kv_pressure" in {f.kind for f in diagnose([], [hot])}


def test_expert_figures_are_windowed_and_a_scattered_batch_is_named():
    """A mixture of experts' counters are window differences like the others. Steps of 8 tokens
    (top-8 of 128 experts, 24 sparse layers) whose 64 rows per layer went to 60 experts: each
    expert read served ~1.07 rows, so `expert_scatter` names it; steps whose tokens shared their
    experts (rows per read 4) do not get it, nor does a dense model or a window of single tokens."""
    def moe(steps: int, reads_per_layer: float, tokens: float, up: float) -> EngineFigures:
        ls = steps * 24
        return replace(figs(steps, 0.05 * steps, steps, 0, 0.2, up), tokens_scheduled=tokens * steps,
                       moe_expert_rows=int(ls * tokens * 8), moe_experts_read=int(ls * reads_per_layer),
                       moe_busiest_expert_rows=ls * 3, moe_layer_steps=ls)

    h = EngineHistory(sample_s=5.0)
    h.add(1005.0, [moe(100, 8, 1, 5)])  # single tokens so far
    (w,) = h.window(1005.0, 1010.0, [moe(300, 60, 8, 10)])
    assert w.moe_layer_steps == 200 * 24 and w.moe_expert_rows == 300 * 24 * 64 - 100 * 24 * 8
    scattered = [f for f in diagnose([], [w]) if f.kind == "expert_scatter"]
    fig = moe(300, 60, 8, 10).experts()
    assert fig is not None and fig["expert_rows_per_read"] == pytest.approx(64 / 60, abs=1e-3)
    assert fig["busiest_expert_vs_mean"] == pytest.approx(3 / (64 / 60), abs=1e-3)
    (f,) = [f for f in diagnose([], [moe(300, 60, 8, 10)]) if f.kind == "expert_scatter"]
    assert f.evidence["experts_read_per_layer_step"] == 60 and "8.0 tokens" in f.figure
    assert scattered  # the window's figures say the same: its steps held (300 * 8 - 100) / 200 tokens
    engine_busy = next(f for f in diagnose([], [w]) if f.kind == "engine_busy")
    assert "expert_rows_per_read" in engine_busy.evidence
    assert not [f for f in diagnose([], [moe(300, 16, 8, 10)]) if f.kind == "expert_scatter"]  # 4 rows a read
    assert not [f for f in diagnose([], [moe(300, 8, 1, 10)]) if f.kind == "expert_scatter"]  # one token a step
    dense = figs(300, 15.0, 300, 0, 0.2, 10)
    assert dense.experts() is None and "expert_rows_per_read" not in dense.summary()
