"""A ~1B-shaped Qwen3 with random weights, as Q4_K_M GGUF: the model where decode is bound by
memory bandwidth rather than by per-token overheads (issue 21's second speed target).

Shape: hidden 2048, 16 layers, 16 query heads and 8 KV heads of 128, FFN 6144, QK-norm, SmolLM2's
49k-token vocabulary (the tests' harness uses it, so prompts tokenize): about 0.9B parameters.
Made by transformers from a config (tests/engine/tiny_models.py, nothing downloaded), written as
a float32 GGUF the way llama.cpp's converter writes it, then quantized by llama.cpp's own
`llama-quantize Q4_K_M` (built from the vendored source by engine_vs_llamacpp.py). The result is
cached under .cache/peers/ (gitignored); prints its path.

    .venv/bin/python benchmarks/make_qwen3_1b.py [--bf16]   (--bf16: the same weights as bf16 safetensors)
    .venv/bin/python benchmarks/engine_vs_llamacpp.py --model "$(.venv/bin/python benchmarks/make_qwen3_1b.py | tail -1)" \\
        --out benchmarks/results/engine_vs_llamacpp-qwen3-1b.md
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, initializer_range=0.02)


def build_quantize(src: Path) -> Path:
    """llama-quantize from the same build tree as llama-bench (an incremental build: ggml is shared)."""
    tool = src / "build" / "bin" / "llama-quantize"
    if not tool.exists():
        subprocess.run(["cmake", "--build", "build", "--target", "llama-quantize", f"-j{os.cpu_count()}"],
                       cwd=src, check=True, stdout=sys.stderr)
    return tool


def make_q4_k_m(kind: str, stem: str, shape: dict, **save_kw: object) -> Path:
    """The recipe every random-weight benchmark GGUF follows: a transformers model of ``kind`` and
    ``shape`` (cached as ``{stem}-hf``), written as float32 GGUF, then quantized to Q4_K_M by
    llama.cpp's own llama-quantize. Returns the cached ``{stem}.Q4_K_M.gguf``."""
    from benchmarks.engine_vs_llamacpp import CACHE, build_llamacpp
    from tests.engine.tiny_models import save_gguf, save_tiny

    out = CACHE / f"{stem}.Q4_K_M.gguf"
    if not out.exists():
        bin_dir = build_llamacpp()
        quantize = build_quantize(bin_dir.parent.parent)
        hf = CACHE / f"{stem}-hf"
        if not (hf / "config.json").exists():
            save_tiny(kind, hf, **save_kw, **shape)
        f32 = save_gguf(kind, hf, CACHE / f"{stem}.f32.gguf")
        tmp = out.with_name(out.name + ".tmp")
        env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
        subprocess.run([str(quantize), str(f32), str(tmp), "Q4_K_M"], check=True, env=env, stdout=sys.stderr)
        os.replace(tmp, out)
        f32.unlink()  # gigabytes; the HF directory stays for reference runs
    return out


def make_bf16(kind: str, stem: str, shape: dict, **save_kw: object) -> Path:
    """The same random model as bf16 safetensors (``{stem}-bf16``, with its tokenizer): what vLLM CPU
    serves, and the safetensors rows of benchmarks/memory.py. Made from the cached float32 HF
    directory (``{stem}-hf``, made first when missing), so the GGUF and this hold the same weights."""
    import shutil

    import torch
    import transformers
    from benchmarks.engine_vs_llamacpp import CACHE
    from tests.engine.tiny_models import save_tiny

    out = CACHE / f"{stem}-bf16"
    if not (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists():
        hf = CACHE / f"{stem}-hf"
        if not (hf / "config.json").exists():
            save_tiny(kind, hf, **save_kw, **shape)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).save_pretrained(str(tmp))
        for f in hf.iterdir():
            if f.is_file() and not f.name.startswith(("model", "config.json")):
                shutil.copy(f, tmp / f.name)
        os.replace(tmp, out)
    return out


def main() -> None:
    if "--bf16" in sys.argv[1:]:
        print(make_bf16("qwen3", "qwen3-1b-random", SHAPE, tie=False))
    else:
        print(make_q4_k_m("qwen3", "qwen3-1b-random", SHAPE, tie=False))


if __name__ == "__main__":
    main()
