"""Tiny random-weight checkpoints of every supported family, made by transformers from configs
(nothing downloaded), and their GGUF forms written with gguf-py the way llama.cpp's converter
writes them (llama Q/K rows permuted, Gemma norms stored as 1 + w, rope_freqs for llama3).

Norm weights are randomized too, so a loader that drops or mis-offsets a norm shows up.
Building a tokenizer from GGUF metadata and loading a GGUF into transformers take seconds each
(tens under load), so `cached_tiny` keeps each family's checkpoints, GGUF and reference tokens in
the data dir, keyed by everything that determines them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tokenpath.engine.loader import resolve_model_path

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}

# kind -> (transformers config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": YARN_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # 6 layers: llama.cpp's fixed pattern (5 windowed, 1 global); head_dim 256 as the real ones.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"num_hidden_layers": 6, "head_dim": 256, "num_key_value_heads": 1, "sliding_window": 8,
                "query_pre_attn_scalar": 256}),
    # query_pre_attn_scalar != head_dim: the attention scale is its own field
    "gemma3-scalar": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                      {"num_hidden_layers": 3, "head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 24,
                       "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # Mixtures of experts: 8 experts, top-2. Qwen3-MoE with a dense layer between sparse ones
    # (mlp_only_layers), with and without renormalized top-k weights; Mixtral (always renormalized).
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 {"num_hidden_layers": 3, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3moe-unnorm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                         "norm_topk_prob": False}),
    # Qwen3-MoE as llama.cpp's qwen3moe graph computes it: a router in every layer, top-k always
    # renormalized (tests/peers/test_llamacpp_moe.py converts it with llama.cpp's converter).
    "qwen3moe-sparse": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # OLMoE: q/k norms over the whole projection, softmax top-k not renormalized (its default).
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    # Granite MoE: stacked experts, top-k logits then softmax, and its four multipliers (none 1).
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                    "embedding_multiplier": 4.0, "attention_multiplier": 0.2, "residual_multiplier": 0.6,
                    "logits_scaling": 3.0}),
    # gpt-oss: 3 layers (sliding, full, sliding; window 8), 8 experts top-4 with biases, attention
    # sinks, YaRN without truncation. swiglu_limit 1.0 (the real one is 7.0): these random
    # activations reach it often, so the clamps are exercised.
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                {"num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 8,
                 "num_experts_per_tok": 4, "sliding_window": 8, "swiglu_limit": 1.0, "tie_word_embeddings": False,
                 "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 32,
                                     "rope_theta": 150000.0}}),
}


@functools.cache
def smol_tokenizer():
    """SmolLM2's tokenizer as transformers' object (to save beside a tiny model), read from the
    engine's own cache of tokenizers built from GGUF."""
    from transformers import PreTrainedTokenizerFast

    from tokenpath.engine.tokenizer import Tokenizer, gguf_tokenizer_cache

    gguf = resolve_model_path("smollm2-135m-instruct")
    Tokenizer(gguf)  # builds the saved tokenizer when this data dir has none yet
    return PreTrainedTokenizerFast.from_pretrained(str(gguf_tokenizer_cache(gguf)))


def cached_tiny(kind: str) -> Path:
    """The HF directory of `save_tiny(kind)`, made once and kept under the data dir."""
    import transformers

    from tokenpath.config import resolve_data_dir

    key = hashlib.sha256(json.dumps([kind, FAMILIES[kind], transformers.__version__,
                                     Path(__file__).read_text()], sort_keys=True).encode()).hexdigest()[:12]
    final = resolve_data_dir() / "test-cache" / f"tiny-{kind}-{key}"
    if not (final / "hf" / "config.json").is_file():
        tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        save_tiny(kind, tmp / "hf")
        try:
            os.replace(tmp, final)
        except OSError:  # another process made it first: same content
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "hf"


def cached_json(path: Path, make: Callable[[], object]) -> object:
    """`make()`'s JSON result, kept at `path` (references computed by transformers)."""
    if path.is_file():
        return json.loads(path.read_text())
    value = make()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
    return value


