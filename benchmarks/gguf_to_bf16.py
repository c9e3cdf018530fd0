"""A dense Qwen3 GGUF's weights as a bf16 Hugging Face checkpoint, for issue 42's vLLM rows.

vLLM CPU does not run GGUF K-quants, so it gets the model as bf16 safetensors. The ~4B shape of
`make_moe_gguf.py --qwen3-4b` exists only as Q4_K_M blocks (its random weights were never float),
so "the same weights" can only mean the values those blocks decode to: each tensor is dequantized
(gguf-py, llama.cpp's own decoding), rounded to bf16 and written under transformers' Qwen3 names,
one tensor in memory at a time, in shards of about 2 GB (a 4B model is ~7.6 GB of bf16; one
in-memory save would hold all of it). config.json is read from the GGUF's metadata, and the
tokenizer is SmolLM2's, the one whose fields the GGUF carries (tests/engine/tiny_models.py).

Qwen3's q/k rows are not permuted by llama.cpp's converter (only the llama family's are), so the
GGUF's matrices are transformers' as they are. A tied embedding (no `output.weight`) stays tied.

    .venv/bin/python benchmarks/gguf_to_bf16.py GGUF OUT_DIR        (prints OUT_DIR)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

# GGUF tensor name (after `blk.N.`) -> transformers' Qwen3 name (after `model.layers.N.`).
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
SHARD_BYTES = 2 * 2**30


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; a name outside Qwen3's
    dense layout (experts, a router) is refused rather than silently dropped."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_NAMES:
        raise ValueError(f"{name}: not a dense Qwen3 tensor")
    return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"


def hf_config(reader: object) -> dict:
    """transformers' Qwen3 config.json from the GGUF's `qwen3.*` and tokenizer fields."""
    fields = reader.fields  # type: ignore[attr-defined]

    def get(key: str) -> Any:
        return fields[key].contents()

    arch = str(get("general.architecture"))
    if arch != "qwen3":
        raise ValueError(f"architecture {arch!r}: only dense qwen3 is converted")
    names = {t.name for t in reader.tensors}  # type: ignore[attr-defined]
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")  # type: ignore[attr-defined]
    layers = int(get("qwen3.block_count"))
    theta = float(get("qwen3.rope.freq_base")) if "qwen3.rope.freq_base" in fields else 10000.0  # (llama.cpp's default)
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "dtype": "bfloat16",
            "torch_dtype": "bfloat16", "hidden_size": int(get("qwen3.embedding_length")),
            "intermediate_size": int(get("qwen3.feed_forward_length")),
            "num_hidden_layers": layers, "num_attention_heads": int(get("qwen3.attention.head_count")),
            "num_key_value_heads": int(get("qwen3.attention.head_count_kv")),
            "head_dim": int(get("qwen3.attention.key_length")),
            "max_position_embeddings": int(get("qwen3.context_length")),
            "rms_norm_eps": float(f"{float(get('qwen3.attention.layer_norm_rms_epsilon')):.6g}"),
            "rope_theta": theta, "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
            "vocab_size": int(embd.shape[1]),  # (ggml order: [hidden, vocab])
            "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": layers, "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": int(get("tokenizer.ggml.bos_token_id")),
            "eos_token_id": int(get("tokenizer.ggml.eos_token_id"))}


def convert(gguf_path: Path, out: Path, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write `out` (config.json, model-0000N-of-0000M.safetensors + index, tokenizer files);
    kept when its index exists already. Written beside it first and renamed when complete."""
    if (out / "model.safetensors.index.json").is_file():
        return out
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tests.engine.tiny_models import smol_tokenizer

    reader = GGUFReader(gguf_path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = in_shard = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal in_shard
        name = f"model-{len(files) + 1:05d}.safetensors"  # renamed to -of-N once N is known
        save_file(shards[-1], str(tmp / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shards[-1]})
        shards[-1] = {}
        in_shard = 0

    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        shards[-1][hf_name(t.name)] = torch.from_numpy(np.array(values, dtype=np.float32)).to(torch.bfloat16)
        size, in_shard = size + values.size * 2, in_shard + values.size * 2
        if in_shard >= shard_bytes:
            flush()
    if shards[-1]:
        flush()
    final = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in final.items():
        os.replace(tmp / old, tmp / new)
    index = {"metadata": {"total_size": size}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config(reader), indent=2))
    smol_tokenizer().save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(convert(Path(sys.argv[1]), Path(sys.argv[2])))


if __name__ == "__main__":
    main()
