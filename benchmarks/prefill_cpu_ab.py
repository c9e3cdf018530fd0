"""Whole-prefill CPU time of two source trees (two builds of the kernels), rounds interleaved.

Why: a kernel change's per-matrix gain (kquant_step_rows.py) is not the prefill's: attention,
norms, quantization and Python stay. Each round runs one process per tree (PYTHONPATH=TREE, so
each loads its own kernel objects), builds `LLM(model, quantization="auto")` as
engine_vs_llamacpp.py's child does, warms up, then times `reps` prefill steps per prompt length
(`generate` of an N-token prompt with max_tokens=1) in the process's CPU time, which a loaded
machine's other work does not enter. The trees alternate A, B, B, A, ... round by round.

    TOKENPATH_NUM_THREADS=1 python benchmarks/prefill_cpu_ab.py --model M.gguf --a OLD/src --b src \
        [--tokens 256,512] [--rounds 3] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(model: str, tokens: list[int], reps: int) -> None:
    """In the tree's process: one JSON line, {tokens: [CPU seconds per prefill]}."""
    from tokenpath import LLM, SamplingParams

    longest = max(tokens)
    llm = LLM(model, quantization="auto", dtype="float32", num_kv_blocks=(longest + 16) // 16 + 2,
              max_num_batched_tokens=longest, enable_prefix_caching=False)
    ids = [1000 + (i * 7919) % 40000 for i in range(longest)]  # as engine_vs_llamacpp.py's
    llm.generate([ids[:16]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    out: dict[int, list[float]] = {}
    for n in tokens:
        for _ in range(reps):
            t = time.process_time()
            llm.generate([ids[:n]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            out.setdefault(n, []).append(time.process_time() - t)
    print(json.dumps(out))


def run_tree(tree: str, args: argparse.Namespace) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--tokens", args.tokens, "--reps", str(args.reps)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return {int(n): statistics.median(v) for n, v in json.loads(out.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--a", help="the baseline tree (a src folder with its kernel objects built)")
    ap.add_argument("--b", help="the tree under test")
    ap.add_argument("--tokens", default="256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child:
        return child(args.model, tokens, args.reps)
    res: dict[str, list[dict[int, float]]] = {"a": [], "b": []}
    for i in range(args.rounds):
        for name in ("a", "b") if i % 2 == 0 else ("b", "a"):
            res[name].append(run_tree(getattr(args, name), args))
            print(f"round {i + 1} {name}: " + ", ".join(f"{n}: {s:.3f} s" for n, s in res[name][-1].items()),
                  file=sys.stderr)
    print("| tokens | rounds | A (s, median) | B (s, median) | per-round B / A | median B / A |")
    print("|---|---|---|---|---|---|")
    for n in tokens:
        a = [r[n] for r in res["a"]]
        b = [r[n] for r in res["b"]]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        print(f"| {n} | {args.rounds} | {statistics.median(a):.3f} | {statistics.median(b):.3f} | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
