"""MoE vs dense of the same active size on tokenpath's native kernels (random weights, Q8_0 at load).

Qwen3-MoE of benchmarks/moe_vs_llamacpp.py's SHAPE (64 experts, top-8, expert FFN 256) against a
dense Qwen3 with intermediate 2048 (= 8 x 256): the issue's "cost grows with active parameters,
not total" target. One process per model:

    python benchmarks/moe_active_vs_dense.py qwen3moe|qwen3 [--experts 128] [--dir DIR]

`--experts 128`: the issue's own figure (top-8 of 128 experts) with the same active size; the dense
twin is the same whatever the expert count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DENSE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "initializer_range")


def main() -> None:
    import torch
    from benchmarks.moe_vs_llamacpp import SHAPE
    from tests.engine.tiny_models import save_tiny

    from tokenpath import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["qwen3moe", "qwen3"])
    ap.add_argument("--experts", type=int, default=SHAPE["num_experts"])
    ap.add_argument("--dir", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    kind = args.kind
    moe = SHAPE | {"num_experts": args.experts}
    tag = f"{kind}-{args.experts}" if kind == "qwen3moe" and args.experts != SHAPE["num_experts"] else kind
    d = args.dir or ROOT / ".cache" / "bench" / f"moe-active-{tag}"
    shape = moe if kind == "qwen3moe" else {k: SHAPE[k] for k in DENSE_KEYS} | {"intermediate_size": 2048}
    if not (d / "config.json").exists():
        save_tiny(kind, d, **shape)
    llm = LLM(str(d), quantization="q8_0", dtype="float32", kv_cache_memory="256MiB", max_num_batched_tokens=512,
              enable_prefix_caching=False)
    ids = [1000 + (i * 7919) % 40000 for i in range(512)]
    llm.generate([ids[:16]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    llm.generate([ids[:512]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    pp = 512 / (time.perf_counter() - t)
    t = time.perf_counter()
    llm.generate([ids[:1]], SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True))
    tg = 64 / (time.perf_counter() - t)
    native = llm.engine.runner.native
    print(json.dumps({"kind": kind, "experts": args.experts if kind == "qwen3moe" else 0, "pp512": round(pp, 1), "tg64": round(tg, 1),
                      "weight_mib": round(native.weight_bytes / 2**20) if native else None}))


if __name__ == "__main__":
    main()
