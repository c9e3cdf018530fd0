"""Benchmark: what causes and diagnosis cost (issue 24's target: at most 2% throughput at c=32).

Measured as `tracing_overhead.py` measures tracing, and with its helpers: two `tokenpath serve`
processes, one with `--no-causes` (no causes derived for the trace, the audit row, the log line
and the spans; no engine-figure sampling for /diagnose) and one as shipped, both started once and
kept up; the same `tokenpath bench` load (c=32) sent to each in turn, a discarded warm-up round,
then pairs in ABBA order (off-on, on-off, ...). Beside throughput and TTFT, each server's CPU time
(/proc) per output token, which other load on the box moves far less than throughput.

`--no-causes` turns off what is done per request at its end and the sampler; the facts the
gateway and the engine note on the way (slot holders at admission, co-scheduled prefill chunks,
preemption culprits) are noted either way: a few list appends per request or per step, which
the per-request micro-benchmark below prices apart. Also reported: the CPU per request of deriving
one request's causes and the bytes they add to its audit row, with a realistic Timeline.

    .venv/bin/python benchmarks/causes_overhead.py                    # defaults: ~10 minutes on a quiet 2-core box
    .venv/bin/python benchmarks/causes_overhead.py --pairs 1 --num-requests 32 --out "$(mktemp -d)"  # smoke

Writes benchmarks/results/causes_overhead.md and .json (or into --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tracing_overhead import bench, serve, tree_cpu_s, write_results  # noqa: E402 - next to this script

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("off", "on")


def run_once(mode: str, server: tuple[subprocess.Popen, int], args: argparse.Namespace, out: Path, seed: int,
             warmup: int = 0) -> dict:
    before = tree_cpu_s(server[0].pid)
    s, client_cpu = bench(server[1], args, out, seed, warmup)
    after = tree_cpu_s(server[0].pid)
    toks = max(1, int(s["total_output_tokens"]))
    server_cpu = sum(after[k] - before[k] for k in ("server", "engine_procs"))
    return {"mode": mode, "output_tok_s": float(s["output_throughput"]), "ttft_p50_ms": float(s["ttft_ms"]["median"]),
            "completed": int(s["completed"]), "failed": int(s["failed"]), "output_tokens": toks,
            "server_cpu_ms_per_tok": 1000 * server_cpu / toks, "client_cpu_ms_per_tok": 1000 * client_cpu / toks,
            "loadavg_1m": os.getloadavg()[0]}


def per_request_cost(n: int = 5000) -> dict:
    """CPU per request of deriving its causes and of their JSON in the audit row's `timing`, and the
    bytes they add there: a request that queued behind others, had a prefill, and a slow gap."""
    from tokenpath.telemetry.record import FinishedRequest
    from tokenpath.telemetry.timeline import Timeline

    def one(i: int, on: bool) -> FinishedRequest:
        t = Timeline(f"chatcmpl-{i}")
        t0 = t.stamps["received"]
        for k, stage in enumerate(("body_read", "authenticated", "routed", "tokenized", "admitted", "dispatched",
                                   "scheduled", "first_token", "finished")):
            t.stamp(stage, at=t0 + 0.01 * (k + 1))
        t.attrs.update(replica="r0", policy="prefix_aware", reason="cold", admission="queued", admission_ahead=3,
                       admission_behind=[[f"r{j}", "acme", 256, "r0"] for j in range(8)], admission_freed_by="r7",
                       prefill_chunks=[(t0 + 0.07, 128)], body_bytes=900)
        times = [t0 + 0.08 + 0.01 * k + (0.05 if k == 20 else 0.0) for k in range(32)]
        return FinishedRequest(t, "/v1/chat/completions", 200, requested_model="m", model="m", prompt_tokens=128,
                               completion_tokens=32, finish_reasons=["length"], tenant="acme", token_times=times,
                               derive_causes=on)

    out = {}
    for on in (False, True):
        recs = [one(i, on) for i in range(n)]
        cpu0 = time.process_time()
        sizes = [len(json.dumps(r.timing_summary())) for r in recs]
        out["on" if on else "off"] = {"cpu_us_per_request": round(1e6 * (time.process_time() - cpu0) / n, 1),
                                      "timing_bytes": round(statistics.mean(sizes))}
    out["added_cpu_us_per_request"] = round(out["on"]["cpu_us_per_request"] - out["off"]["cpu_us_per_request"], 1)
    out["added_bytes_per_row"] = out["on"]["timing_bytes"] - out["off"]["timing_bytes"]
    return out


def report(meta: dict) -> str:
    a, pairs, micro = meta["args"], meta["pairs"], meta["per_request"]
    tput = [p["on"]["output_tok_s"] / p["off"]["output_tok_s"] for p in pairs]
    ttft = [p["on"]["ttft_p50_ms"] / p["off"]["ttft_p50_ms"] for p in pairs]
    cpu = [p["on"]["server_cpu_ms_per_tok"] / p["off"]["server_cpu_ms_per_tok"] for p in pairs]
    loads = [p[m]["loadavg_1m"] for p in pairs for m in MODES]
    lines = [f"# Causes and diagnosis on vs off (c={a['concurrency']})", "",
             f"Two `tokenpath serve` processes (`--no-causes`; as shipped), started once; a discarded warm-up run on "
             f"each, then {len(pairs)} pairs in ABBA order, each run {a['num_requests']} requests of "
             f"{a['input_len']} in / {a['output_len']} out tokens at c={a['concurrency']} (`tokenpath bench`), "
             f"SmolLM2-135M, {meta['machine']}. Runtime {meta['runtime_s'] / 60:.1f} min; 1-minute load average "
             f"{min(loads):.1f}-{max(loads):.1f}.", ""]
    if a["load_note"]:
        lines += [f"Machine load during the run: {a['load_note']}", ""]
    lines += ["| pair | order | off tok/s | on tok/s | on/off | off TTFT p50 ms | on TTFT p50 ms | "
              "server CPU ms/tok off | on |", "|---|---|---|---|---|---|---|---|---|"]
    for p, r in zip(pairs, tput, strict=True):
        off, on = p["off"], p["on"]
        lines.append(f"| {p['pair']} | {p['order']} | {off['output_tok_s']:.1f} | {on['output_tok_s']:.1f} | {r:.3f} | "
                     f"{off['ttft_p50_ms']:.0f} | {on['ttft_p50_ms']:.0f} | {off['server_cpu_ms_per_tok']:.2f} | "
                     f"{on['server_cpu_ms_per_tok']:.2f} |")
    med = statistics.median(tput)
    lines += ["", f"- Output throughput on / off: median **{med:.3f}** (cost {100 * (1 - med):+.1f}%; target <= 2%), "
                  f"mean {statistics.mean(tput):.3f} over {len(tput)} pairs: "
                  + ("too few pairs to say" if len(tput) < 4 else "**met**" if med >= 0.98 else "**not met**") + ".",
              f"- TTFT p50 on / off: median {statistics.median(ttft):.3f}.",
              f"- Server CPU per output token on / off: median {statistics.median(cpu):.3f}.",
              f"- Per request, measured alone: deriving its causes and writing them into the audit row's `timing` "
              f"costs {micro['added_cpu_us_per_request']} us of CPU and adds {micro['added_bytes_per_row']} bytes "
              f"to the row ({micro['off']['timing_bytes']} -> {micro['on']['timing_bytes']} bytes of `timing` JSON) "
              f"for a request queued behind 8 others with one slow token gap."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=10, help="measured on/off pairs, ABBA order (default 10)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--serve-args", default="", help="extra `tokenpath serve` arguments for both servers")
    p.add_argument("--load-note", default="", help="what else ran on the machine (printed under the table)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where causes_overhead.md/.json go (default results/)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tp-causes-bench-"))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    started = time.monotonic()
    try:
        micro = per_request_cost()
        print(json.dumps(micro), flush=True)
        extra = args.serve_args.split()
        servers["off"] = serve([*extra, "--no-causes"], tmp / "serve-off.log")
        servers["on"] = serve(extra, tmp / "serve-on.log")
        warm = [run_once(m, servers[m], args, tmp / f"warm-{m}.json", seed=999, warmup=4) for m in MODES]
        pairs = []
        for i in range(args.pairs):
            order = MODES if i % 2 == 0 else MODES[::-1]
            runs = {m: run_once(m, servers[m], args, tmp / f"bench-{i}-{m}.json", seed=1000 + i) for m in order}
            pairs.append({"pair": i, "order": "-".join(order), **runs})
            print(json.dumps({"pair": i, "order": pairs[-1]["order"]}
                             | {m: round(runs[m]["output_tok_s"], 1) for m in order}), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(60)
    meta = {"args": {k: v for k, v in vars(args).items() if k != "out"},
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "per_request": micro,
            "warm_up_discarded": warm, "pairs": pairs, "runtime_s": time.monotonic() - started}
    write_results(args.out, "causes_overhead", meta, report(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