def save_tiny(kind: str, path: Path, tie: bool = True, seed: int = 0, **config) -> Path:
    """A small model of one family (FAMILIES) with SmolLM2's tokenizer (so prompts and chat
    templates work); `config` overrides entries of the model config (e.g. head_dim)."""
    import transformers

    cfg_cls, model_cls, family = FAMILIES[kind]
    tok = smol_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=tie, initializer_range=0.2,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    common.update(family)
    common.update(config)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # random q/k/v biases (qwen2) so the bias path matters
                p.normal_(0, 0.5)
            elif "norm" in name:  # Gemma norms multiply by 1 + w (init 0), the others by w (init 1)
                p.copy_(p + torch.randn_like(p) * 0.3)
            elif name.endswith(".sinks"):  # gpt-oss' sink logits: a weight in the softmax comparable to a score's
                p.normal_(0, 1.0)
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return path


# ---------------------------------------------------------------- GGUF, as llama.cpp writes it

_GGUF_ARCH = {"llama": "llama", "llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
              "gemma3": "gemma3", "qwen3moe": "qwen3moe", "mixtral": "llama"}
_TENSOR_NAMES = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
                 ("lm_head.weight", "output.weight")]
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}


_EXPERT_MATS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _stack_experts(tensors: dict, n_exp: int, names: dict) -> dict:
    """Qwen3-MoE / Mixtral expert tensors -> llama.cpp's stacked [experts, rows, cols] ones, and
    the router to ffn_gate_inp (their GGUF names added to `names`)."""
    out = {}
    for name, t in tensors.items():
        if ".experts.0." in name:
            prefix, rest = name.split(".experts.0.")
            mat = rest.removesuffix(".weight")
            out[name] = torch.stack([tensors[f"{prefix}.experts.{e}.{rest}"] for e in range(n_exp)])
            names[name] = f"blk.{name.split('.')[2]}.{_EXPERT_MATS[mat]}.weight"
        elif ".experts." not in name:
            if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
                names[name] = f"blk.{name.split('.')[2]}.ffn_gate_inp.weight"
            out[name] = t
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for llama3 scaling (the divisor of each plain frequency)."""
    import math

    p = cfg.rope_parameters
    base, dim = p["rope_theta"], cfg.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    orig, factor = p["original_max_position_embeddings"], p["factor"]
    low_wl, high_wl = orig / p["low_freq_factor"], orig / p["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (orig / wl - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


@functools.cache
def _tokenizer_fields() -> list[tuple]:
    import gguf

    src = gguf.GGUFReader(resolve_model_path("smollm2-135m-instruct"))
    return [(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
            for key, f in src.fields.items() if key.startswith("tokenizer.")]


def save_gguf(kind: str, hf_dir: Path, out: Path, chat_template: str | None = None,
              expert_type: int | None = None) -> Path:
    """The HF checkpoint in `hf_dir` as a float32 GGUF, with SmolLM2's tokenizer metadata
    (`chat_template`: another `tokenizer.chat_template` than SmolLM2's, as a model's GGUF ships it;
    `expert_type`: the stacked experts as all-zero blocks of that GGML type, for refusal tests).
    Kept when it exists already (its tokenizer, built from it, is cached by path and mtime)."""
    if out.is_file():
        return out
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    arch = _GGUF_ARCH[kind]
    cfg = AutoConfig.from_pretrained(str(hf_dir))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if getattr(cfg, "sliding_window", None) and arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    for key, value, vtype, sub in _tokenizer_fields():
        if key == "tokenizer.chat_template" and chat_template is not None:
            value = chat_template
        w.add_key_value(key, value, vtype, sub_type=sub)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = dict(_TENSOR_NAMES)
    for i in range(cfg.num_hidden_layers):
        for hf, ours in _LAYER.items():
            for suffix in ("weight", "bias"):
                names[f"model.layers.{i}.{hf}.{suffix}"] = f"blk.{i}.{ours}.{suffix}"
        post = "post_attention_norm" if arch == "gemma3" else "ffn_norm"
        names[f"model.layers.{i}.post_attention_layernorm.weight"] = f"blk.{i}.{post}.weight"
    if getattr(cfg, "num_experts_per_tok", None):  # experts stacked into one 3D tensor each, as llama.cpp does
        n_exp = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        w.add_expert_count(n_exp)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
        tensors = _stack_experts(tensors, n_exp, names)
    for name, t in tensors.items():
        a = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            a = _permute(a, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1.0
        if expert_type is not None and a.ndim == 3:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(expert_type)]
            raw = np.zeros((*a.shape[:-1], a.shape[-1] // block * size), dtype=np.uint8)
            w.add_tensor(names[name], raw, raw_dtype=gguf.GGMLQuantizationType(expert_type))
            continue
        w.add_tensor(names[name], np.ascontiguousarray(a))
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out
