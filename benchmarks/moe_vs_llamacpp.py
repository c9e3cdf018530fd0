"""Native MoE decode/prefill vs llama-bench on one Qwen3-MoE-shaped Q4_K_M GGUF (random weights).

The file: a transformers Qwen3MoeForCausalLM with random weights, scaled down from Qwen3-30B-A3B
(hidden 1024, 6 layers, 64 experts top-8, expert FFN 256), saved by the tests' GGUF writer in
float32 and quantized to Q4_K_M by llama.cpp's own llama-quantize (benchmarks/make_qwen3_1b.py's
recipe). Both engines then read that file: llama-bench (pp256, pp512, tg128) and tokenpath's
engine through engine_vs_llamacpp's own measuring child, each in its own process with its peak RSS.
On a shared machine both engines' figures swing by 2-4x from one minute to the next (llama-bench's
the most, on this 2-core host), so --rounds N alternates the two engines N times and prints the median
and the best (least disturbed) round of each figure. TOKENPATH_KERNELS_FINE in the environment
reaches tokenpath's child (0: int8 activations, llama.cpp's scheme; the default is int8 plus
residual bytes, ~15 bits, twice the integer multiplies of a prefill GEMM).
`--model big`: the realistic file instead, Qwen3-30B-A3B's layer over 24 layers (8.5 GiB, random
blocks written straight into Q4_K_M by benchmarks/make_moe_gguf.py), where decode is bound by
memory bandwidth as on a real MoE; `--model PATH`: any GGUF. The bandwidth bound printed is a
STREAM-like read's GB/s over the bytes one token reads (every tensor once, experts at top-k of
their count: engine_vs_llamacpp.bytes_per_token). `--model mixtral`: make_moe_gguf.py's Mixtral
shape (llama with 8 experts, top-2; 5.1 GiB).
Usage: nice -n 10 python benchmarks/moe_vs_llamacpp.py [--model small|big|mixtral|PATH] [--reps 1] [--rounds 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, intermediate_size=1024,
             norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1, max_position_embeddings=4096,
             initializer_range=0.02)


def make_big(model: str = "big") -> Path:
    from benchmarks.make_moe_gguf import make, make_mixtral

    return make_mixtral() if model == "mixtral" else make()


def make_gguf() -> Path:
    from benchmarks.make_qwen3_1b import make_q4_k_m

    return make_q4_k_m("qwen3moe", "qwen3moe-a64e8-random", SHAPE)


def main() -> None:
    from benchmarks.engine_vs_llamacpp import (
        build_llamacpp,
        bytes_per_token,
        read_bandwidth,
        run_llamacpp,
        run_tokenpath,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of the two engines")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="small", help="small (the default file above), big or mixtral "
                    "(make_moe_gguf.py's), or a GGUF path")
    ap.add_argument("--make-only", action="store_true", help="only make the GGUF (what the measuring run does first, "
                    "in a child of its own)")
    args = ap.parse_args()
    if args.make_only:
        make_gguf() if args.model == "small" else make_big(args.model)
        return
    # Made in a child: the measuring children are forked from this process, and a forked child's
    # peak RSS (wait4's ru_maxrss) counts the parent's pages it started with: making the file here
    # (a float32 model in memory) put 3 GiB into both engines' peaks.
    if args.model in ("small", "big", "mixtral"):
        subprocess.run([sys.executable, __file__, "--make-only", "--model", args.model], check=True)
    gguf = make_gguf() if args.model == "small" else make_big(args.model) if args.model in ("big", "mixtral") \
        else Path(args.model)
    size = gguf.stat().st_size / 2**20
    tps, lls = [], []
    for r in range(args.rounds):
        tps.append(run_tokenpath(args.threads, "auto", args.reps, str(gguf)))
        lls.append(run_llamacpp(build_llamacpp(), args.threads, args.reps, str(gguf)))
        print(f"round {r + 1}: tokenpath {tps[-1]}, llama.cpp {lls[-1]}", file=sys.stderr)
    print(f"file {gguf.name}: {size:.0f} MiB; threads {args.threads}, reps {args.reps}, rounds {args.rounds}")
    print("| figure (tok/s) | tokenpath median | llama.cpp median | ratio | tokenpath best | llama.cpp best | ratio |\n"
          "|---|---|---|---|---|---|---|")
    for k in ("pp256", "pp512", "tg128"):
        tm, lm = statistics.median(x[k] for x in tps), statistics.median(x[k] for x in lls)
        tb, lb = max(x[k] for x in tps), max(x[k] for x in lls)
        print(f"| {k} | {tm:.1f} | {lm:.1f} | {tm / lm:.2f}x | {tb:.1f} | {lb:.1f} | {tb / lb:.2f}x |")
    tr, lr = min(x["rss_mib"] for x in tps), min(x["rss_mib"] for x in lls)
    print(f"| peak RSS (MiB, smallest) | {tr:.0f} | {lr:.0f} | {tr / lr:.2f}x | | | |")
    print(f"| peak RSS / file | {tr / size:.2f}x | {lr / size:.2f}x | | | | |")
    gbps, per_token = read_bandwidth(args.threads), bytes_per_token(str(gguf))
    bound = gbps * 1e9 / per_token
    tm, lm = (statistics.median(x["tg128"] for x in runs) for runs in (tps, lls))
    print(f"\nBandwidth bound: {gbps:.1f} GB/s (numpy read, {args.threads} threads) over {per_token / 1e6:.0f} MB "
          f"a token reads = {bound:.1f} tok/s; tg128 median: tokenpath {100 * tm / bound:.0f}%, "
          f"llama.cpp {100 * lm / bound:.0f}% of it.")


if __name__ == "__main__":
    main()
