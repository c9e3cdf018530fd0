"""A Qwen3-MoE GGUF at a realistic scale, its random weights written straight into Q4_K_M blocks.

Issue 36's target file: Qwen3-30B-A3B's layer (hidden 2048, 32 query heads and 4 KV heads of 128,
QK-norm, 128 experts of FFN 768, top-8) over 24 layers instead of 48, so the active fraction is
the real model's (~1.1B of ~14.5B parameters active per token), with SmolLM2's 49k vocabulary
(prompts tokenize, and the file holds a chat template). About 8.6 GB.

A float32 model of that size (58 GB) cannot be made on this machine, so nothing is quantized here:
every quantized tensor is filled with blocks drawn at random from a pool of real ones, the Q4_K
and Q6_K blocks that llama.cpp's own `llama-quantize` wrote for the small MoE of
`moe_vs_llamacpp.py` (random normal weights, std 0.02). The blocks are therefore well-formed, with
the scales of weights of that spread. Each tensor's type follows llama-quantize's Q4_K_M rule:
Q6_K for `attn_v` and `ffn_down(_exps)` in the layers its `use_more_bits` picks and for the tied
embedding (the output matrix), Q4_K elsewhere; the router and norms are float32 as the converter writes them. The metadata (the
tokenizer, the chat template) is the small file's, with the shape's fields replaced.

    .venv/bin/python benchmarks/make_moe_gguf.py [--layers 24] [--dense]      (prints the file's path)
    .venv/bin/python benchmarks/moe_vs_llamacpp.py --model "$(.venv/bin/python benchmarks/make_moe_gguf.py | tail -1)"

`--dense`: its dense twin of the same active size (the issue's "cost grows with active parameters,
not total"): a Qwen3 whose one MLP per layer is top-k x expert FFN = 6144 wide, the same attention,
embedding and block pool, no router. `--qwen3-4b`: issue 42's ~4B dense shape, Qwen3-4B's layer
(hidden 2560, 32 query and 8 KV heads of 128, FFN 9728) over its 36 layers, ~3.8B parameters with
this 49k vocabulary, ~2.3 GB. The result is cached under .cache/peers/ (gitignored).

    .venv/bin/python benchmarks/engine_vs_llamacpp.py --model "$(.venv/bin/python benchmarks/make_moe_gguf.py --qwen3-4b | tail -1)"
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

# Qwen3-30B-A3B's layer; the layer count is the option.
LAYER = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, expert_ff=768)
ARCH = "qwen3moe"
QWEN3_4B = dict(hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn=9728, layers=36)  # dense


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's rule (src/llama-quant.cpp) for the layers whose attn_v and ffn_down get
    Q6_K under Q4_K_M: the first and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def block_pools(reader: object) -> dict[int, np.ndarray]:
    """Every Q4_K and Q6_K block of the small file, as rows of bytes, by type."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    pools: dict[int, list[np.ndarray]] = {T.Q4_K: [], T.Q6_K: []}
    for t in reader.tensors:  # type: ignore[attr-defined]
        if t.tensor_type in pools:
            size = GGML_QUANT_SIZES[t.tensor_type][1]
            pools[t.tensor_type].append(np.asarray(t.data).reshape(-1, size))
    return {k: np.concatenate(v) for k, v in pools.items()}


