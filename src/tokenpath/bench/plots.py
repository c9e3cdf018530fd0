"""`--plot DIR`: PNGs of a run. CDFs show tails a mean hides; the stacked bars show which stage
dominates (server stages where the target reports them, else the client's TTFT / decode split)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tokenpath.bench.runner import RunResult
from tokenpath.telemetry.timeline import PATH_STAGES as SERVER_STAGES


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers or in CI
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms, dtype=float))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)


def plot_cdfs(results: Sequence[RunResult], out: Path) -> list[Path]:
    plt = _plt()
    paths = []
    for metric, title in (("ttft", "TTFT"), ("itl", "ITL")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in results:
            ok = [rec for rec in r.records if rec.success]
            vals = [rec.ttft * 1000 for rec in ok if rec.ttft is not None] if metric == "ttft" else \
                [g * 1000 for rec in ok for g in rec.itl]
            _cdf(ax, vals, f"{r.target.name} {r.load.label()}")
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "token gaps"))
        ax.set_title(f"{title} CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = out / f"{metric}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _load_x(r: RunResult) -> float:
    return r.load.rate if r.load.rate is not None else float(r.load.concurrency or 1)


def plot_sweep(results: Sequence[RunResult], out: Path) -> Path | None:
    """Throughput and TTFT against offered load, one line per target; only for a sweep."""
    if len({r.load for r in results}) < 2:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
    for n, name in enumerate(dict.fromkeys(r.target.name for r in results)):
        rs = sorted((r for r in results if r.target.name == name), key=_load_x)
        xs = [_load_x(r) for r in rs]
        color = f"C{n}"
        a1.plot(xs, [r.summary.output_throughput for r in rs], marker="o", color=color, label=name)
        a2.plot(xs, [r.summary.ttft_ms.median or np.nan for r in rs], marker="o", color=color, label=f"{name} p50")
        a2.plot(xs, [r.summary.ttft_ms.p99 or np.nan for r in rs], marker="x", linestyle="--", color=color,
                label=f"{name} p99")
    is_rate = all(r.load.rate is not None for r in results)
    for ax in (a1, a2):
        ax.set_xlabel("request rate (req/s)" if is_rate else "concurrency")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    a1.set_ylabel("output tokens/s")
    a1.set_title("throughput vs load")
    a2.set_ylabel("TTFT (ms)")
    a2.set_yscale("log")
    a2.set_title("TTFT vs load")
    path = out / "throughput_vs_load.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_stages(results: Sequence[RunResult], out: Path) -> Path:
    plt = _plt()
    labels, rows = [], []
    for r in results:
        sm = r.summary.server_ms
        labels.append(f"{r.target.name}\n{r.load.label()}")
        if sm:
            row = {f"server {k}": (sm.get(k) or {}).get("mean") or 0.0 for k in SERVER_STAGES}
            # What the server's own clock does not see (HTTP, SSE, the client), so bar heights = E2EL.
            row["outside server (E2EL - server total)"] = max(
                0.0, (r.summary.e2el_ms.mean or 0.0) - ((sm.get("total") or {}).get("mean") or sum(row.values())))
            rows.append(row)
        else:
            ttft, e2el = r.summary.ttft_ms.mean or 0.0, r.summary.e2el_ms.mean or 0.0
            rows.append({"client TTFT": ttft, "client decode (E2EL-TTFT)": max(0.0, e2el - ttft)})
    keys = list(dict.fromkeys(k for row in rows for k in row))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 5))
    bottom = np.zeros(len(labels))
    for k in keys:
        vals = np.array([row.get(k, 0.0) for row in rows])
        ax.bar(labels, vals, bottom=bottom, label=k, hatch=None if k.startswith("server") else "//")
        bottom += vals
    ax.set_ylabel("mean latency per request (ms)")
    ax.set_title("where the time goes")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    path = out / "stages.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: Sequence[RunResult], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = plot_cdfs(results, out)
    if (p := plot_sweep(results, out)) is not None:
        paths.append(p)
    paths.append(plot_stages(results, out))
    return paths
