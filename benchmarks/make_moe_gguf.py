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

`--mixtral`: a Mixtral at scale (llama architecture with experts, as llama.cpp's converter writes
Mixtral: `llama.expert_count` 8, `llama.expert_used_count` 2, stacked `ffn_{gate,up,down}_exps`,
the router `ffn_gate_inp`, no QK-norm, an untied output matrix). Mixtral-8x7B itself (hidden 4096,
FFN 14336, 32 layers, 32/8 heads of 128) is ~26 GB at Q4_K_M and does not fit in this machine's
24 GiB beside anything else; this keeps what makes it Mixtral for the kernels, top-2 of 8 wide
experts (each token reads a quarter of the expert bytes, and a step of several tokens reads most
experts), and halves the width (hidden 2048, FFN 7168, 16/4 heads of 128: the same GQA ratio and
head size) over 24 layers: ~5.4 GB, of which ~1.5 GB are read per decoded token. Its blocks and
metadata come from a small Mixtral that llama-quantize made Q4_K_M (it has the Q5_K and Q8_0
blocks the 8-expert rule asks for), and its tensor types and keys are those a tiny Mixtral gets
from llama.cpp's own convert_hf_to_gguf.py + llama-quantize (mixtral_tensors).

    .venv/bin/python benchmarks/moe_vs_llamacpp.py --model "$(.venv/bin/python benchmarks/make_moe_gguf.py --mixtral | tail -1)"
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
Plan = list[tuple[str, tuple[int, ...], str]]  # (tensor name, numpy shape in elements, kind)
# Mixtral-8x7B halved in width (4096 -> 2048, FFN 14336 -> 7168, 32/8 heads of 128 -> 16/4) and
# cut to 24 of its 32 layers: ~5.4 GB; the whole model (~26 GB at Q4_K_M) does not fit in 24 GiB.
MIXTRAL = dict(hidden=2048, heads=16, kv_heads=4, head_dim=128, experts=8, top_k=2, ffn=7168, layers=24)
# The small Mixtral whose llama-quantize output gives the big one its blocks and metadata.
MIXTRAL_SMALL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, initializer_range=0.02)


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's rule (src/llama-quant.cpp) for the layers whose attn_v and ffn_down get
    Q6_K under Q4_K_M: the first and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def block_pools(reader: object) -> dict[int, np.ndarray]:
    """Every quantized block of the small file (Q4_K, Q5_K, Q6_K, Q8_0: llama-quantize's Q4_K_M
    types), as rows of bytes, by type."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    pools: dict[int, list[np.ndarray]] = {T.Q4_K: [], T.Q5_K: [], T.Q6_K: [], T.Q8_0: []}
    for t in reader.tensors:  # type: ignore[attr-defined]
        if t.tensor_type in pools:
            size = GGML_QUANT_SIZES[t.tensor_type][1]
            pools[t.tensor_type].append(np.asarray(t.data).reshape(-1, size))
    return {k: np.concatenate(v) for k, v in pools.items() if v}


def tensors(layers: int, vocab: int, dense: bool = False, shape: dict | None = None) -> Plan:
    """(name, numpy shape in elements, kind): kind is 'norm', 'router', 'q4' or 'q6'. `shape`: a
    dense layer of its own (QWEN3_4B) instead of the MoE's or its twin's."""
    lay = shape or LAYER
    h, d = lay["hidden"], lay["head_dim"]
    e, ff = LAYER["experts"], LAYER["expert_ff"]
    wide = shape["ffn"] if shape else LAYER["top_k"] * ff
    q, kv = lay["heads"] * d, lay["kv_heads"] * d
    out: Plan = [("token_embd.weight", (vocab, h), "q6")]  # tied: it is the output matrix too
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


def mixtral_tensors(layers: int, vocab: int) -> Plan:
    """Mixtral's tensors as llama-quantize types them under Q4_K_M for an 8-expert model (checked on
    a tiny Mixtral converted by llama.cpp's convert_hf_to_gguf.py and quantized by llama-quantize):
    attn_k and attn_v Q8_0 and attn_output Q5_K (llama-quant.cpp's `n_expert == 8` rules),
    ffn_down_exps Q6_K in use_more_bits' layers, the untied embedding Q4_K and output Q6_K."""
    m = MIXTRAL
    h, e, ff = m["hidden"], m["experts"], m["ffn"]
    q, kv = m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"]
    out: Plan = [("token_embd.weight", (vocab, h), "q4")]
    for i in range(layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), "norm"), (p + "attn_q.weight", (q, h), "q4"),
                (p + "attn_k.weight", (kv, h), "q8"), (p + "attn_v.weight", (kv, h), "q8"),
                (p + "attn_output.weight", (h, q), "q5"), (p + "ffn_norm.weight", (h,), "norm"),
                (p + "ffn_gate_inp.weight", (e, h), "router"), (p + "ffn_gate_exps.weight", (e, ff, h), "q4"),
                (p + "ffn_up_exps.weight", (e, ff, h), "q4"),
                (p + "ffn_down_exps.weight", (e, h, ff), "q6" if use_more_bits(i, layers) else "q4")]
    return out + [("output_norm.weight", (h,), "norm"), ("output.weight", (vocab, h), "q6")]


