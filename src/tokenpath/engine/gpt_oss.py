"""gpt-oss (OpenAI's open-weight MoE, transformers' `GptOssForCausalLM`) in its float form: what
its config and safetensors hold, read into the shared decoder's fields and checked at load.

What differs from the other decoders, each exactly as transformers' modeling_gpt_oss.py computes
it (ModelConfig says where each switch acts): a learned sink logit per head in the attention
softmax, sliding-window (`layer_types`) and full layers alternating, biases on q/k/v/o, on the
router and on the experts, top-k of the router logits then a softmax over those k, the clamped
SwiGLU `(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`, gate and up
interleaved in one fused [E, hidden, 2 * intermediate] matrix per layer, YaRN without truncation.

The torch path runs it; the native kernels refuse it (kernels/model.py `native_unsupported`), so
it falls back to torch. The released checkpoints store the experts as MXFP4 blocks and scales
(`quantization_config` mxfp4): no path reads those yet, so such a checkpoint is refused at load,
naming the type, rather than read as something else (loader_hf.read_hf_config).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenpath.engine.model_config import ModelConfig
from tokenpath.errors import ModelLoadError


def gpt_oss_fields(cfg: dict, n_experts: int, top_k: int, n_layers: int) -> dict:
    """The ModelConfig fields of a gpt-oss config.json beyond the common decoder ones: every layer
    sparse, with `intermediate_size` experts."""
    return dict(num_experts=n_experts, num_experts_per_tok=top_k, moe_intermediate_size=cfg["intermediate_size"],
                norm_topk_prob=True, moe_layers=tuple(range(n_layers)), attn_sinks=True,
                attn_output_bias=bool(cfg.get("attention_bias", True)), moe_topk_softmax=True, moe_bias=True,
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))


def gpt_oss_windows(cfg: dict, n_layers: int, cfg_file: Path) -> tuple[int | None, ...]:
    """Per layer: `sliding_window` for a "sliding_attention" layer, None for "full_attention"
    (transformers' default pattern when `layer_types` is absent: even layers sliding)."""
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    odd = next((t for t in types if t not in ("sliding_attention", "full_attention")), None)
    if len(types) != n_layers or odd is not None:
        raise ModelLoadError(f"{cfg_file}: layer_types {types!r}: expected {n_layers} entries of "
                             "sliding_attention / full_attention")
    window = cfg.get("sliding_window")
    if "sliding_attention" not in types:
        return (None,) * n_layers
    if not (isinstance(window, int) and window > 0):
        raise ModelLoadError(f"{cfg_file}: sliding_window {window!r}: expected a positive integer")
    return tuple(window if t == "sliding_attention" else None for t in types)


def gpt_oss_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """One layer's tensors (our names) -> shape: attention with biases and sinks, router, fused experts."""
    h, d, e, i = config.hidden_size, config.head_dim, config.num_experts, config.moe_intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "sinks": (config.num_heads,),
        "input_norm.weight": (h,), "post_norm.weight": (h,), "router.weight": (e, h), "router.bias": (e,),
        "experts.gate_up_proj": (e, h, 2 * i), "experts.gate_up_proj_bias": (e, 2 * i),
        "experts.down_proj": (e, i, h), "experts.down_proj_bias": (e, h)}
    if config.attn_output_bias:
        shapes["o_proj.bias"] = (h,)
    return {f"layers.{layer}.{n}": s for n, s in shapes.items()}


def check_gpt_oss_weights(config: ModelConfig, weights: Mapping[str, Any], path: Path) -> None:
    """Every tensor the model reads is there with the config's shape; the first that is not is
    named (a missing one, or one whose shape disagrees with config.json's counts)."""
    shapes = getattr(weights, "shapes", {})
    source = getattr(weights, "source", lambda n: n)
    v, h = config.vocab_size, config.hidden_size
    need: dict[str, tuple[int, ...]] = {"embed.weight": (v, h), "norm.weight": (h,)}
    if not config.tie_word_embeddings:
        need["lm_head.weight"] = (v, h)
    for layer in range(config.num_layers):
        need |= gpt_oss_shapes(config, layer)
    missing = [n for n in need if n not in weights]
    if missing:
        raise ModelLoadError(f"{path}: weights missing from the safetensors files: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
    for name, want in need.items():
        got = tuple(shapes[name]) if name in shapes else tuple(weights[name].shape)
        if got != want:
            raise ModelLoadError(f"{path}: tensor {source(name)} has shape {list(got)}, expected {list(want)} "
                                 f"({config.num_experts} experts, hidden {h}, intermediate "
                                 f"{config.moe_intermediate_size}, {config.num_heads} heads in config.json)")
