"""The K-quant GEMM kernels on an L2-sized slice of a real GGUF's matrices: GMAC/s by CPU time.

Why: on a machine shared with other jobs, whole-engine figures (and the streaming GEMV of
kquant_gemv.py) swing with everyone else's memory traffic and scheduling. A slice that fits in one
core's L2 (512 rows of `gate_proj` Q4_K, 128 rows of `down_proj` Q6_K), timed by this process's
CPU time on one thread, measures the kernel's own instruction cost: what an A/B of two builds needs.

    PYTHONPATH=src python benchmarks/kquant_gemm_incache.py --model qwen3-1b-random.Q4_K_M.gguf \
        [--lib /path/to/other/kernels] [--m 1,4,64] [--isa avx2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lib", default=str(ROOT / "src" / "tokenpath" / "engine" / "kernels"),
                    help="the folder of the kernel objects to time (another build's, for A/B runs)")
    ap.add_argument("--m", default="1,4,64", help="activation rows: 1 is decode, 64 a prefill tile")
    ap.add_argument("--isa", default="avx2", choices=["avx2", "avx512"])
    ap.add_argument("--mode", type=int, default=2, help="0 int8, 2 int8 + residual bytes (the default precision)")
    args = ap.parse_args()

    from tokenpath.engine import kernels as K
    from tokenpath.engine.loader import load_model

    lib = K.load_library(Path(args.lib).resolve())
    if lib is None:
        raise SystemExit(f"no kernel objects in {args.lib}")
    isa = K.ISA_AVX2 if args.isa == "avx2" else K.ISA_AVX512
    loaded = load_model(args.model)
    for name, rows in (("layers.0.gate_proj.weight", 512), ("layers.0.down_proj.weight", 128)):
        raw = loaded.gguf.raw(name)
        w = np.ascontiguousarray(np.asarray(raw.data)[:rows]).view(np.uint8)
        t, packed = K.repack(lib, raw.ggml_type, w)
        k = raw.cols
        for m in (int(v) for v in args.m.split(",")):
            x = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
            y = np.empty((m, rows), np.float32)
            calls = max(3, int(2e8 / (m * rows * k)))
            best = float("inf")
            for _ in range(5):
                t0 = time.process_time()
                for _ in range(calls):
                    lib.lib.tp_gemm(isa, t, packed.ctypes.data, rows, k, x.ctypes.data, m, y.ctypes.data, 1, args.mode)
                best = min(best, (time.process_time() - t0) / calls)
            print(f"{K.TYPE_NAMES[t]} {rows}x{k} m={m}: {rows * k * m / best / 1e9:.2f} GMAC/s")


if __name__ == "__main__":
    main()
