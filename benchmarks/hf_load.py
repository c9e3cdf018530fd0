"""Loading an HF safetensors checkpoint in bf16/fp16: time and peak RSS (issue 21 item 5).

    python benchmarks/hf_load.py [--dtypes bfloat16,float16,float32]

The ~1B Qwen3 of `make_qwen3_1b.py` (random weights; its float32 HF directory is kept under
.cache/peers/) is written once per dtype as its own safetensors directory. Each is then loaded by a
fresh process, `LLM(dir, dtype=<the file's dtype>)` on the torch path, which also generates 4
tokens, and the process reports the seconds to a ready engine and its peak RSS (VmHWM). The claim
under test: a bf16/fp16 checkpoint becomes a model of that dtype without a float32 copy of the
whole model on the way, so peak RSS stays near the file's size (safetensors are memory-mapped and
copied tensor by tensor into the model), not near twice it.

Writes benchmarks/results/hf_load.md and .json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "peers"
SRC = CACHE / "qwen3-1b-random-hf"

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from tokenpath import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[2], kv_cache_memory="64MiB", max_model_len=256)
ready = time.perf_counter() - t0
out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4))
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
print(json.dumps({"ready_s": ready, "peak_rss_mib": hwm, "tokens": len(out[0].outputs[0].token_ids)}))
"""


def checkpoint(dtype: str) -> Path:
    """The float32 directory's weights cast to `dtype`, beside it (written once)."""
    if dtype == "float32":
        return SRC
    dest = CACHE / f"qwen3-1b-random-hf-{dtype}"
    if not (dest / "model.safetensors").exists():
        import shutil

        import torch
        from safetensors.torch import load_file, save_file

        dest.mkdir(parents=True, exist_ok=True)
        for f in SRC.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, dest / f.name)
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(SRC / "model.safetensors").items()}
        save_file(tensors, dest / "model.safetensors.tmp", metadata={"format": "pt"})
        (dest / "model.safetensors.tmp").rename(dest / "model.safetensors")
        cfg = json.loads((dest / "config.json").read_text())
        cfg["dtype"] = cfg["torch_dtype"] = dtype
        (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hf_load")
    a = ap.parse_args()
    if not (SRC / "model.safetensors").exists():
        raise SystemExit(f"{SRC} is missing: run benchmarks/make_qwen3_1b.py first")
    rows = []
    for dtype in a.dtypes.split(","):
        path = checkpoint(dtype)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), dtype], capture_output=True, text=True,
                             check=True, cwd=ROOT)
        row = {"dtype": dtype, "file_mib": size, **json.loads(out.stdout.strip().splitlines()[-1])}
        print(row, flush=True)
        rows.append(row)
    lines = ["# Loading a ~1B Qwen3 HF safetensors checkpoint (issue 21 item 5)", "",
             f"`python benchmarks/hf_load.py --dtypes {a.dtypes}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
             "a fresh process per dtype, `LLM(dir, dtype=<the file's>)` (torch path), then 4 greedy tokens. "
             "Peak RSS is the process's VmHWM (Python, torch and the tokenizer included).", "",
             "| checkpoint dtype | safetensors MiB | seconds to a ready engine | peak RSS MiB | peak RSS / file |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['file_mib']:.0f} | {r['ready_s']:.1f} | {r['peak_rss_mib']:.0f} | "
              f"{r['peak_rss_mib'] / r['file_mib']:.2f}x |" for r in rows]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    print(a.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
