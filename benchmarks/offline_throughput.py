"""Offline throughput on SmolLM2: tokenpath's engine against transformers' batched `generate`.

Both run the same 64 prompts (128 to 512 tokens, seeded) with 128 output tokens each, ignore_eos,
in the same dtype, each in its own subprocess (so peak RSS is per engine), one after the other in
one run of this script. Also measures single-stream decode tok/s next to the bound set by weight
bytes read per token over the measured memory bandwidth.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 64] [--output-len 128] [--dtype auto]

Writes benchmarks/results/offline_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def make_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    import random

    from tokenpath.engine.loader import resolve_model_path
    from tokenpath.engine.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_path("smollm2-135m-instruct"))
    rng = random.Random(seed)
    words = ["the", "a", "river", "stone", "light", "garden", "music", "paper", "window", "silver", "morning", "engine", "quiet", "market"]
    prompts = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(length * 2)))
        prompts.append(ids[:length])
    return prompts


def run_tokenpath(args, prompts) -> dict:
    from tokenpath import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    p = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, p)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    single = SamplingParams(temperature=0, max_tokens=args.single_len, ignore_eos=True)
    t = time.perf_counter()
    one = llm.generate([prompts[0][:32]], single)[0]
    single_dt = one.events.finished - one.events.first_token
    runner = llm.engine.runner
    # On the native kernels (the default for the GGUF) the weights stay in their GGUF blocks and
    # everything else is float32: say so instead of the torch dtype.
    kind = (f"{runner.native.weight_bytes / 2**20:.0f} MiB GGUF blocks (native kernels), float32 compute"
            if runner.native is not None else str(runner.dtype).removeprefix("torch."))
    return {"engine": "tokenpath", "dtype": str(runner.dtype).removeprefix("torch."), "weights": kind,
            "weight_bytes": runner.native.weight_bytes if runner.native is not None else None,
            "seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt,
            "single_stream_decode_tok_s": (len(one.outputs[0].token_ids) - 1) / single_dt}


def run_transformers(args, prompts) -> dict:
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    from tokenpath.engine.loader import resolve_model_path
    from tokenpath.engine.runner_torch import cpu_has_bf16

    dtype = {"auto": torch.bfloat16 if cpu_has_bf16() else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    path = resolve_model_path("smollm2-135m-instruct")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    pad = 2
    n_out = 0
    t = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        batch = prompts[i : i + args.hf_batch]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
        n_out += (out.shape[1] - width) * len(batch)
    dt = time.perf_counter() - t
    single = torch.tensor([prompts[0][:32]])
    with torch.inference_mode():
        model.generate(single, max_new_tokens=4, do_sample=False, pad_token_id=pad)
        t = time.perf_counter()
        model.generate(single, max_new_tokens=args.single_len, min_new_tokens=args.single_len, do_sample=False,
                       pad_token_id=pad)
    single_dt = time.perf_counter() - t
    return {"engine": "transformers", "dtype": str(dtype).removeprefix("torch."), "seconds": dt,
            "output_tokens": n_out, "tok_s": n_out / dt, "batch": args.hf_batch,
            "single_stream_decode_tok_s": args.single_len / single_dt}


def memory_bandwidth_gbs() -> float:
    """A large copy, best of several: the bandwidth a decode step can hope for."""
    import torch

    src = torch.empty(256 * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9  # read + write


def child(args) -> None:
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, args.seed)
    res = run_tokenpath(args, prompts) if args.child == "tokenpath" else run_transformers(args, prompts)
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="tokenpath,transformers")
    ap.add_argument("--note", default="", help="a sentence for the report, e.g. what else ran on the machine")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    results = []
    for engine in args.engines.split(","):
        cmd = [sys.executable, __file__, "--child", engine] + [a for a in sys.argv[1:]]
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{engine} failed:\n{proc.stderr[-3000:]}")
        results.append({**json.loads(line[7:]), "load_before": load, "load_after": os.getloadavg()[0]})
        print(results[-1], flush=True)
    write_report(args, results)


def write_report(args, results: list[dict]) -> None:
    import torch

    from tokenpath.engine.loader import load_model

    cfg = load_model("smollm2-135m-instruct").config
    n_params = (cfg.vocab_size * cfg.hidden_size + cfg.num_layers * (
        cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size))
    bw = memory_bandwidth_gbs()
    by = {r["engine"]: r for r in results}
    elem = 2 if results[0]["dtype"] == "bfloat16" else 4
    # The bytes a decode step reads: the native kernels' GGUF blocks, else the torch weights.
    step_bytes = by.get("tokenpath", {}).get("weight_bytes") or n_params * elem
    bound = bw * 1e9 / step_bytes
    cpu_lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpu_lines if ln.startswith("model name")), "?")

    lines = [
        "# Offline throughput: tokenpath vs transformers `generate` (SmolLM2-135M-Instruct)",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {os.cpu_count()} cores ({cpu}), "
        f"Python {platform.python_version()}, torch {torch.__version__}. Command: "
        f"`python benchmarks/offline_throughput.py {' '.join(sys.argv[1:])}`",
        "",
        f"Workload: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens (seed {args.seed}), "
        f"{args.output_len} output tokens each, greedy, ignore_eos. transformers: left-padded batches of "
        f"{args.hf_batch}. Same float32 compute for both; tokenpath reads the GGUF's quantized blocks "
        "(its default), transformers the same GGUF dequantized to float32.",
        "",
        "1-min load average before/after each engine: "
        + ", ".join(f"{r['engine']} {r['load_before']:.1f}/{r['load_after']:.1f}" for r in results)
        + f" on {os.cpu_count()} cores (other work on the machine moves the absolute figures; the ratio "
        "is what to read)." + (f" {args.note}" if args.note else ""),
        "",
        "| engine | weights / dtype | output tok/s | seconds | single-stream decode tok/s | peak RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['engine']} | {r.get('weights', r['dtype'])} | {r['tok_s']:.1f} | {r['seconds']:.1f} | "
                     f"{r['single_stream_decode_tok_s']:.1f} | {r['peak_rss_mib']:.0f} |")
    if "tokenpath" in by and "transformers" in by:
        lines += ["", f"**Ratio (tokenpath / transformers), batched: "
                      f"{by['tokenpath']['tok_s'] / by['transformers']['tok_s']:.2f}x; single stream: "
                      f"{by['tokenpath']['single_stream_decode_tok_s'] / by['transformers']['single_stream_decode_tok_s']:.2f}x**"]
    lines += ["", f"Single-stream bound for tokenpath: {step_bytes / 2**20:.0f} MiB of weights read per token over "
                  f"{bw:.1f} GB/s measured copy bandwidth = {bound:.0f} tok/s."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offline_throughput.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "offline_throughput.json").write_text(json.dumps(
        {"args": vars(args), "results": results, "bandwidth_gbs": bw, "bound_tok_s": bound}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
