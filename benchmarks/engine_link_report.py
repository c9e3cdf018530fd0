"""The markdown table of `engine_link.py` from its results dict (kept apart so the measuring
script stays readable; nothing here measures).

A target counts as met only when the whole 95% interval of the paired median is on its side, not
met when the whole interval is on the other side, and unresolved otherwise: on a shared 2-core
box the pairs spread by more than the 1 ms the ITL target allows, and saying so is the result.
"""

from __future__ import annotations

import argparse
import os
import platform

ITL_TARGET_MS = 1.0
TOK_S_TARGET = 0.95


def _verdict(ci: tuple[float, float] | None, median: float, ok: float, higher_is_better: bool) -> str:
    lo, hi = ci if ci is not None else (median, median)
    good = lo >= ok if higher_is_better else hi <= ok
    bad = hi < ok if higher_is_better else lo > ok
    word = "met" if good else "not met" if bad else "unresolved"
    return word + ("" if ci is not None else " (median only: too few pairs for an interval)")


def _ci(ci: tuple[float, float] | None, fmt: str) -> str:
    return "n/a" if ci is None else f"{ci[0]:{fmt}} to {ci[1]:{fmt}}"


def render(results: dict, args: argparse.Namespace) -> str:
    levels = [(1, results["c1"]), (32, results["c32"])]
    loads = [p[m]["loadavg_1m"] for _, lv in levels for p in lv["pairs"] for m in ("in_process", "link")]
    runtime = results["setup"].get("runtime_s", 0.0)
    md = [f"# Engine link vs in-process engine ({platform.machine()}, {os.cpu_count()} CPUs)", "",
          f"SmolLM2-135M, CPU, 1 torch thread per engine, {args.prompt_tokens}-token prompts (fresh ones each "
          f"pair, no prefix-cache hits), {args.max_tokens} output tokens, max_num_seqs {args.max_num_seqs}; "
          f"{args.requests_c1} requests per round at c=1, {args.requests_c32} at c=32. Paired rounds: each pair "
          "runs the same prompts through both modes, alternating which goes first; the first "
          f"{args.warmup} pair(s) at each level warm up and are not shown. Run time {runtime / 60:.1f} min.", "",
          f"**Machine load**: 1-minute load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores "
          f"during the rounds{' (' + args.load_note + ')' if args.load_note else ''}. Time figures move with "
          "load; the CPU columns (work per output token, from /proc) much less.", "",
          f"## Targets: ITL p50 added by the link <= {ITL_TARGET_MS:g} ms, output tok/s within "
          f"{100 * (1 - TOK_S_TARGET):.0f}%", "",
          "Per pair: link minus in-process ITL p50, and link / in-process tok/s. Median over pairs, with a "
          "distribution-free 95% interval for that median (sign test); met only if the whole interval is.", "",
          "| concurrency | pairs | ITL p50 in-process (ms) | ITL p50 link (ms) | ITL added, paired median (ms) "
          "| 95% interval (ms) | interquartile (ms) | pairs link slower | tok/s link / in-process, paired median "
          "| 95% interval | ITL target | tok/s target |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, lv in levels:
        s = lv["summary"]
        md.append(f"| {c} | {s['n']} | {s['in_process_itl_p50_ms']:.2f} | {s['link_itl_p50_ms']:.2f} "
                  f"| **{s['itl_diff_median_ms']:+.2f}** | {_ci(s['itl_diff_ci_ms'], '+.2f')} "
                  f"| {s['itl_diff_iqr_ms'][0]:+.2f} to {s['itl_diff_iqr_ms'][1]:+.2f} | {s['link_slower']} of {s['n']} "
                  f"| **{s['tok_s_ratio_median']:.3f}** | {_ci(s['tok_s_ratio_ci'], '.3f')} "
                  f"| {_verdict(s['itl_diff_ci_ms'], s['itl_diff_median_ms'], ITL_TARGET_MS, False)} "
                  f"| {_verdict(s['tok_s_ratio_ci'], s['tok_s_ratio_median'], TOK_S_TARGET, True)} |")
    md += ["", "## CPU per output token (ms, median over pairs)", "",
           "In-process: the one process (its step thread, and the rest: event loop, delivery, the consumer). "
           "Link: the engine process (step thread, rest: its event loop and the link's framing) plus the "
           "gateway process (link client and the consumer). The step thread is each process's busiest thread.", "",
           "| concurrency | in-process step thread | in-process rest | in-process total | link engine step thread "
           "| link engine rest | link gateway | link total | link - in-process, paired median |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c, lv in levels:
        s = lv["summary"]
        md.append(f"| {c} | {s['in_process_cpu_step_ms_per_tok']:.3f} | {s['in_process_cpu_rest_ms_per_tok']:.3f} "
                  f"| {s['in_process_cpu_ms_per_tok']:.3f} | {s['link_cpu_step_ms_per_tok']:.3f} "
                  f"| {s['link_cpu_rest_ms_per_tok']:.3f} | {s['link_cpu_gateway_ms_per_tok']:.3f} "
                  f"| {s['link_cpu_ms_per_tok']:.3f} | {s['cpu_diff_median_ms']:+.3f} "
                  f"({s['cpu_diff_median_ms'] / s['in_process_cpu_ms_per_tok']:+.1%}) |")
    for c, lv in levels:
        md += ["", f"## Pairs at c={c}", "",
               "| pair | first | load | ITL p50 in-process (ms) | ITL p50 link (ms) | link - in-process (ms) "
               "| tok/s in-process | tok/s link | link / in-process | CPU ms/token in-process | CPU ms/token link "
               "(gateway + engine) | delivery p50 in-process (ms) | delivery p50 link (ms) |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, p in enumerate(lv["pairs"], 1):
            a, b = p["in_process"], p["link"]
            md.append(f"| {i} | {'link' if p['first'] == 'link' else 'in-process'} | {a['loadavg_1m']:.1f} "
                      f"| {a['itl_p50_ms']:.2f} | {b['itl_p50_ms']:.2f} | {b['itl_p50_ms'] - a['itl_p50_ms']:+.2f} "
                      f"| {a['tok_s']:.1f} | {b['tok_s']:.1f} | {b['tok_s'] / a['tok_s']:.3f} "
                      f"| {a['cpu_ms_per_tok']:.2f} | {b['cpu_ms_per_tok']:.2f} ({b['cpu_gateway_ms_per_tok']:.2f} + "
                      f"{b['cpu_step_ms_per_tok'] + b['cpu_rest_ms_per_tok']:.2f}) "
                      f"| {a['delivery_p50_ms']:.2f} | {b['delivery_p50_ms']:.2f} |")
    g = results["gateway_c32"]
    md += ["", "Delivery: from the engine's event (first token, finish) to the consumer holding the delta, "
           "both in the gateway's clock (the link's clock offset applied): what crossing the process "
           "boundary adds per delta, apart from how the two processes share the CPU.", "",
           f"Gateway stage (received -> admitted: HTTP parse, tokenize, admission) at concurrency 32 over "
           f"{g['n']} chat requests through the real app in front of the link replica: p50 "
           f"{g['gateway_p50_ms']:.1f} ms, p99 {g['gateway_p99_ms']:.1f} ms (request total p50 {g['total_p50_ms']:.0f} ms)."]
    return "\n".join(md) + "\n"
