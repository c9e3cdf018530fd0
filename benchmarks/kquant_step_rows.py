"""Cost of a GGUF's layer matmuls by rows per step, one thread's CPU time, against another build of
the kernels in the same process (A/B, rounds interleaved, medians).

Why: a K-quant step of M fine-activation rows cost ~M times a 1-row step on the VNNI kernels
(issue 42: c=32 TPOT 1708 ms on the ~4B against 465 ms for the same weights as bf16); steps of 8+
rows now run on AMX-INT8 tiles (csrc/amx_int8.h). By default this times layers' qkv, o, gate/up and
down as the forward fuses them, with fine activations (the default for generated rows).

--unfused: a prompt's rows take int8 activations for o and gate/up and fine ones for qkv and down
(model.py DEFAULT_PROMPT_FINE, or TOKENPATH_KERNELS_PROMPT_FINE), and each weight format (Q4_K,
Q5_0, Q6_K, Q8_0, ...) has its own kernel. This times each of the layers' matrices on its own
(one `tp_gemm` call, the activations' quantization included) in that precision and format, the two
builds' calls back to back, with the median of the rounds' ratios: which format and precision an
A/B of the prompt kernels moved.

    PYTHONPATH=src TOKENPATH_NUM_THREADS=1 taskset -c 0 python benchmarks/kquant_step_rows.py \
        --gguf .cache/peers/qwen3-1b-random.Q4_K_M.gguf [--layers 0,1] [--rows 1,8,16,32] [--lib OLD_DIR]
    PYTHONPATH=src TOKENPATH_NUM_THREADS=1 taskset -c 0 python benchmarks/kquant_step_rows.py --unfused \
        --gguf MODEL.gguf [--layers 0] [--rows 8,64,256] [--lib OLD_DIR] [--isa avx2]
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

# A layer's matmuls as the forward fuses them (GGUF tensor suffixes), in the forward's order.
FUSED = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
Matrix = tuple[str, int, int, np.ndarray, int, int]  # label, tp_gemm mode, repacked type, weights, n, k


def matrices(lib, tensors: dict, layers: list[int], unfused: bool) -> list[Matrix]:
    """The layers' matrices repacked as the forward repacks them: fused, with fine activations (mode
    2); or one by one, each in a prompt row's precision (2: int8 + residual bytes, 0: int8)."""
    from tokenpath.engine import kernels as K
    from tokenpath.engine.kernels.precision import (
        EXACT_DOWN,
        EXACT_GATE_UP,
        EXACT_O,
        EXACT_QKV,
        prompt_fine_mask,
    )

    prompt_fine = prompt_fine_mask()
    mats = []
    for i in layers:
        for kind, group in zip((EXACT_QKV, EXACT_O, EXACT_GATE_UP, EXACT_DOWN), FUSED, strict=True):
            for names in [[s] for s in group] if unfused else [list(group)]:
                parts = [tensors[f"blk.{i}.{s}.weight"] for s in names]
                n = sum(int(t.shape[1]) for t in parts)
                blocks = np.concatenate([np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
                                         for t in parts]).reshape(n, -1)
                wt, packed = K.repack(lib, int(parts[0].tensor_type), blocks)  # mixed types: costed as the first's
                label = "+".join(names) if len(layers) == 1 else f"blk.{i}.{'+'.join(names)}"
                mode = (2 if prompt_fine & kind else 0) if unfused else 2
                mats.append((label, mode, wt, packed, K.output_rows(wt, packed), int(parts[0].shape[0])))
    return mats


def gemm_ms(lib, isa: int, mat: Matrix, xs: dict[int, np.ndarray], m: int) -> float:
    """One tp_gemm call on one thread (its activations' quantization included), ms of this thread's CPU time."""
    _, mode, wt, w, n, k = mat
    y = np.empty((m, n), np.float32)
    t0 = time.thread_time()
    lib.lib.tp_gemm(isa, wt, w.ctypes.data, n, k, xs[k].ctypes.data, m, y.ctypes.data, 1, mode)
    return (time.thread_time() - t0) * 1e3


