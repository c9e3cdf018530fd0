"""A float32 safetensors checkpoint: the native F32X16 path against the torch float32 path (issue 42).

    python benchmarks/make_smollm2_hf.py --dtype float32
    python benchmarks/fp32_native.py [--dir DIR] [--tokens 128] [--runs 3]

Each path runs in a fresh process (so one's torch import or page cache state does not reach the
other's RSS): `LLM(dir, quantization=auto)` (the F32X16 kernels) and `LLM(dir, quantization=none)`
(torch, float32, the file's dtype). Each warms up with 8 tokens, then decodes `--tokens` greedy
tokens from a short prompt, one stream, `--runs` times; the best run's rate is kept (tokens over
the request's wall time, the short prefill included). Also reported: seconds to a ready engine, peak RSS
(VmHWM), and whether the two paths' greedy tokens are the same.

Writes benchmarks/results/fp32_native.json (the .md beside it is written by hand from it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".cache" / "peers" / "smollm2-135m-float32"

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from tokenpath import LLM, SamplingParams
llm = LLM(sys.argv[1], quantization=sys.argv[2], kv_cache_memory="64MiB", max_model_len=512)
ready = time.perf_counter() - t0
runner = llm.engine.runner
types = list(runner.native.weight_types) if runner.native is not None else None
n, runs = int(sys.argv[3]), int(sys.argv[4])
prompt = "The history of the printing press"
llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
best, tokens = 0.0, None
for _ in range(runs):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate(prompt, params)[0].outputs[0]
    total = time.perf_counter() - t
    tokens = list(out.token_ids)
    best = max(best, n / total)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
print(json.dumps({"ready_s": ready, "tok_s": best, "peak_rss_mib": hwm, "weight_types": types,
                  "torch_imported": "torch" in sys.modules, "tokens": tokens}))
"""


def run(path: Path, quantization: str, tokens: int, runs: int, src: Path) -> dict:
    cmd = [sys.executable, "-c", CHILD, str(path), quantization, str(tokens), str(runs)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(src)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the tokenpath source tree to run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fp32_native.json")
    args = ap.parse_args()
    if not (args.dir / "model.safetensors").is_file():
        raise SystemExit(f"{args.dir}: run benchmarks/make_smollm2_hf.py --dtype float32 first")
    rows = {}
    for label, q in (("native F32X16", "auto"), ("torch float32", "none")):
        rows[label] = r = run(args.dir, q, args.tokens, args.runs, args.src)
        print(f"{label}: {r['tok_s']:.1f} tok/s (best of {args.runs}, {args.tokens} tokens), ready "
              f"{r['ready_s']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, types {r['weight_types']}, "
              f"torch imported {r['torch_imported']}")
    native, torch_ = rows["native F32X16"], rows["torch float32"]
    same = native["tokens"] == torch_["tokens"]
    print(f"native / torch decode: {native['tok_s'] / torch_['tok_s']:.2f}x; same greedy tokens: {same}")
    args.out.write_text(json.dumps({"tokens": args.tokens, "runs": args.runs, "same_tokens": same,
                                    "rows": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                             for k, v in rows.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
