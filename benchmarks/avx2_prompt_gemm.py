"""Prompt (prefill) GEMMs of one layer of a GGUF, by matrix and rows, with the default prompt
precision, one thread's CPU time, A/B against another build of the kernels (rounds interleaved,
medians).

Why: kquant_step_rows.py times every matrix with residual bytes (fine), as generated rows take
them; a prompt's rows take int8 activations for o and gate/up and fine ones for qkv and down
(model.py DEFAULT_PROMPT_FINE), and each weight format (Q4_K, Q5_0, Q6_K, Q8_0, ...) has its own
kernel. This times each of a layer's matrices (unfused) in its own precision and format, so that
an A/B of the AVX2 prompt kernels shows which format and precision moved.

    PYTHONPATH=src TOKENPATH_NUM_THREADS=1 taskset -c 0 python benchmarks/avx2_prompt_gemm.py \
        --gguf MODEL.gguf [--layer 0] [--rows 8,64,256] [--lib OLD_DIR] [--isa avx2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]

# GGUF tensor suffix -> tp_gemm mode for a prompt row: 2 int8 + residual bytes, 0 int8.
PROMPT_MODE = {"attn_q": 2, "attn_k": 2, "attn_v": 2, "attn_output": 0, "ffn_gate": 0, "ffn_up": 0, "ffn_down": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--rows", default="8,64,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isa", default="avx2", choices=["avx2", "avx512"])
    ap.add_argument("--lib", help="a folder with another build of the kernel objects (the baseline)")
    args = ap.parse_args()

    from tokenpath.engine import kernels as K
    from tokenpath.engine.gguf_file import GGUFFile

    found = {"base": K.load_library(Path(args.lib).resolve()) if args.lib else None, "new": K.native_library()}
    if found["new"] is None or (args.lib and found["base"] is None):
        raise SystemExit("native kernels not built")
    libs = {name: lib for name, lib in found.items() if lib is not None}
    isa = K.ISA_AVX2 if args.isa == "avx2" else K.ISA_AVX512
    rows = [int(r) for r in args.rows.split(",")]
    tensors = {t.name: t for t in GGUFFile(args.gguf).tensors}
    mats = []
    for suffix, mode in PROMPT_MODE.items():
        t = tensors[f"blk.{args.layer}.{suffix}.weight"]
        blocks = np.ascontiguousarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)
        wt, packed = K.repack(libs["new"], int(t.tensor_type), blocks)
        mats.append((suffix, mode, wt, packed, K.output_rows(wt, packed), int(t.shape[0])))
    xs = {k: np.random.default_rng(0).standard_normal((max(rows), k)).astype(np.float32) for *_, k in mats}

    def one(lib: K.NativeLibrary, mat: tuple, m: int) -> float:
        _, mode, wt, w, n, k = mat
        y = np.empty((m, n), np.float32)
        t0 = time.thread_time()
        lib.lib.tp_gemm(isa, wt, w.ctypes.data, n, k, xs[k].ctypes.data, m, y.ctypes.data, 1, mode)
        return (time.thread_time() - t0) * 1e3

    res: dict[tuple[str, str, int], list[float]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for m in rows:
            for mat in mats:
                for name, lib in libs.items():
                    one(lib, mat, m)
                    res.setdefault((name, mat[0], m), []).append(one(lib, mat, m))
                if len(libs) > 1:  # the two builds' calls of one round ran back to back: their ratio
                    ratios.setdefault((mat[0], m), []).append(res[("new", mat[0], m)][-1] / res[("base", mat[0], m)][-1])
    med = {key: statistics.median(v) for key, v in res.items()}
    print(f"{Path(args.gguf).name}, layer {args.layer}, {K.ISA_NAMES[isa]}, prompt precision, one thread's CPU "
          f"time, medians of {args.rounds} interleaved rounds (ms; GMAC/s)")
    print("| matrix | type | mode | rows | " + " | ".join(libs) + (" | new / base (median of rounds' ratios) |" if len(libs) > 1 else " |"))
    print("|---|---|---|---|" + "---|" * (len(libs) + (len(libs) > 1)))
    for suffix, mode, wt, _, n, k in mats:
        for m in rows:
            cells = [f"{med[(name, suffix, m)]:.2f}; {n * k * m / med[(name, suffix, m)] / 1e6:.1f}" for name in libs]
            ratio = f" | {statistics.median(ratios[(suffix, m)]):.3f}" if len(libs) > 1 else ""
            print(f"| {suffix} {n}x{k} | {K.TYPE_NAMES[wt]} | {'fine' if mode else 'int8'} | {m} | "
                  + " | ".join(cells) + ratio + " |")
    for name in libs:
        for m in rows:
            print(f"total {name} rows={m}: {sum(med[(name, s[0], m)] for s in mats):.2f} ms")


if __name__ == "__main__":
    main()
