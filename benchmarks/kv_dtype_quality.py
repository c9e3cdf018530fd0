"""What the KV cache's storage dtype costs and buys (issue 42, item 3: --kv-cache-dtype fp8).

For SmolLM2-135M and Gemma 3 270M (their GGUFs, the default native path and precision), per
--kv-cache-dtype (float32, float16, fp8_e5m2, fp8_e4m3, and llama.cpp's q8_0):

- KV bytes per token of context: 2 (K and V) x layers x KV heads x head_dim x bytes per value,
  read from the engine's own pool (its bytes per block over the block size, every layer's blocks:
  --disable-hybrid-kv-cache-manager, so Gemma's window layers count in full), and the tokens the
  default 512 MiB budget holds;
- perplexity on tests/engine/data/perplexity_text.txt from the serving path's prompt_logprobs,
  scored as benchmarks/perplexity.py scores it (windows of --ctx tokens, the second half of each
  window; the text tokenized by tokenpath here, so the figures compare dtypes with each other, not
  with llama.cpp's table);
- single-stream decode tok/s after a --long-token prompt (the engine's own first-token and finish
  stamps: (tokens - 1) / (finished - first_token)), float16 against fp8: at long context decode
  reads the whole cache every token, so the narrower pool is where fp8 could save time.
  Timings on a loaded 2-core host are noisy: the best of --repeats runs is reported.
- the attention kernel alone (csrc/attention.h, or attn_avx512.cpp on AVX-512, through tp_attend_tile_test, one thread): one decode
  row over --long keys at each model's head shape, per pool dtype, best of many short timed loops;
  less exposed to the host's load than the engine's decode, and it isolates what the conversion
  costs or saves where the pool is read.

    .venv/bin/python benchmarks/kv_dtype_quality.py                 # both models, ~10 min on 2 cores
    .venv/bin/python benchmarks/kv_dtype_quality.py --models smollm2-135m-instruct --long 1024
    .venv/bin/python benchmarks/kv_dtype_quality.py --kernel-only   # the kernel table alone (seconds)

Writes benchmarks/results/kv_dtype_quality.md and .json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from tokenpath import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent
TEXT = ROOT.parent / "tests" / "engine" / "data" / "perplexity_text.txt"
MODELS = ["smollm2-135m-instruct", "gemma-3-270m"]
DTYPES = ["float32", "float16", "fp8_e5m2", "fp8_e4m3", "q8_0"]
BUDGET = "512MiB"  # the default kv_cache_memory


def perplexity(llm: LLM, ids: list[int], ctx: int, most: int) -> tuple[float, int]:
    """(PPL, scored tokens): the first `most` windows of ctx tokens, the second half of each scored."""
    chunks = [ids[i * ctx:(i + 1) * ctx] for i in range(min(most, len(ids) // ctx))]
    outs = llm.generate(chunks, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    nll, count = 0.0, 0
    for w, out in zip(chunks, outs, strict=True):
        lps = out.prompt_logprobs
        for k in range(ctx // 2 + 1, ctx):
            if lps is None or lps[k] is None or lps[k].token_id != w[k]:
                raise RuntimeError(f"position {k} has no logprob for its token")
            nll -= lps[k].logprob
            count += 1
    return math.exp(nll / count), count


def decode_rate(llm: LLM, prompt: list[int], new: int, repeats: int) -> float:
    """Best decode tok/s over `repeats` requests of `new` tokens after `prompt` (the repeats prefill
    it from the prefix cache: the figure is decode only, from the first token on)."""
    best = 0.0
    for _ in range(repeats):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))[0]
        ev = out.events
        best = max(best, (len(out.outputs[0].token_ids) - 1) / (ev.finished - ev.first_token))
    return best


# (KV heads, query heads per KV head, head_dim) of each model's attention
HEAD_SHAPES = {"smollm2-135m-instruct": (3, 3, 64), "gemma-3-270m": (1, 4, 256)}


def attention_us(kv: str, shape: tuple[int, int, int], keys: int, loops: int = 30, rounds: int = 21) -> float:
    """Microseconds per decode row of the attention kernel over `keys` keys (best round)."""
    import numpy as np

    from tokenpath.engine.kernels import native_library
    from tokenpath.engine.kernels.model import KV_KINDS
    from tokenpath.engine.kv_cache import NUMPY_STORAGE, head_bytes

    lib = native_library()
    n_kv, rep, d = shape
    bs = 16
    rng = np.random.default_rng(0)
    table = np.arange(keys // bs, dtype=np.int32)
    values = (rng.standard_normal((keys, n_kv * d)) * 2).astype(np.float32)
    pools = []
    for _ in "kv":
        if NUMPY_STORAGE[kv] == "uint8":  # codes or blocks, written by the kernels' own conversion
            pool = np.empty((keys, n_kv * head_bytes(kv, d)), np.uint8)
            lib.lib.tp_kv_convert(KV_KINDS[kv], 0, values.ctypes.data, pool.ctypes.data, values.size)
        else:
            pool = values.astype(kv)
        pools.append(pool)
    q = rng.standard_normal((1, n_kv * rep, d)).astype(np.float32)
    out = np.zeros_like(q)
    args = (KV_KINDS[kv], pools[0].ctypes.data, pools[1].ctypes.data, q.ctypes.data, out.ctypes.data,
            table.ctypes.data, 1, keys - 1, bs, n_kv, d, rep, d**-0.5, 0, lib.isa())
    best = math.inf
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(loops):
            lib.lib.tp_attend_tile_test(*args)
        best = min(best, (time.perf_counter() - started) / loops)
    return best * 1e6


def run(model: str, kv: str, args: argparse.Namespace) -> dict:
    llm = LLM(model, kv_cache_dtype=kv, kv_cache_memory=BUDGET, max_model_len=args.long + args.new + 16,
              disable_hybrid_kv_cache_manager=True)
    runner = llm.engine.runner
    ids = llm.tokenizer.encode(TEXT.read_text())
    row = {"model": model, "kv": runner.kv_dtype,
           "bytes_per_token": runner.bytes_per_block // runner.block_size,
           "tokens_in_budget": runner.num_blocks * runner.block_size}
    started = time.perf_counter()
    llm.engine.blocks.reset_prefix_cache()
    row["ppl"], row["scored"] = perplexity(llm, ids, args.ctx, args.windows)
    row["ppl_seconds"] = round(time.perf_counter() - started, 1)
    if kv in args.decode_dtypes:
        prompt = (ids * (args.long // len(ids) + 1))[: args.long]
        row["decode_tok_s"] = round(decode_rate(llm, prompt, args.new, args.repeats), 1)
    print(json.dumps(row), file=sys.stderr)
    del llm, runner
    gc.collect()
    return row


def write(rows: list[dict], kernel: list[dict], args: argparse.Namespace, load: float | None = None) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "ctx": args.ctx,
            "long": args.long, "new": args.new, "repeats": args.repeats, "windows": args.windows,
            "load": os.getloadavg()[0] if load is None else load}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "kernel": kernel}, indent=1) + "\n")
    lines = [f"# KV cache dtype: bytes, perplexity, long-context decode ({meta['when']})", "",
             f"`python benchmarks/kv_dtype_quality.py` on {meta['cpus']} CPUs ({meta['machine']}), the default "
             f"native path and precision. Perplexity: `{TEXT.relative_to(ROOT.parent)}`, windows of {args.ctx}, "
             f"the second half of each scored (prompt_logprobs), at most {args.windows} windows. Decode: one request, {args.new} tokens after a "
             f"{args.long}-token prompt, best of {args.repeats}; load average {meta['load']:.1f} at the end: "
             "timings are noisy on this shared host.", "",
             "| model | --kv-cache-dtype | KV bytes/token | tokens in 512 MiB | perplexity | vs float32 "
             "| decode tok/s @ long ctx |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x["ppl"] for x in rows if x["model"] == r["model"] and x["kv"] == "float32")
        dec = r.get("decode_tok_s")
        lines.append(f"| {r['model']} | {r['kv']} | {r['bytes_per_token']} | {r['tokens_in_budget']} | "
                     f"{r['ppl']:.4f} | {r['ppl'] / base - 1:+.2%} | {'' if dec is None else dec} |")
    lines += ["", "KV bytes per token count every layer (Gemma 3's window layers included: with the hybrid "
              "KV manager they keep only their 512-token window, benchmarks/kv_window.py). fp8 stores one byte "
              "per value with no scale (vLLM's default k_scale = v_scale = 1.0): e4m3 keeps 3 mantissa bits "
              "(max 448), e5m2 2 bits (max 57344). q8_0 is llama.cpp's cache type: blocks of 32 int8 with an "
              "IEEE half scale (34 bytes per 32 values).", "",
              f"The attention kernel alone, one decode row over {args.long} keys, one thread, best of 21 rounds "
              "of 30 calls (microseconds; the pool's rows widened to floats a 32-key block at a time):", "",
              "| model (KV heads x query heads per KV head x head_dim) | " + " | ".join(
                  r["kv"] for r in kernel if r["model"] == kernel[0]["model"]) + " |",
              "|---|" + "---|" * sum(r["model"] == kernel[0]["model"] for r in kernel)]
    for model in dict.fromkeys(r["model"] for r in kernel):
        cells = [f"{r['us']:.0f}" for r in kernel if r["model"] == model]
        lines.append(f"| {model} ({'x'.join(map(str, HEAD_SHAPES[model]))}) | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(out.with_suffix(".md").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--dtypes", nargs="+", default=DTYPES)
    ap.add_argument("--decode-dtypes", nargs="+", default=["float16", "fp8_e5m2", "fp8_e4m3", "q8_0"])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4, help="most perplexity windows (the text has 4 of 512)")
    ap.add_argument("--long", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "kv_dtype_quality"))
    ap.add_argument("--kernel-only", action="store_true",
                    help="rerun the attention-kernel table only, keeping the engine rows of the last run's .json")
    args = ap.parse_args()
    if "float32" not in args.dtypes:
        raise SystemExit("--dtypes must include float32 (the perplexity baseline)")
    load = None
    if args.kernel_only:  # the engine rows of the last full run (and its settings), a fresh kernel table
        last = json.loads(Path(args.out).with_suffix(".json").read_text())
        rows, load = last["rows"], last["meta"]["load"]
        for key in ("ctx", "long", "new", "repeats", "windows"):
            setattr(args, key, last["meta"][key])
    else:
        rows = [run(model, kv, args) for model in args.models for kv in args.dtypes]
    kernel = [{"model": model, "kv": kv, "us": round(attention_us(kv, HEAD_SHAPES[model], args.long), 1)}
              for model in args.models for kv in args.dtypes]
    write(rows, kernel, args, load)


if __name__ == "__main__":
    main()
