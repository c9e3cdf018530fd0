"""`--quantization q4_k` on a bf16 safetensors checkpoint against llama.cpp's own Q4_K_M of the same
weights (issue 42: "`--quantization q8_0`/`q4_k` as opt-in conversions at load").

The checkpoint is benchmarks/make_smollm2_hf.py's bf16 SmolLM2-135M. llama.cpp's file is made from
the same weights: written as a float32 GGUF (tests/engine/tiny_models.py `save_gguf`, SmolLM2's
tokenizer), then `llama-quantize Q4_K_M`. Perplexity is perplexity.py's: the same tokens (llama-
tokenize), windows and scoring as `llama-perplexity`, tokenpath's from `prompt_logprobs`. Weight
MiB is what the kernels hold (their log line); decode is one greedy stream of 128 tokens after a
16-token prompt, on the wall clock (`--threads` kernel threads), best of `--reps`.

    .venv/bin/python benchmarks/quantize_q4k.py [--ctx 256] [--reps 3]

Prints a Markdown table; the results file is written by hand with the time and the machine's load.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "benchmarks")]

from benchmarks.engine_vs_llamacpp import CACHE, build_llamacpp  # noqa: E402
from benchmarks.make_qwen3_1b import build_quantize  # noqa: E402
from benchmarks.perplexity import llama_env, llama_perplexity, llama_tokens, tokenpath_perplexity, windows  # noqa: E402


def q4_k_m(hf: Path) -> Path:
    """llama.cpp's Q4_K_M of the checkpoint in `hf` (cached beside it)."""
    from tests.engine.tiny_models import save_gguf

    out = CACHE / f"{hf.name}.Q4_K_M.gguf"
    if not out.exists():
        bin_dir = build_llamacpp()
        f32 = save_gguf("llama", hf, CACHE / f"{hf.name}.f32.gguf")
        tmp = out.with_name(out.name + ".tmp")
        subprocess.run([str(build_quantize(bin_dir.parent.parent)), str(f32), str(tmp), "Q4_K_M"], check=True,
                       env=llama_env(bin_dir), stdout=sys.stderr, stderr=sys.stderr)
        os.replace(tmp, out)
    return out


def decode_tok_s(model: str, overrides: dict, reps: int) -> tuple[float, float]:
    """(best decode tok/s over `reps` greedy 128-token streams, the kernels' weight MiB)."""
    from tokenpath import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=False, **overrides)
    native = llm.engine.runner.native
    mib = native.weight_bytes / 2**20 if native is not None else float("nan")
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(["Warm up."], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    best = 0.0
    for i in range(reps):
        t0 = time.perf_counter()
        out = llm.generate([f"Once upon a time, number {i},"], params)[0]
        n = len(out.outputs[0].token_ids)
        best = max(best, n / (time.perf_counter() - t0))
    del llm
    gc.collect()
    return best, mib


def llama_bench_tg(bin_dir: Path, gguf: Path, threads: int) -> float:
    res = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", "128", "-t", str(threads),
                          "-o", "md"], capture_output=True, text=True, env=llama_env(bin_dir), check=True)
    m = re.search(r"tg128 \|\s*([0-9.]+)", res.stdout)
    return float(m.group(1)) if m else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    hf = Path(subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_smollm2_hf.py")], check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1])
    gguf = q4_k_m(hf)
    bin_dir = build_llamacpp()
    chunks = windows(llama_tokens(bin_dir, gguf), args.ctx, None)
    rows = []
    ppl, _, _ = llama_perplexity(bin_dir, gguf, args.ctx, args.threads)
    rows.append(("llama.cpp, its Q4_K_M of these weights", ppl, llama_bench_tg(bin_dir, gguf, args.threads),
                 gguf.stat().st_size / 2**20))
    for label, model, overrides in [
        ("tokenpath, the bf16 checkpoint (default: bf16 matrices)", str(hf), {}),
        ("tokenpath, `--quantization q8_0`", str(hf), {"quantization": "q8_0"}),
        ("tokenpath, `--quantization q4_k`", str(hf), {"quantization": "q4_k"}),
        ("tokenpath, llama.cpp's Q4_K_M file", str(gguf), {}),
    ]:
        ppl, _ = tokenpath_perplexity(model, overrides, chunks, args.ctx)
        tok_s, mib = decode_tok_s(model, overrides, args.reps)
        rows.append((label, ppl, tok_s, mib))
    print(f"SmolLM2-135M bf16 safetensors; {len(chunks)} windows of {args.ctx} tokens; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| engine and weights | perplexity | decode tok/s | weights (MiB) |\n|---|---|---|---|")
    for label, ppl, tok_s, mib in rows:
        print(f"| {label} | {ppl:.4f} | {tok_s:.1f} | {mib:.1f} |")


if __name__ == "__main__":
    main()
