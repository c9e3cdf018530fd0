"""Whole native decode steps of two kernel builds, A/B in one process: interleaved rounds, one thread.

Why: on a shared machine two runs minutes apart see different loads, so a kernel change's effect
on a decode step (10-20%) drowns in the noise. Here both builds (each a folder holding its
_native_* objects, e.g. a copy of main's) load into the same process, each drives its own native
runner over the same model, the rounds alternate their order, and each step is timed by the
calling thread's CPU time (run with TOKENPATH_NUM_THREADS=1, pinned by taskset). The first steps'
logits are compared bit for bit, so a change that should not move any bit is checked as well.

    TOKENPATH_NUM_THREADS=1 taskset -c 1 python benchmarks/forward_ab.py --model M.gguf \\
        --base BASE_DIR --new src/tokenpath/engine/kernels
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--base", required=True, help="folder with the baseline build's kernel objects")
    ap.add_argument("--new", required=True, help="folder with the other build's kernel objects")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round (positions 1..steps)")
    args = ap.parse_args()

    from tests.engine.native_steps import NativeSteps

    from tokenpath.engine import kernels as K
    from tokenpath.engine.kernels import model as kmodel
    from tokenpath.engine.loader import load_model

    loaded = load_model(args.model)
    blocks = (args.steps + 16) // 16 + 1
    table = list(range(blocks))
    runs = {}
    for name, folder in (("base", args.base), ("new", args.new)):
        lib = K.load_library(Path(folder).resolve())
        if lib is None:
            raise SystemExit(f"no kernel objects load from {folder}")
        # The runner takes the process's library when it is built: each gets its own.
        K.native_library = kmodel.native_library = lambda lib=lib: lib  # type: ignore[method-assign]
        runs[name] = NativeSteps(loaded, "auto", num_blocks=blocks, max_len=args.steps + 16)
    logits = {}
    for name, ns in runs.items():
        logits[name] = np.stack([ns.step([(table, [1000 + p], p)]).numpy().copy() for p in range(6)])
    same = np.array_equal(logits["base"].view(np.uint32), logits["new"].view(np.uint32))
    print(f"logits of the first 6 steps bit-identical: {same}", flush=True)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for rd in range(args.rounds):
        for name in ("base", "new") if rd % 2 == 0 else ("new", "base"):
            ns = runs[name]
            ns.step([(table, [1000], 0)])
            t0 = time.thread_time()
            for p in range(1, args.steps + 1):
                ns.step([(table, [1000 + p], p)])
            ms[name].append((time.thread_time() - t0) / args.steps * 1e3)
    b, n = float(np.median(ms["base"])), float(np.median(ms["new"]))
    print(f"decode step, ms (median of {args.rounds} rounds x {args.steps} steps, one thread's CPU time): "
          f"base {b:.2f} ({min(ms['base']):.2f}-{max(ms['base']):.2f}), "
          f"new {n:.2f} ({min(ms['new']):.2f}-{max(ms['new']):.2f}), new/base {n / b:.3f}")


if __name__ == "__main__":
    main()