def fused_table(libs: dict, isa: int, mats: list[Matrix], xs: dict, rows: list[int], rounds: int) -> None:
    """Each build's whole set of matrices per step, by rows, and against its 1-row (first) step."""
    res: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for name, lib in libs.items():
            for m in rows:
                for mat in mats:  # warm: the weights and the activations' buffers in place
                    gemm_ms(lib, isa, mat, xs, m)
                res.setdefault((name, m), []).append(sum(gemm_ms(lib, isa, mat, xs, m) for mat in mats))
    med = {key: statistics.median(v) for key, v in res.items()}
    print("| build | " + " | ".join(f"{m} rows ms (x 1 row)" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in libs:
        print(f"| {name} | " + " | ".join(f"{med[(name, m)]:.1f} ({med[(name, m)] / med[(name, rows[0])]:.2f})"
                                          for m in rows) + " |")


def unfused_table(libs: dict, isa: int, mats: list[Matrix], xs: dict, rows: list[int], rounds: int) -> None:
    """Each matrix by rows, per build (ms; GMAC/s), and the median of the rounds' ratios this / baseline:
    the two builds' calls of one round run back to back, so their ratio sees the same load."""
    from tokenpath.engine import kernels as K

    res: dict[tuple[str, str, int], list[float]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for m in rows:
            for mat in mats:
                for name, lib in libs.items():
                    gemm_ms(lib, isa, mat, xs, m)
                    res.setdefault((name, mat[0], m), []).append(gemm_ms(lib, isa, mat, xs, m))
                if len(libs) > 1:
                    ratios.setdefault((mat[0], m), []).append(res[("this build", mat[0], m)][-1]
                                                              / res[("baseline", mat[0], m)][-1])
    med = {key: statistics.median(v) for key, v in res.items()}
    two = len(libs) > 1
    print("| matrix | type | mode | rows | " + " | ".join(f"{name} (ms; GMAC/s)" for name in libs)
          + (" | this build / baseline (median of rounds' ratios) |" if two else " |"))
    print("|---|---|---|---|" + "---|" * (len(libs) + two))
    for label, mode, wt, _, n, k in mats:
        for m in rows:
            cells = [f"{med[(name, label, m)]:.2f}; {n * k * m / med[(name, label, m)] / 1e6:.1f}" for name in libs]
            ratio = f" | {statistics.median(ratios[(label, m)]):.3f}" if two else ""
            print(f"| {label} {n}x{k} | {K.TYPE_NAMES[wt]} | {'fine' if mode else 'int8'} | {m} | "
                  + " | ".join(cells) + ratio + " |")
    for name in libs:
        for m in rows:
            print(f"total {name} rows={m}: {sum(med[(name, mat[0], m)] for mat in mats):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--layers", default="0,1")
    ap.add_argument("--rows", help="rows per step (default 1,8,16,32; with --unfused 8,64,256)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--isa", default="auto", choices=["auto", "avx2", "avx512"])
    ap.add_argument("--unfused", action="store_true",
                    help="each matrix on its own in a prompt row's precision (int8 for o and gate/up, fine for "
                         "qkv and down), a row per matrix and rows, with the median of the rounds' ratios")
    ap.add_argument("--lib", help="a folder with another build of the kernel objects (the baseline)")
    args = ap.parse_args()

    from tokenpath.engine import kernels as K
    from tokenpath.engine.gguf_file import GGUFFile

    found = {"baseline": K.load_library(Path(args.lib).resolve()) if args.lib else None,
             "this build": K.native_library()}
    if found["this build"] is None or (args.lib and found["baseline"] is None):
        raise SystemExit("native kernels not built")
    libs = {name: lib for name, lib in found.items() if lib is not None}
    isa = libs["this build"].isa(args.isa)
    rows = [int(r) for r in (args.rows or ("8,64,256" if args.unfused else "1,8,16,32")).split(",")]
    tensors = {t.name: t for t in GGUFFile(args.gguf).tensors}
    mats = matrices(libs["this build"], tensors, [int(x) for x in args.layers.split(",")], args.unfused)
    xs = {k: np.random.default_rng(0).standard_normal((max(rows), k)).astype(np.float32) for *_, k in mats}
    print(f"{Path(args.gguf).name}, layers {args.layers}, {K.ISA_NAMES[isa]}, "
          f"{'prompt precision, unfused' if args.unfused else 'fine activations, fused'}, one thread's CPU time, "
          f"medians of {args.rounds} rounds")
    (unfused_table if args.unfused else fused_table)(libs, isa, mats, xs, rows, args.rounds)


if __name__ == "__main__":
    main()
