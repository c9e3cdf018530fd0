"""A bf16 checkpoint's native steps with bf16 activations (the default where the CPU has AMX or
AVX512_BF16) against float32 ones (--kernels-bf16 0: the FMA kernels, weights widened in
registers), in one process: prefill, a batched decode step, a one-row decode step.

Why: a bf16 prefill and a c=32 decode step are bound by the matmuls' multiply-adds. On an
AVX512_BF16 CPU without AMX (AMD Zen 4) the bf16 rows run csrc/bf16_dot.cpp's VDPBF16PS, 32
multiply-adds an instruction against the FMA kernels' 16; this gives the step times of both modes
of the same build, their ratio, and how far each mode's last-row logits are from float32 torch.

    PYTHONPATH=src python benchmarks/bf16_rows.py --model .cache/peers/smollm2-135m-bfloat16 [--threads 2]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
BS = 16  # the engine's default block size (tests/engine/native_steps.py's slots assume it)

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", required=True, help="a bf16 safetensors checkpoint folder")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--prompt", type=int, default=256, help="prompt rows of the prefill step")
ap.add_argument("--batch", type=int, default=32, help="sequences of the batched decode step")
ap.add_argument("--rounds", type=int, default=7, help="rounds; the modes alternate their order")


def steps(loaded, bf16: int | None, blocks: int, max_len: int):
    """One native runner (tests/engine/native_steps.py) of the checkpoint's own dtype, with
    kernels_bf16 None (the default) or 0 (float32 activations)."""
    from tests.engine.native_steps import NativeSteps

    return NativeSteps(loaded, "auto", blocks, max_len, quantization="auto",
                       **({} if bf16 is None else {"kernels_bf16": bf16}))


def main() -> None:
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from tokenpath.engine.loader import load_model

    loaded = load_model(args.model)
    cfg = loaded.config
    per_seq = args.prompt // BS + 2
    blocks = per_seq * max(args.batch, 1)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(args.batch)]
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, args.prompt).tolist()
    modes = {"bf16 rows": steps(loaded, None, blocks, args.prompt + 16),
             "float32 rows": steps(loaded, 0, blocks, args.prompt + 16)}
    native = modes["bf16 rows"].runner.native
    if not native.bf16:
        print("note: no bf16 rows on this CPU (no AMX-BF16 or AVX512_BF16): both modes run float32 activations")

    def prefill(s) -> np.ndarray:
        return s.step([(tables[0], prompt, 0)], last_only=True).numpy()

    def batched(s) -> np.ndarray:  # one row per sequence, after a prompt's worth of positions
        return s.step([(tables[b], [1000 + b], args.prompt) for b in range(args.batch)], last_only=True).numpy()

    def single(s) -> np.ndarray:
        return s.step([(tables[0], [1000], args.prompt)], last_only=True).numpy()

    cases = {f"prefill, {args.prompt} rows": (prefill, args.prompt),
             f"decode step, {args.batch} rows": (batched, args.batch), "decode step, 1 row": (single, 1)}
    ms: dict[tuple[str, str], list[float]] = {(c, m): [] for c in cases for m in modes}
    first: dict[str, np.ndarray] = {}
    for name, s in modes.items():  # warm: the step buffers and the KV the decode rows read
        first[name] = prefill(s)[-1]
        batched(s), single(s)
    for rd in range(args.rounds):
        for name in list(modes)[:: 1 if rd % 2 == 0 else -1]:
            for case, (fn, _) in cases.items():
                t0 = time.perf_counter()
                fn(modes[name])
                ms[(case, name)].append((time.perf_counter() - t0) * 1e3)
    flops = native.weight_bytes  # 2 per bf16 weight a row (an untied embedding counts too: an upper bound)
    print(f"{args.model}: {native.weight_bytes / 2**20:.0f} MiB of weights ({', '.join(native.weight_types)}), "
          f"{args.threads} threads, median (min-max) of {args.rounds} rounds, wall ms")
    print()
    print("| step | bf16 rows (ms) | float32 rows (ms) | float32 / bf16 | bf16 rows, GFLOP/s |")
    print("|---|---|---|---|---|")
    for case, (_, rows) in cases.items():
        b, f = (float(np.median(ms[(case, m)])) for m in modes)
        cells = " | ".join(f"{np.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in (ms[(case, m)] for m in modes))
        print(f"| {case} | {cells} | {f / b:.2f}x | {flops * rows / b / 1e6:.0f} |")
    print()
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    diff = np.abs(first["bf16 rows"] - first["float32 rows"])
    print(f"prompt's last row, |bf16 rows - float32 rows| logits: mean {diff.mean():.2e}, max {diff.max():.2e}; "
          f"same argmax: {int(first['bf16 rows'].argmax()) == int(first['float32 rows'].argmax())}")


if __name__ == "__main__":
    main()
