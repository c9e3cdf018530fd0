"""Decode step time against the number of rows (sequences) in the step, on the native kernels:
does a mixture of experts gain less from batching than a dense model, enough that the scheduler's
token budget should cap its decode rows? (issue 36: "batching helps less when tokens scatter over
experts. Measure it, and let the scheduler's token budget reflect it if that pays.")

Each step decodes one token for each of N sequences that hold `--context` tokens of KV already
(prefilled once at the start, one sequence at a time), for N in --rows; every step writes the same
position again, so the attention work per row stays the same across steps and N values. Token ids
are drawn at random for each step (random routing, as a random-weight router gives anyway). The
rounds interleave the N values and each figure is the median step over all rounds: the machine is
shared. Printed per N: the step's milliseconds, tokens/s (N / step), the gain over N = 1, and the
experts each sparse layer read per step (the engine's own counters, `runner.moe_counters()`: the
weight bytes a step reads grow with that count, not with N), and the major page faults per step
(getrusage): a step that reads more of the file than the page cache keeps reads it from disk, and
on a shared machine that, not the kernels, is what a cliff in the curve is.

    PYTHONPATH=src nice -n 10 python benchmarks/moe_step_rows.py --model .cache/peers/qwen3moe-a128e8-24l-random.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
BS = 16  # NativeSteps' block size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / ".cache" / "peers" / "qwen3moe-a128e8-24l-random.Q4_K_M.gguf"))
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--context", type=int, default=64, help="tokens of KV each sequence holds")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per N per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    os.environ["TOKENPATH_NUM_THREADS"] = str(args.threads)

    from tests.engine.native_steps import NativeSteps

    from tokenpath.engine.loader import load_model

    rows = [int(n) for n in args.rows.split(",")]
    loaded = load_model(args.model)
    vocab = loaded.config.vocab_size
    per_seq = (args.context + 1 + BS - 1) // BS
    seqs = max(rows)
    steps = NativeSteps(loaded, "auto", num_blocks=seqs * per_seq, max_len=args.context + 1)
    runner = steps.runner
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(seqs)]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for table in tables:  # the context, one prefill per sequence
        steps.step([(table, rng.integers(1000, min(vocab, 40000), args.context).tolist(), 0)])
    print(f"prefilled {seqs} x {args.context} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    def step(n: int) -> float:
        chunks = [(tables[s], [int(rng.integers(1000, min(vocab, 40000)))], args.context) for s in range(n)]
        t = time.perf_counter()
        steps.step(chunks)
        return time.perf_counter() - t

    times: dict[int, list[float]] = {n: [] for n in rows}
    read: dict[int, list[float]] = {n: [] for n in rows}
    faults: dict[int, int] = {n: 0 for n in rows}
    for n in rows:
        step(n)  # warm-up: the first step at a width pages in what it reads
    for r in range(args.rounds):
        for n in rows if r % 2 == 0 else rows[::-1]:
            before, majflt = runner.moe_counters(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            times[n] += [step(n) for _ in range(args.steps)]
            after = runner.moe_counters()
            faults[n] += resource.getrusage(resource.RUSAGE_SELF).ru_majflt - majflt
            if before:  # experts read per sparse layer-step (counters: rows, read, busiest, layer-steps)
                read[n].append((after[1] - before[1]) / max(1, after[3] - before[3]))
        print(f"round {r + 1} done", file=sys.stderr)
    base = statistics.median(times[rows[0]])
    out = []
    print(f"model {Path(args.model).name}; context {args.context}; threads {args.threads}; "
          f"{args.rounds} rounds x {args.steps} steps; load average {os.getloadavg()[0]:.2f}")
    print("| rows | step ms (median) | tok/s | tok/s vs 1 row | step time vs 1 row | experts read per layer-step "
          "| major faults per step |\n|---|---|---|---|---|---|---|")
    for n in rows:
        ms = 1e3 * statistics.median(times[n])
        experts = statistics.mean(read[n]) if read[n] else float("nan")
        per_step = faults[n] / len(times[n])
        out.append({"rows": n, "step_ms": ms, "tok_s": n / ms * 1e3, "experts_read": experts, "major_faults": per_step})
        print(f"| {n} | {ms:.1f} | {n / ms * 1e3:.1f} | {n * base * 1e3 / ms:.2f}x | {ms / base / 1e3:.2f}x | "
              f"{experts:.1f} | {per_step:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": Path(args.model).name, "context": args.context,
                                               "threads": args.threads, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
