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

--forward (--forward-only: without the GEMV table) times whole decode steps of the native forward.
With --lib, both builds (that folder's _native_* objects, e.g. a copy of main's, and this one) load
into this process, each drives its own runner over the same model, the rounds alternate their
order, and the first steps' logits are compared bit for bit: on a shared machine two runs minutes
apart see different loads, so a kernel change's 10-20% on a decode step drowns in their noise.

    PYTHONPATH=src python benchmarks/kquant_gemv.py --model .cache/peers/qwen3-1b-random.Q4_K_M.gguf [--threads 2]
    PYTHONPATH=src taskset -c 1 python benchmarks/kquant_gemv.py --model M.gguf --forward-only --lib BASE_DIR \
        --threads 1 --cpu-time [--rounds 9] [--steps 32]
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


def time_forward(loaded, builds: dict, clock, rounds: int, steps: int) -> tuple[dict[str, list[float]], bool | None]:
    """ms per decode step of the whole native forward (one call, no Python engine around it) of each
    build (name: its NativeLibrary), each with its own runner over the same model, per round: a
    1-token prompt, then `steps` single-token steps, as tg128 runs. The rounds alternate the builds'
    order (A B, B A, ...), so a shared machine's drift falls on both. With two builds, also whether
    their first 6 steps' logits are the same bits (a change that should move no bit is checked too)."""
    from tests.engine.native_steps import NativeSteps

    from tokenpath.engine import kernels as K
    from tokenpath.engine.kernels import model as kmodel

    blocks = (steps + 16) // 16 + 1
    table = list(range(blocks))
    runs, before = {}, (K.native_library, kmodel.native_library)
    try:
        for name, lib in builds.items():  # a runner takes the process's library when it is built: each its own
            K.native_library = kmodel.native_library = lambda lib=lib: lib  # type: ignore[method-assign]
            runs[name] = NativeSteps(loaded, "auto", num_blocks=blocks, max_len=steps + 16)
    finally:
        K.native_library, kmodel.native_library = before  # type: ignore[method-assign]
    first = [np.stack([ns.step([(table, [1000 + p], p)]).numpy().copy() for p in range(6)]) for ns in runs.values()]
    same = None if len(first) < 2 else bool(np.array_equal(first[0].view(np.uint32), first[1].view(np.uint32)))
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for rd in range(rounds):
        for name in list(runs)[:: 1 if rd % 2 == 0 else -1]:
            ns = runs[name]
            ns.step([(table, [1000], 0)])
            t0 = clock()
            for p in range(1, steps + 1):
                ns.step([(table, [1000 + p], p)])
            ms[name].append((clock() - t0) / steps * 1e3)
    return ms, same


def print_forward(loaded, builds: dict, clock, clock_name: str, rounds: int, steps: int) -> None:
    """time_forward's figures as one line per check: the logits' bits (two builds), then each build's
    median (min-max) and, with two, new / base of the medians."""
    ms, same = time_forward(loaded, builds, clock, rounds, steps)
    if same is not None:
        print(f"native forward, logits of the first 6 steps bit-identical ({' and '.join(builds)}): {same}")
    med = {name: float(np.median(v)) for name, v in ms.items()}
    cells = ", ".join(f"{name} {med[name]:.2f} ({min(v):.2f}-{max(v):.2f})" for name, v in ms.items())
    ratio = f", new/base {med['new'] / med['base']:.3f}" if len(ms) > 1 else ""
    print(f"native forward, decode step, ms (default activations, auto ISA; median (min-max) of {rounds} rounds "
          f"x {steps} steps, {clock_name}): {cells}{ratio}")


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
                                   "objects): the GEMV table times it instead of this build; --forward times "
                                   "both, A/B in one process (base: this folder, new: this build)")
    ap.add_argument("--forward", action="store_true", help="also time whole decode steps of the native forward")
    ap.add_argument("--forward-only", action="store_true", help="--forward without the GEMV table")
    ap.add_argument("--rounds", type=int, default=9, help="--forward: rounds (each build's order alternates)")
    ap.add_argument("--steps", type=int, default=32, help="--forward: decode steps per round (positions 1..steps)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by CPU time, not the wall clock: on a machine shared with other jobs, with "
                         "--threads 1 (this thread's: only this kernel's own cycles), else the process's")
    ap.add_argument("--m", type=int, default=1, help="activation rows (1: decode; 256: a prefill chunk)")
    ap.add_argument("--modes", default="0,2", help="0 int8, 2 int8 + residual bytes (fine)")
    ap.add_argument("--by-role", action="store_true",
                    help="a row per matrix role (q, k, v, o, gate, up, down, head) and type, not per type")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.engine_vs_llamacpp import read_buffer_bytes

    from tokenpath.engine import kernels as K
    from tokenpath.engine.kernels.model import kernel_threads
    from tokenpath.engine.loader import load_model

    # The native forward follows torch's thread count unless TOKENPATH_NUM_THREADS says otherwise;
    # on one thread it (and each GEMV) runs on the calling thread, whose CPU time is then all its work.
    one = args.threads == 1 and kernel_threads(1) == 1
    clock, clock_name = ((time.thread_time, "one thread's CPU time") if one else
                         (time.process_time, "the process's CPU time")) if args.cpu_time else (time.perf_counter, "wall")

    this = K.native_library()
    if this is None:
        raise SystemExit("the native kernels are not built here (python setup.py build_ext --inplace)")
    other = K.load_library(Path(args.lib).resolve()) if args.lib else None
    if args.lib and other is None:
        raise SystemExit(f"no kernel objects load from {args.lib}")
    lib = other if other is not None else this  # the GEMV table's build
    builds = {"base": other, "new": this} if other else {"new": this}
    loaded = load_model(args.model)
    if args.forward_only:
        print_forward(loaded, builds, clock, clock_name, args.rounds, args.steps)
        return
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
              f"MiB, {args.threads} threads, {clock_name}): {ceiling[isa]:.1f} GB/s")
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
        print_forward(loaded, builds, clock, clock_name, args.rounds, args.steps)
    for (isa, mode), ms_ in sorted(all_ms.items()):
        print(f"all matrices, {'avx512' if isa == 2 else 'avx2'} {'fine' if mode == 2 else 'int8'}: {ms_:.2f} ms "
              f"per token ({total / ms_ / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
