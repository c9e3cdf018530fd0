"""Cost of a batched decode step's layer matmuls on a K-quant GGUF (Q4_K_M) by rows per step, one
thread's CPU time, against another build of the kernels in the same process (A/B, rounds
interleaved, medians).

Why: a K-quant step of M fine-activation rows cost ~M times a 1-row step on the VNNI kernels
(issue 42: c=32 TPOT 1708 ms on the ~4B against 465 ms for the same weights as bf16); steps of 8+
rows now run on AMX-INT8 tiles (csrc/amx_int8.h). This times layers' qkv, o, gate/up and down as
the forward fuses them, with fine activations (the default for generated rows).

    PYTHONPATH=src TOKENPATH_NUM_THREADS=1 taskset -c 0 python benchmarks/kquant_step_rows.py \
        --gguf .cache/peers/qwen3-1b-random.Q4_K_M.gguf [--layers 0,1] [--rows 1,8,16,32] [--lib OLD_DIR]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--layers", default="0,1")
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--lib", help="a folder with another build of the kernel objects (the baseline)")
    args = ap.parse_args()

    from tokenpath.engine import kernels as K
    from tokenpath.engine.gguf_file import GGUFFile

    found = {"baseline": K.load_library(Path(args.lib).resolve()) if args.lib else None,
             "this build": K.native_library()}
    if found["this build"] is None or (args.lib and found["baseline"] is None):
        raise SystemExit("native kernels not built")
    libs = {name: lib for name, lib in found.items() if lib is not None}
    lib0 = libs["this build"]
    isa = lib0.isa("auto")
    rows = [int(r) for r in args.rows.split(",")]
    tensors = {t.name: t for t in GGUFFile(args.gguf).tensors}

    def fused(names: list[str]) -> tuple[int, np.ndarray, int, int]:
        parts = [tensors[n] for n in names]
        n = sum(int(t.shape[1]) for t in parts)
        blocks = np.concatenate([np.ascontiguousarray(t.data).view(np.uint8).reshape(-1) for t in parts]).reshape(n, -1)
        wt, packed = K.repack(lib0, int(parts[0].tensor_type), blocks)  # mixed types: costed as the first's
        return wt, packed, K.output_rows(wt, packed), int(parts[0].shape[0])

    mats = []
    for i in (int(x) for x in args.layers.split(",")):
        p = f"blk.{i}."
        mats += [fused([p + f"attn_{x}.weight" for x in "qkv"]), fused([p + "attn_output.weight"]),
                 fused([p + "ffn_gate.weight", p + "ffn_up.weight"]), fused([p + "ffn_down.weight"])]
    xs = {k: np.random.default_rng(0).standard_normal((max(rows), k)).astype(np.float32) for *_, k in mats}
    ys: dict[tuple[int, int], np.ndarray] = {(m, n): np.empty((m, n), np.float32) for m in rows for _, _, n, _ in mats}

    def run(lib: K.NativeLibrary, m: int) -> None:
        for wt, w, n, k in mats:
            lib.lib.tp_gemm(isa, wt, w.ctypes.data, n, k, xs[k].ctypes.data, m, ys[(m, n)].ctypes.data, 1, 2)

    res: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, lib in libs.items():
            for m in rows:
                run(lib, m)
                t0 = time.thread_time()
                run(lib, m)
                res.setdefault((name, m), []).append((time.thread_time() - t0) * 1e3)
    med = {key: statistics.median(v) for key, v in res.items()}
    print(f"{Path(args.gguf).name}, layers {args.layers}, {K.ISA_NAMES[isa]}, fine activations, 1 thread CPU time, "
          f"medians of {args.rounds} rounds")
    print("| build | " + " | ".join(f"{m} rows ms (x 1 row)" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in libs:
        print(f"| {name} | " + " | ".join(f"{med[(name, m)]:.1f} ({med[(name, m)] / med[(name, rows[0])]:.2f})"
                                          for m in rows) + " |")


if __name__ == "__main__":
    main()