def tensors(layers: int, vocab: int, dense: bool = False, shape: dict | None = None) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape in elements, kind): kind is 'norm', 'router', 'q4' or 'q6'. `shape`: a
    dense layer of its own (QWEN3_4B) instead of the MoE's or its twin's."""
    lay = shape or LAYER
    h, d = lay["hidden"], lay["head_dim"]
    e, ff = LAYER["experts"], LAYER["expert_ff"]
    wide = shape["ffn"] if shape else LAYER["top_k"] * ff
    q, kv = lay["heads"] * d, lay["kv_heads"] * d
    out = [("token_embd.weight", (vocab, h), "q6")]  # tied: it is the output matrix too
    for i in range(layers):
        more = "q6" if use_more_bits(i, layers) else "q4"
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), "norm"), (p + "attn_q.weight", (q, h), "q4"),
                (p + "attn_k.weight", (kv, h), "q4"), (p + "attn_v.weight", (kv, h), more),
                (p + "attn_output.weight", (h, q), "q4"), (p + "attn_q_norm.weight", (d,), "norm"),
                (p + "attn_k_norm.weight", (d,), "norm"), (p + "ffn_norm.weight", (h,), "norm")]
        if dense:
            out += [(p + "ffn_gate.weight", (wide, h), "q4"), (p + "ffn_up.weight", (wide, h), "q4"),
                    (p + "ffn_down.weight", (h, wide), more)]
        else:
            out += [(p + "ffn_gate_inp.weight", (e, h), "router"), (p + "ffn_gate_exps.weight", (e, ff, h), "q4"),
                    (p + "ffn_up_exps.weight", (e, ff, h), "q4"), (p + "ffn_down_exps.weight", (e, h, ff), more)]
    out.append(("output_norm.weight", (h,), "norm"))
    return out


def make(layers: int = 24, seed: int = 0, dense: bool = False, shape: dict | None = None) -> Path:
    from benchmarks.engine_vs_llamacpp import CACHE
    from benchmarks.moe_vs_llamacpp import make_gguf
    from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter
    from gguf import GGMLQuantizationType as T

    dense = dense or shape is not None
    arch = "qwen3" if dense else ARCH
    out = CACHE / ("qwen3-4b-shape-random.Q4_K_M.gguf" if shape else
                   f"qwen3-a128e8-dense-twin-{layers}l-random.Q4_K_M.gguf" if dense else
                   f"qwen3moe-a128e8-{layers}l-random.Q4_K_M.gguf")
    if out.exists():
        return out
    small = GGUFReader(make_gguf())
    pools = block_pools(small)
    vocab = int(small.fields[f"{ARCH}.vocab_size"].contents()) if f"{ARCH}.vocab_size" in small.fields else \
        len(small.fields["tokenizer.ggml.tokens"].contents())
    lay = shape or LAYER
    h, d = lay["hidden"], lay["head_dim"]
    ffn = shape["ffn"] if shape else LAYER["top_k"] * LAYER["expert_ff"]
    shape_keys = {"block_count": layers, "embedding_length": h, "feed_forward_length": ffn,
                  "attention.head_count": lay["heads"], "attention.head_count_kv": lay["kv_heads"],
                  "attention.key_length": d, "attention.value_length": d}
    if not dense:
        shape_keys.update(expert_count=LAYER["experts"], expert_used_count=LAYER["top_k"],
                          expert_feed_forward_length=LAYER["expert_ff"])
    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(tmp, arch)
    for field in small.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        name, value = field.name, field.contents()
        if name.startswith(f"{ARCH}."):  # the shape's fields, under the written architecture's prefix
            short = name.removeprefix(f"{ARCH}.")
            if short.startswith("expert_") and dense:
                continue
            name, value = f"{arch}.{short}", shape_keys.get(short, value)
        writer.add_key_value(name, value, vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for short, value in shape_keys.items():
        if f"{ARCH}.{short}" not in small.fields:
            writer.add_key_value(f"{arch}.{short}", value, GGUFValueType.UINT32)
    kinds = {"q4": T.Q4_K, "q6": T.Q6_K}
    plan = tensors(layers, vocab, dense, shape)
    for name, shape, kind in plan:
        if kind in kinds:
            qt = kinds[kind]
            block, size = GGML_QUANT_SIZES[qt]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, kind in plan:
        if kind == "norm":
            data = np.ones(shape, np.float32)
        elif kind == "router":
            data = (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)
        else:
            qt = kinds[kind]
            block, size = GGML_QUANT_SIZES[qt]
            pool = pools[qt]
            n = int(np.prod(shape)) // block
            data = pool[rng.integers(0, len(pool), n)].reshape(*shape[:-1], shape[-1] // block * size)
        writer.write_tensor_data(data)
        if "ffn_down" in name:
            print(f"{name} {kind}", file=sys.stderr)
    writer.close()
    os.replace(tmp, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen3-30B-A3B has 48)")
    ap.add_argument("--dense", action="store_true", help="the dense twin of the same active size")
    ap.add_argument("--qwen3-4b", action="store_true", help="issue 42's ~4B dense shape (Qwen3-4B's layer, 36 layers)")
    args = ap.parse_args()
    if args.qwen3_4b:
        print(make(QWEN3_4B["layers"], shape=QWEN3_4B))
    else:
        print(make(args.layers, dense=args.dense))


if __name__ == "__main__":
    main()
