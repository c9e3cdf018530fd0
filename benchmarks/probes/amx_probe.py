"""What an AMX-BF16 tile GEMM would give the bf16 safetensors path, measured (issue 42).

On a CPU with AMX (Intel Sapphire Rapids and later), vLLM CPU's bf16 linears run on tiles, and
tokenpath's BF16X16 matrices run on AVX-512 FMAs (the file's bf16 widened to float32, float32
activations). This compiles `amx_bf16_gemm.c` (a plain 2 x 2-tile loop) and times it beside
`kernels.gemm` on a BF16X16 matrix of the same shape, one thread each.

    python benchmarks/probes/amx_probe.py [--m 256] [--n 1536] [--k 576]

Prints GFLOP/s for both; exits 0 with a message on a CPU without amx_bf16.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--k", type=int, default=576)
    args = ap.parse_args()
    if " amx_bf16" not in Path("/proc/cpuinfo").read_text():
        print("this CPU has no amx_bf16: nothing to measure")
        return
    from tokenpath.engine import kernels as K

    lib = K.native_library()
    w = np.random.default_rng(0).standard_normal((args.n, args.k)).astype(np.float32)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(args.n, 2 * args.k)
    wtype, packed = K.repack(lib, K.BF16, bits)
    x = np.random.default_rng(1).standard_normal((args.m, args.k)).astype(np.float32)
    best = min(_timed(lambda: K.gemm(lib, wtype, packed, x, args.k, K.ISA_AVX512, threads=1)) for _ in range(5))
    flop = 2 * args.m * args.n * args.k
    print(f"kernels BF16X16 (AVX-512 FMA, float32 activations), 1 thread: {flop / best / 1e9:.1f} GFLOP/s")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "amx"
        subprocess.run(["gcc", "-O2", "-mamx-tile", "-mamx-bf16", "-mavx512f", str(Path(__file__).with_name("amx_bf16_gemm.c")),
                        "-o", str(exe)], check=True)
        print(subprocess.run([str(exe), str(args.m), str(args.n), str(args.k)], check=True, capture_output=True,
                             text=True).stdout.strip())


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
