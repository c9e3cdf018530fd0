"""SmolLM2 single-stream decode, two source trees A/B: CPU time per generated token, and how much
of it runs outside the native forward (issue 42: the step loop around the kernels).

Why CPU time: the host's 2 cores are shared with other jobs, whose load stretches the wall clock
by 2-3x and not what this process spends. Each round is a child process per tree (A, B, then B, A: ABBA),
each timing `--reps` tg128 decodes (128 tokens after a 1-token prompt, greedy, as
engine_vs_llamacpp.py's tokenpath child) after a warm-up: the process's CPU time per token (all
kernel threads), the step thread's, and the step thread's outside `tp_model_forward` (the Python
step loop: scheduler, runner inputs, sampler, detokenizer, outputs). Wall time is printed too,
marked loaded. The children also print a digest of the greedy tokens and their logprobs (a run
with logprobs=1): the two trees must agree.

    python benchmarks/step_overhead_ab.py --a MAIN_SRC --b BRANCH_SRC [--rounds 5] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_ab import alternating, run_tree, warm_llm  # noqa: E402


def child(threads: int, reps: int) -> None:
    """One tree's figures, one JSON line."""
    os.environ["TOKENPATH_NUM_THREADS"] = str(threads)
    from tokenpath import SamplingParams

    llm, ids = warm_llm("smollm2-135m-instruct", 512)
    lib = llm.engine.runner.native.lib.lib
    forward, inside = lib.tp_model_forward, [0]

    def timed(*args: object) -> object:  # the step thread's CPU time inside the native forward
        t0 = time.thread_time_ns()
        try:
            return forward(*args)
        finally:
            inside[0] += time.thread_time_ns() - t0

    lib.tp_model_forward = timed
    rows = []
    for _ in range(reps):
        inside[0] = 0
        p0, t0, w0 = time.process_time_ns(), time.thread_time_ns(), time.perf_counter_ns()
        out = llm.generate([ids[:1]], SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True))
        step = time.thread_time_ns() - t0
        rows.append({"process_us": (time.process_time_ns() - p0) / 128e3, "thread_us": step / 128e3,
                     "outside_us": (step - inside[0]) / 128e3, "wall_us": (time.perf_counter_ns() - w0) / 128e3})
    toks = out[0].outputs[0].token_ids
    lp = llm.generate([ids[:1]], SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True, logprobs=1))
    lps = [(x.token_id, x.logprob, [(t, v) for t, _, v in x.top]) for x in lp[0].outputs[0].logprobs]
    res = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    res["digest"] = hashlib.sha1(repr((toks, lp[0].outputs[0].token_ids, lps)).encode()).hexdigest()[:12]
    print(json.dumps(res))


def run(src: str, threads: int, reps: int) -> dict:
    return run_tree(src, __file__, ["--child", str(threads), "--reps", str(reps)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", help="baseline tree's src folder (its kernels' .so inside)")
    ap.add_argument("--b", help="changed tree's src folder")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="tg128 decodes per child")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.reps)
    runs: dict[tuple[str, int], list[dict]] = {}
    loads = []
    for threads in args.threads:
        for r, name in alternating(args.rounds):  # (A, B then B, A: see tree_ab.py)
            loads.append(os.getloadavg()[0])
            res = run(getattr(args, name.lower()), threads, args.reps)
            runs.setdefault((name.upper(), threads), []).append(res)
            print(f"round {r + 1} {name.upper()} {threads}t: {res}", file=sys.stderr)
    print(f"1-min load average {min(loads):.1f}-{max(loads):.1f}")
    print("| threads | figure (µs per token) | A median | B median | B/A |")
    print("|---|---|---|---|---|")
    for threads in args.threads:
        a, b = runs[("A", threads)], runs[("B", threads)]
        for key in ("process_us", "thread_us", "outside_us", "wall_us"):
            ma, mb = statistics.median(x[key] for x in a), statistics.median(x[key] for x in b)
            label = key[:-3] + (" (loaded)" if key == "wall_us" else "")
            print(f"| {threads} | {label} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f} |")
        print(f"| {threads} | digest (tokens, logprobs) | {a[0]['digest']} | {b[0]['digest']} | "
              f"{'same' if {x['digest'] for x in a + b} == {a[0]['digest']} else 'DIFFERENT'} |")
    return None


if __name__ == "__main__":
    main()
