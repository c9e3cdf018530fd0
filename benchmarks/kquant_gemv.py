"""The native GEMV (decode, M = 1) per weight type on a real GGUF's own matrices: effective GB/s.

Why: decode on a ~1B model is bound by reading the weights, so each type's kernel should stream
its bytes at the machine's read bandwidth; this says which type (and which activation mode: int8,
or int8 + residual bytes, "fine") falls short. Every matrix of the file's layers is repacked as the
native forward repacks it, and each pass runs over all matrices of one type, so the bytes come
from memory as in a decode step. The kernels' own STREAM-like read
(kernels.stream_read, over several times the L3) gives the read-bandwidth ceiling of the same
threads, timed by the same clock (--cpu-time: CPU time). Groups smaller than the L3 (a host here
has 300 MiB) would be timed from cache: that buffer is read once before every timed pass.
--by-role gives a row per matrix role and type (q, k, v, o, gate, up, down, head).

    PYTHONPATH=src python benchmarks/kquant_gemv.py --model .cache/peers/qwen3-1b-random.Q4_K_M.gguf [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def time_forward(loaded, clock, steps: int = 64) -> float:
    """ms per decode step of the whole native forward (one call, no Python engine around it):
    a 1-token prompt, then `steps` single-token steps, as tg128 runs."""
    from tests.engine.native_steps import NativeSteps

    ns = NativeSteps(loaded, "auto", num_blocks=(steps + 16) // 16 + 1, max_len=steps + 16)
    table = list(range((steps + 16) // 16 + 1))
    ns.step([(table, [1000], 0)])
    best = float("inf")
    for _ in range(3):
        t0 = clock()
        for p in range(1, steps // 3 + 1):
            ns.step([(table, [1000 + p], p)])
        best = min(best, (clock() - t0) / (steps // 3) * 1e3)
        ns.step([(table, [1000], 0)])
    return best


def timed(clock, fn, *args) -> float:
    """Seconds of one call fn(*args) by `clock`."""
    t0 = clock()
    fn(*args)
    return clock() - t0


def one_pass(lib, isa: int, ms: list, xs: dict, ys: dict, m: int, threads: int, mode: int) -> None:
    """Every matrix of one group once: y = W x for the m activation rows."""
    for t, p, n, k in ms:
        lib.lib.tp_gemm(isa, t, p.ctypes.data, n, k, xs[k].ctypes.data, m, ys[n].ctypes.data, threads, mode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--isa", default="both", choices=["avx2", "avx512", "both"])
    ap.add_argument("--lib", help="a folder with another build of the kernels (_native_avx2/_native_avx512 "
                                   "objects) to time, for A/B runs")
    ap.add_argument("--forward", action="store_true", help="also time whole decode steps of the native forward")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time, not the wall clock: on a machine shared with other "
                         "jobs, with --threads 1, it counts only this kernel's own cycles")
    ap.add_argument("--m", type=int, default=1, help="activation rows (1: decode; 256: a prefill chunk)")
    ap.add_argument("--modes", default="0,2", help="0 int8, 2 int8 + residual bytes (fine)")
    ap.add_argument("--by-role", action="store_true",
                    help="a row per matrix role (q, k, v, o, gate, up, down, head) and type, not per type")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter

    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.engine_vs_llamacpp import read_buffer_bytes

    from tokenpath.engine import kernels as K
    from tokenpath.engine.kernels import model as kmodel
    from tokenpath.engine.loader import load_model

    if args.lib:  # another build's folder of kernel objects, for the GEMVs and the forward alike
        other = K.load_library(Path(args.lib).resolve())
        K.native_library = kmodel.native_library = lambda: other  # type: ignore[method-assign]
    lib = K.native_library()
    if lib is None:
        raise SystemExit("the native kernels are not built here (python setup.py build_ext --inplace)")
    loaded = load_model(args.model)
    cfg = loaded.config
    roles = ("q", "k", "v", "o", "gate", "up", "down")
    names = [(p, f"layers.{i}.{p}_proj.weight") for i in range(cfg.num_layers) for p in roles]
    names.append(("head", "embed.weight" if cfg.tie_word_embeddings else "lm_head.weight"))
    groups: dict[str, list[tuple[int, np.ndarray, int, int]]] = defaultdict(list)
    for role, n in names:
        raw = loaded.gguf.raw(n)
        if raw.ggml_type not in K.GGUF_BLOCKS:
            continue
        t, packed = K.repack(lib, raw.ggml_type, np.ascontiguousarray(raw.data).view(np.uint8))
        groups[f"{role} {K.TYPE_NAMES[t]}" if args.by_role else K.TYPE_NAMES[t]].append(
            (t, packed, K.output_rows(t, packed), raw.cols))
    isas = {"avx2": [K.ISA_AVX2], "avx512": [K.ISA_AVX512], "both": lib.available_isas()}[args.isa]
    total = sum(p.nbytes for ms in groups.values() for _, p, _, _ in ms)
    # Between timed passes the buffer is read once (untimed): a group smaller than the L3 (300 MiB
    # on some hosts) would otherwise be timed from cache. Its read is the ceiling, timed as the GEMVs are.
    buf: np.ndarray = np.arange(read_buffer_bytes() // 8, dtype=np.uint64).view(np.uint8)
    ceiling = {}
    for isa in isas:
        K.stream_read(lib, buf, args.threads, 1, isa)
        ceiling[isa] = buf.nbytes / min(timed(clock, K.stream_read, lib, buf, args.threads, 1, isa)
                                        for _ in range(args.reps)) / 1e9
        print(f"read bandwidth ceiling ({'avx512' if isa == 2 else 'avx2'}, native read of {buf.nbytes / 2**20:.0f} "
              f"MiB, {args.threads} threads, {'CPU time' if args.cpu_time else 'wall'}): {ceiling[isa]:.1f} GB/s")
    print("| matrices | count | MB | isa | activations | ms per pass | GB/s | of the read | G weight-rows/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    all_ms: dict[tuple[int, int], float] = defaultdict(float)
    for label, ms in groups.items():
        nbytes = sum(p.nbytes for _, p, _, _ in ms)
        nweights = sum(n * k for _, _, n, k in ms)
        xs = {k: np.random.default_rng(0).standard_normal((args.m, k)).astype(np.float32) for _, _, _, k in ms}
        ys = {n: np.empty((args.m, n), dtype=np.float32) for _, _, n, _ in ms}
        for isa in isas:
            for mode in (int(m) for m in args.modes.split(",")):
                run = (lib, isa, ms, xs, ys, args.m, args.threads, mode)
                one_pass(*run)
                best = float("inf")
                for _ in range(args.reps):
                    K.stream_read(lib, buf, args.threads, 1, isa)  # evict
                    best = min(best, timed(clock, one_pass, *run))
                all_ms[(isa, mode)] += best * 1e3
                print(f"| {label} | {len(ms)} | {nbytes / 1e6:.0f} | {'avx512' if isa == 2 else 'avx2'} "
                      f"| {'fine' if mode == 2 else 'int8'} | {best * 1e3:.2f} | {nbytes / best / 1e9:.1f} "
                      f"| {nbytes / best / 1e9 / ceiling[isa]:.0%} | {nweights * args.m / best / 1e9:.1f} |")
    if args.forward:
        print(f"native forward, decode step (default activations, auto ISA): {time_forward(loaded, clock):.2f} ms")
    for (isa, mode), ms_ in sorted(all_ms.items()):
        print(f"all matrices, {'avx512' if isa == 2 else 'avx2'} {'fine' if mode == 2 else 'int8'}: {ms_:.2f} ms "
              f"per token ({total / ms_ / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
