"""Cost of one native forward step over T rows of ONE sequence (a decode row plus T - 1 draft
tokens, as speculative verification runs it) against T = 1, on SmolLM2-135M's GGUF (Q4_1 here).

Why: speculation pays off only if a (K + 1)-row verification step costs little more than a 1-row
step. This times the whole step (the native forward, logits for every row as verification needs
them) and its parts: the layers' matmuls (qkv, o, gate_up, down as the forward fuses them, fine
activations as the forward runs them by default), and the LM head over the vocabulary, each with
the standalone tp_gemm at M = T; what is left (attention, norms, RoPE, SiLU, quantizing the
activations, the embedding) is the step minus those two. Rounds interleave the T values, and each
figure is the median over rounds: the machine is shared.

    PYTHONPATH=src nice -n 10 python benchmarks/step_rows.py [--context 400] [--rounds 7] [--lib DIR]
    [--threads 2 --wall]: the serving setting, noisier on a shared machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,2,3,5,8", help="T values (rows of one sequence per step)")
    ap.add_argument("--context", type=int, default=400, help="tokens already in the KV cache")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="steps per timing (per round)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true",
                    help="time by the wall clock, not the process's CPU time (on a shared machine, with "
                         "--threads 1, CPU time counts only this process's own cycles)")
    ap.add_argument("--isa", default="auto", choices=["auto", "avx2", "avx512"])
    ap.add_argument("--lib", help="a folder with another build of the kernel objects, for A/B runs")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from tests.engine.native_steps import NativeSteps

    from tokenpath.engine import kernels as K
    from tokenpath.engine.kernels import model as kmodel
    from tokenpath.engine.loader import load_model

    if args.lib:
        other = K.load_library(Path(args.lib).resolve())
        K.native_library = kmodel.native_library = lambda: other  # type: ignore[method-assign]
    lib = K.native_library()
    isa = lib.isa(args.isa)
    loaded = load_model(args.model)
    cfg = loaded.config
    rows = [int(t) for t in args.rows.split(",")]

    # The layers' matrices as the forward fuses and repacks them.
    def fused(names: list[str]) -> tuple[int, np.ndarray, int, int]:
        raws = [loaded.gguf.raw(n) for n in names]
        if len({r.ggml_type for r in raws}) != 1:
            raise SystemExit(f"{names}: mixed types; this benchmark fuses one type only")
        blocks = np.concatenate([np.ascontiguousarray(r.data).view(np.uint8) for r in raws])
        t, packed = K.repack(lib, raws[0].ggml_type, blocks)
        return t, packed, K.output_rows(t, packed), raws[0].cols

    mats = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        mats += [fused([p + f"{x}_proj.weight" for x in "qkv"]), fused([p + "o_proj.weight"]),
                 fused([p + "gate_proj.weight", p + "up_proj.weight"]), fused([p + "down_proj.weight"])]
    head = fused(["embed.weight" if cfg.tie_word_embeddings else "lm_head.weight"])
    types = sorted({K.TYPE_NAMES[t] for t, *_ in mats})
    clock = time.perf_counter if args.wall else time.process_time
    fine_layers = (kmodel.fine_mask() & 0b1111) == 0b1111
    fine_head = bool(kmodel.fine_mask() >> 4 & 1)

    xs = {k: np.random.default_rng(0).standard_normal((max(rows), k)).astype(np.float32)
          for k in {c for *_, c in mats} | {head[3]}}

    def gemms(ms: list, m: int, fine: bool) -> None:
        for t, w, n, k in ms:
            y = np.empty((m, n), dtype=np.float32)
            lib.lib.tp_gemm(isa, t, w.ctypes.data, n, k, xs[k].ctypes.data, m, y.ctypes.data, args.threads,
                            2 if fine else 0)

    need = args.context + max(rows) + 16
    nblocks = need // 16 + 1
    ns = NativeSteps(loaded, "auto", num_blocks=nblocks, max_len=need, kernels_isa=args.isa)
    table = list(range(nblocks))
    prompt = [int(x) for x in np.random.default_rng(1).integers(100, 10000, args.context)]
    for c0 in range(0, args.context, 128):
        ns.step([(table, prompt[c0:c0 + 128], c0)])

    def time_it(fn) -> float:
        fn()
        t0 = clock()
        for _ in range(args.steps):
            fn()
        return (clock() - t0) / args.steps * 1e3

    res: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for t in rows:
            toks = prompt[:t]
            res.setdefault(("step", t), []).append(time_it(lambda toks=toks: ns.step([(table, toks, args.context)])))
            res.setdefault(("mm", t), []).append(time_it(lambda t=t: gemms(mats, t, fine_layers)))
            res.setdefault(("head", t), []).append(time_it(lambda t=t: gemms([head], t, fine_head)))
    med = {k: statistics.median(v) for k, v in res.items()}
    load = os.getloadavg()[0]
    print(f"{args.model}: {'/'.join(types)} layers, head {K.TYPE_NAMES[head[0]]} ({head[2]} x {head[3]}), "
          f"ISA {K.ISA_NAMES[isa]}, {args.threads} threads, {'wall' if args.wall else 'CPU'} time, context {args.context}, medians of {args.rounds} "
          f"rounds x {args.steps} steps; 1-min load average at the end {load:.2f}")
    print("| T rows | step ms | x T=1 | layer matmuls ms | x T=1 | LM head ms | x T=1 | rest (attention, norms, ...) ms |")
    print("|---|---|---|---|---|---|---|---|")
    for t in rows:
        s, m, h = med[("step", t)], med[("mm", t)], med[("head", t)]
        print(f"| {t} | {s:.2f} | {s / med[('step', rows[0])]:.2f} | {m:.2f} | {m / med[('mm', rows[0])]:.2f} "
              f"| {h:.2f} | {h / med[('head', rows[0])]:.2f} | {s - m - h:.2f} |")


if __name__ == "__main__":
    main()
