"""OLMoE and Granite MoE: the two mixtures of experts that are Qwen3-MoE's decoder with a switch or
two, read from their config.json into the shared decoder's fields.

Each as transformers computes it (modeling_olmoe.py, modeling_granitemoe.py):
- OLMoE (`OlmoeForCausalLM`): every layer sparse, experts of `intermediate_size`, softmax over all
  router logits then top-k, renormalized only when `norm_topk_prob` (false in the released
  models); the q and k norms run over the whole projection before it is split into heads
  (ModelConfig.qk_norm_full). Its tensors have Qwen3-MoE's names (mlp.gate, mlp.experts.N.*).
  `clip_qkv` (a clamp of q, k and v) is refused: no released OLMoE sets it.
- Granite MoE (`GraniteMoeForCausalLM`): every layer sparse, top-k of the router logits then a
  softmax over those k (gpt-oss' order, without its biases), embeddings times
  `embedding_multiplier`, attention scores times `attention_multiplier` (not head_dim ** -0.5),
  each sublayer's output times `residual_multiplier`, logits over `logits_scaling`. Its experts
  are stacked per layer: `input_linear` [E, 2I, H] (gate rows then up rows, this engine's own
  gate_up layout) and `output_linear` [E, H, I]; the router is `router.layer`. The shared-expert
  variant (GraniteMoeSharedForCausalLM) is another architecture, refused as unknown.

Both run on the torch path; the native kernels decline the switches they lack (whole-projection
q/k norms, residual and logit multipliers, the top-k softmax: kernels/model.py
`native_unsupported`), so `--quantization auto` falls back to torch rather than compute another
model. Neither has a GGUF reader yet (GGUF `olmoe` / `granitemoe` are refused as unknown
architectures by loader_gguf).
"""

from __future__ import annotations

from pathlib import Path

from tokenpath.engine.model_config import ModelConfig
from tokenpath.errors import ModelLoadError


def olmoe_fields(cfg: dict, n_experts: int, top_k: int, n_layers: int, cfg_file: Path) -> dict:
    """The ModelConfig fields of an OLMoE config.json beyond the common decoder ones."""
    if cfg.get("clip_qkv") is not None:
        raise ModelLoadError(f"{cfg_file}: 'clip_qkv' = {cfg['clip_qkv']!r} is not supported")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    if cfg.get("head_dim") not in (None, hidden // heads):  # its q norm has hidden_size weights
        raise ModelLoadError(f"{cfg_file}: head_dim {cfg['head_dim']!r}: OLMoE's q/k norms need "
                             f"hidden_size / num_attention_heads = {hidden // heads}")
    return dict(num_experts=n_experts, num_experts_per_tok=top_k, moe_intermediate_size=cfg["intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=tuple(range(n_layers)),
                qk_norm=True, qk_norm_full=True)


def granitemoe_fields(cfg: dict, n_experts: int, top_k: int, n_layers: int) -> dict:
    """The ModelConfig fields of a Granite MoE config.json beyond the common decoder ones."""
    return dict(num_experts=n_experts, num_experts_per_tok=top_k, moe_intermediate_size=cfg["intermediate_size"],
                norm_topk_prob=True, moe_layers=tuple(range(n_layers)), moe_topk_softmax=True,
                embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                attn_scale=float(cfg.get("attention_multiplier", 1.0)),
                residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)))


# Granite MoE's module names -> ours (after block_sparse_moe. is dropped): the stacked experts
# keep one tensor per layer, as a GGUF's ffn_*_exps do.
GRANITE_RENAMES = [("router.layer.", "router."), ("input_linear.", "experts.gate_up."),
                   ("output_linear.", "experts.down.")]


def stacked_expert_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One Granite MoE layer's router and stacked experts (our names, relative to the layer) -> shape."""
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    return {"router.weight": (e, h), "experts.gate_up.weight": (e, 2 * i, h), "experts.down.weight": (e, h, i)}
