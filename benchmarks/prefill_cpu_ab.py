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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_ab import alternating, run_tree, warm_llm  # noqa: E402


def child(model: str, tokens: list[int], reps: int) -> None:
    """In the tree's process: one JSON line, {tokens: [CPU seconds per prefill]}."""
    from tokenpath import SamplingParams

    llm, ids = warm_llm(model, max(tokens))
    out: dict[int, list[float]] = {}
    for n in tokens:
        for _ in range(reps):
            t = time.process_time()
            llm.generate([ids[:n]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            out.setdefault(n, []).append(time.process_time() - t)
    print(json.dumps(out))


def medians(tree: str, args: argparse.Namespace) -> dict[int, float]:
    out = run_tree(tree, __file__, ["--child", "--model", args.model, "--tokens", args.tokens, "--reps", str(args.reps)])
    return {int(n): statistics.median(v) for n, v in out.items()}


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
    for i, name in alternating(args.rounds):
        res[name].append(medians(getattr(args, name), args))
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
