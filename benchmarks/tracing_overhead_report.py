"""The markdown report of benchmarks/tracing_overhead.py, from its json (kept apart so the
script stays short; `python benchmarks/tracing_overhead_report.py results/tracing_overhead.json`
re-renders a saved run)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

PROCS = (("server", "`tokenpath serve` (the gateway; the engine too when in-process)"), ("engine_procs", "engine processes"),
         ("bench_client", "bench client"), ("receiver", "OTLP receiver (a collector; elsewhere in production)"))


_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20,
        12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13}  # Student's t, two-sided 95%, by degrees of freedom


def _fmt(xs: list[float], digits: int = 3) -> str:
    return ", ".join(f"{x:.{digits}f}" for x in xs)


def _mean_ci(xs: list[float]) -> str:
    """`mean +- half-width of its 95% confidence interval` (pairs taken as independent)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:.3f}"
    return f"{m:.3f} +- {_T95.get(len(xs) - 1, 2.0) * statistics.stdev(xs) / len(xs) ** 0.5:.3f} (95% CI)"


def report(meta: dict) -> str:
    a, pairs, micro = meta["args"], meta["pairs"], meta["span_cost"]
    tput = [p["on"]["output_tok_s"] / p["off"]["output_tok_s"] for p in pairs]
    ttft = [p["on"]["ttft_p50_ms"] / p["off"]["ttft_p50_ms"] for p in pairs]
    # Per mode, CPU over all its measured runs / their output tokens: a run's last span export
    # (up to 5 s after it) may land in the next run's window, never outside the total.
    toks = {m: sum(p[m]["output_tokens"] for p in pairs) for m in ("off", "on")}
    cpu = {m: {k: sum(p[m]["cpu_ms_per_tok"][k] * p[m]["output_tokens"] for p in pairs) / toks[m] for k, _ in PROCS}
           for m in ("off", "on")}
    spans = sum(p["on"]["spans_received"] for p in pairs)
    requests = sum(p["on"]["completed"] + p["on"]["failed"] for p in pairs)
    def server_side(run: dict) -> float:  # the serve process and its engine processes, if any
        return run["cpu_ms_per_tok"]["server"] + run["cpu_ms_per_tok"]["engine_procs"]

    srv_ratio = [server_side(p["on"]) / server_side(p["off"]) for p in pairs]
    loads = [p[m]["loadavg_1m"] for p in pairs for m in ("off", "on")]
    lines = [f"# Tracing on vs off (c={a['concurrency']})", "",
             f"Two `tokenpath serve` processes (tracing off; tracing on, `--otlp-endpoint` to a receiver process "
             f"that decodes every export), started once. A discarded warm-up run on each, then {len(pairs)} pairs "
             f"in ABBA order (off-on, on-off, ...), each run {a['num_requests']} requests of {a['input_len']} in / "
             f"{a['output_len']} out tokens at c={a['concurrency']} (`tokenpath bench`), SmolLM2-135M, "
             f"{meta['machine']}{', serve args `' + a['serve_args'] + '`' if a['serve_args'] else ''}. "
             f"Runtime {meta['runtime_s'] / 60:.1f} min; 1-minute load average {min(loads):.1f}-{max(loads):.1f}.", ""]
    if a["load_note"]:
        lines += [f"Machine load during the run: {a['load_note']}", ""]
    lines += ["| pair | order | off tok/s | on tok/s | on/off | off TTFT p50 ms | on TTFT p50 ms | on/off | "
              "server-side CPU ms/tok off | on |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p, r, t in zip(pairs, tput, ttft, strict=True):
        off, on = p["off"], p["on"]
        lines.append(f"| {p['pair']} | {p['order']} | {off['output_tok_s']:.1f} | {on['output_tok_s']:.1f} | {r:.3f} "
                     f"| {off['ttft_p50_ms']:.0f} | {on['ttft_p50_ms']:.0f} | {t:.3f} "
                     f"| {server_side(off):.2f} | {server_side(on):.2f} |")
    first = [r for p, r in zip(pairs, tput, strict=True) if p["order"] == "off-on"]
    second = [r for p, r in zip(pairs, tput, strict=True) if p["order"] == "on-off"]
    lines += ["", f"- Output throughput on / off per pair: {_fmt(tput)}; **median {statistics.median(tput):.3f}, "
                  f"mean {_mean_ci(tput)}** (cost {100 * (1 - statistics.median(tput)):+.1f}% / "
                  f"{100 * (1 - statistics.mean(tput)):+.1f}%). Off-on pairs mean {statistics.mean(first):.3f}, "
                  f"on-off pairs mean {statistics.mean(second) if second else float('nan'):.3f} (their gap is the "
                  f"order effect the ABBA order cancels)."
              if first else "",
              f"- TTFT p50 on / off per pair: {_fmt(ttft)}; median {statistics.median(ttft):.3f}, "
              f"mean {_mean_ci(ttft)}.",
              f"- Server-side CPU (serve + engine processes) per output token on / off per pair: {_fmt(srv_ratio)}; median "
              f"**{statistics.median(srv_ratio):.3f}**, mean {_mean_ci(srv_ratio)}.",
              f"- Spans received from the tracing-on server: {spans} for {requests} requests.",
              "", "CPU per output token, per process (ms of CPU time from /proc, over all measured runs of "
              "each mode):", "", "| process | off | on | on - off | on / off |", "|---|---|---|---|---|"]
    for k, label in PROCS:
        off, on = cpu["off"][k], cpu["on"][k]
        if k == "engine_procs" and off == on == 0:  # in-process engine: none
            continue
        lines.append(f"| {label} | {off:.3f} | {on:.3f} | {on - off:+.3f} | "
                     f"{on / off if off else float('nan'):.3f} |")
    span_per_tok = micro["cpu_ms_per_request"] / a["output_len"]
    srv_off = cpu["off"]["server"] + cpu["off"]["engine_procs"]
    lines += ["", f"Span building + OTLP export measured alone ({micro['requests']} requests, {micro['spans']} "
                  f"spans received): **{micro['cpu_ms_per_request']:.3f} ms CPU per request**, "
                  f"{span_per_tok:.3f} ms per output token here, {100 * span_per_tok / srv_off:.2f}% of the "
                  f"tracing-off server's CPU per token.",
              "", "Warm-up runs (discarded): " + ", ".join(
                  f"{w['mode']} {w['output_tok_s']:.1f} tok/s" for w in meta["warm_up_discarded"]) + "."]
    return "\n".join(x for x in lines if x is not None) + "\n"


if __name__ == "__main__":
    print(report(json.loads(Path(sys.argv[1]).read_text())), end="")