def write(out: Path, small: object, src_arch: str, arch: str, shape_keys: dict, drop: tuple[str, ...],
          plan: Plan, seed: int) -> Path:
    """The file `out`: `small`'s metadata (the tokenizer, the chat template) with the shape's
    fields replaced (`{src_arch}.*` renamed to `{arch}.*`, fields starting with a `drop` name left
    out), then `plan`'s tensors, quantized ones filled with blocks drawn from `small`'s."""
    from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter
    from gguf import GGMLQuantizationType as T

    pools = block_pools(small)
    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(tmp, arch)
    for field in small.fields.values():  # type: ignore[attr-defined]
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        name, value = field.name, field.contents()
        if name.startswith(f"{src_arch}."):  # the shape's fields, under the written architecture's prefix
            short = name.removeprefix(f"{src_arch}.")
            if short.startswith(drop):
                continue
            name, value = f"{arch}.{short}", shape_keys.get(short, value)
        writer.add_key_value(name, value, vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for short, value in shape_keys.items():
        if f"{src_arch}.{short}" not in small.fields:  # type: ignore[attr-defined]
            writer.add_key_value(f"{arch}.{short}", value, GGUFValueType.UINT32)
    kinds = {"q4": T.Q4_K, "q5": T.Q5_K, "q6": T.Q6_K, "q8": T.Q8_0}
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
        data: np.ndarray
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


def make(layers: int = 24, seed: int = 0, dense: bool = False, shape: dict | None = None) -> Path:
    from benchmarks.engine_vs_llamacpp import CACHE
    from benchmarks.moe_vs_llamacpp import make_gguf
    from gguf import GGUFReader

    dense = dense or shape is not None
    arch = "qwen3" if dense else ARCH
    out = CACHE / ("qwen3-4b-shape-random.Q4_K_M.gguf" if shape else
                   f"qwen3-a128e8-dense-twin-{layers}l-random.Q4_K_M.gguf" if dense else
                   f"qwen3moe-a128e8-{layers}l-random.Q4_K_M.gguf")
    if out.exists():
        return out
    small = GGUFReader(make_gguf())
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
    return write(out, small, ARCH, arch, shape_keys, ("expert_",) if dense else (), tensors(layers, vocab, dense, shape),
                 seed)


def make_mixtral(layers: int = MIXTRAL["layers"], seed: int = 0) -> Path:
    """The Mixtral-shaped file (MIXTRAL), its metadata and blocks from a small Mixtral that
    llama-quantize made Q4_K_M (the Q5_K and Q8_0 blocks the Qwen3-MoE file lacks), its keys
    those llama.cpp's converter writes for Mixtral: no `expert_feed_forward_length` (the experts'
    width is `feed_forward_length`), `rope.dimension_count` and `vocab_size` added."""
    from benchmarks.engine_vs_llamacpp import CACHE
    from benchmarks.make_qwen3_1b import make_q4_k_m
    from gguf import GGUFReader

    out = CACHE / f"mixtral-e8t2-{layers}l-h{MIXTRAL['hidden']}-random.Q4_K_M.gguf"
    if out.exists():
        return out
    small = GGUFReader(make_q4_k_m("mixtral", "mixtral-e8t2-small-random", MIXTRAL_SMALL, tie=False))
    vocab = len(small.fields["tokenizer.ggml.tokens"].contents())
    m = MIXTRAL
    shape_keys = {"block_count": layers, "embedding_length": m["hidden"], "feed_forward_length": m["ffn"],
                  "attention.head_count": m["heads"], "attention.head_count_kv": m["kv_heads"],
                  "attention.key_length": m["head_dim"], "attention.value_length": m["head_dim"],
                  "expert_count": m["experts"], "expert_used_count": m["top_k"],
                  "rope.dimension_count": m["head_dim"], "vocab_size": vocab}
    return write(out, small, "llama", "llama", shape_keys, ("expert_feed_forward_length",),
                 mixtral_tensors(layers, vocab), seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, help="decoder layers (default 24; Qwen3-30B-A3B has 48, Mixtral 32)")
    ap.add_argument("--dense", action="store_true", help="the dense twin of the same active size")
    ap.add_argument("--mixtral", action="store_true", help="the scaled Mixtral shape (MIXTRAL: 8 experts, top-2)")
    ap.add_argument("--qwen3-4b", action="store_true", help="issue 42's ~4B dense shape (Qwen3-4B's layer, 36 layers)")
    args = ap.parse_args()
    if args.qwen3_4b:
        print(make(QWEN3_4B["layers"], shape=QWEN3_4B))
    elif args.mixtral:
        print(make_mixtral(args.layers or MIXTRAL["layers"]))
    else:
        print(make(args.layers or 24, dense=args.dense))


if __name__ == "__main__":
    main()
