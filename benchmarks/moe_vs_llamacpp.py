"""Native MoE decode/prefill vs llama-bench on one Qwen3-MoE-shaped Q4_K_M GGUF (random weights).

The file: a transformers Qwen3MoeForCausalLM with random weights, scaled down from Qwen3-30B-A3B
(hidden 1024, 6 layers, 64 experts top-8, expert FFN 256), saved by the tests' GGUF writer in
float32 and quantized to Q4_K_M by llama.cpp's own llama-quantize (benchmarks/make_qwen3_1b.py's
recipe). Both engines then read that file: llama-bench (pp256, pp512, tg128) and tokenpath's
engine through engine_vs_llamacpp's own measuring child, each in its own process with its peak RSS.
Usage: nice -n 10 python benchmarks/moe_vs_llamacpp.py [--reps 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, intermediate_size=1024,
             norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1, max_position_embeddings=4096,
             initializer_range=0.02)


def make_gguf() -> Path:
    from benchmarks.make_qwen3_1b import make_q4_k_m

    return make_q4_k_m("qwen3moe", "qwen3moe-a64e8-random", SHAPE)


def main() -> None:
    from benchmarks.engine_vs_llamacpp import build_llamacpp, run_llamacpp, run_tokenpath

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--make-only", action="store_true", help="only make the GGUF (what the measuring run does first, "
                    "in a child of its own)")
    args = ap.parse_args()
    if args.make_only:
        make_gguf()
        return
    # Made in a child: the measuring children are forked from this process, and a forked child's
    # peak RSS (wait4's ru_maxrss) counts the parent's pages it started with: making the file here
    # (a float32 model in memory) put 3 GiB into both engines' peaks.
    subprocess.run([sys.executable, __file__, "--make-only"], check=True)
    gguf = make_gguf()
    size = gguf.stat().st_size / 2**20
    tp = run_tokenpath(args.threads, "auto", args.reps, str(gguf))
    ll = run_llamacpp(build_llamacpp(), args.threads, args.reps, str(gguf))
    rows = [f"| {k} | {tp[k]:.1f} | {ll[k]:.1f} | {tp[k] / ll[k]:.2f}x |" for k in ("pp256", "pp512", "tg128")]
    print(f"file {gguf.name}: {size:.0f} MiB; threads {args.threads}, reps {args.reps}")
    print("| figure (tok/s) | tokenpath | llama.cpp | ratio |\n|---|---|---|---|\n" + "\n".join(rows))
    print(f"| peak RSS (MiB) | {tp['rss_mib']:.0f} | {ll['rss_mib']:.0f} | {tp['rss_mib'] / ll['rss_mib']:.2f}x |")


if __name__ == "__main__":
    main()
