"""Hyperparameters of a decoder, read from GGUF metadata or a HF config.json.

One typed record for every decoder family the engine runs (Llama, Mistral, Qwen2, Qwen3, Gemma 3):
Qwen3-MoE, Mixtral, OLMoE, Granite MoE and gpt-oss add mixture-of-experts MLPs (`num_experts` > 0);
dense models keep 0. The
torch path (`engine/models/`), the native kernels (`engine/kernels/model.py`) and the KV cache
manager all read the same fields, so a feature a path lacks is refused where that path is chosen
(`unsupported_by`), never silently ignored. Defaults are the Llama ones: a config that names none
of the newer fields computes exactly what it did before they existed.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3moe", "mixtral", "olmoe", "granitemoe",
                 "gpt_oss")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling` (or GGUF `rope.scaling.*` / `rope_freqs`), normalized.

    `rope_type` is one of ROPE_TYPES. `factor` is the context extension; the llama3 and yarn fields
    are those of transformers' `modeling_rope_utils` under the same names. `freq_factors`, when set,
    are per-frequency divisors read from a GGUF's `rope_freqs.weight` (llama.cpp's form of llama3
    scaling): inv_freq[i] / freq_factors[i].
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn (mscale); None = transformers' default
    truncate: bool = True  # yarn: the correction range rounded to whole dims (gpt-oss: False)
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # not always hidden / heads (Qwen3, Gemma 3: GGUF attention.key_length)
    rms_norm_eps: float
    rope_theta: float  # the rope base of global (full-attention) layers
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v bias
    rope_scaling: RopeScaling | None = None  # None = plain rope
    # Sliding windows: per layer, the number of most recent positions a query attends to (itself
    # included), or None for full attention. Empty = every layer full. Mistral: every layer the
    # same window; Gemma 3: 5 windowed layers to each global one.
    layer_windows: tuple[int | None, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the rope base of windowed layers
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k before rope
    # OLMoE: with qk_norm, one RMSNorm over the whole q (and k) projection, before it is split into
    # heads (weights of num_heads * head_dim and num_kv_heads * head_dim), not one per head.
    qk_norm_full: bool = False
    sandwich_norms: bool = False  # Gemma 3: post-attention and post-feedforward norms too
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    # The attention score scale, when not head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5).
    attn_scale: float | None = None
    # Norm weights are stored as HF keeps them; Gemma's RMSNorm multiplies by (1 + w). Loaders
    # hand weights over in this form (GGUF's gemma3 norms already hold 1 + w: the loader subtracts).
    norm_offset: float = 0.0
    add_bos_token: bool = True
    # Granite MoE (transformers' modeling_granitemoe.py): each sublayer's output times
    # `residual_scale` before it joins the residual stream, and the logits divided by
    # `logits_scaling` (its embedding and attention multipliers are embed_scale and attn_scale).
    residual_scale: float = 1.0
    logits_scaling: float = 1.0
    # Mixture of experts (Qwen3-MoE, Mixtral). 0 experts = every MLP dense. A sparse layer routes
    # each token to `num_experts_per_tok` of `num_experts` gated MLPs of `moe_intermediate_size`,
    # weighted by the softmax over all router logits, renormalized over the chosen ones when
    # `norm_topk_prob` (Mixtral always: its softmax over the top-k logits is the same numbers).
    # `moe_layers` lists the sparse layers (Qwen3-MoE's decoder_sparse_step / mlp_only_layers
    # leave some dense, with `intermediate_size`); Mixtral: all of them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # gpt-oss (transformers' modeling_gpt_oss.py). `attn_sinks`: a learned logit per head joins
    # each query's softmax denominator (and takes no value). `attn_output_bias`: o_proj has a bias
    # too (Qwen2's q/k/v bias does not). `moe_topk_softmax`: the softmax runs over the top-k router
    # logits only (the same numbers as Mixtral's renormalized softmax, but in another order, and
    # gpt-oss' router has a bias). `moe_bias`: the router and every expert matrix have biases.
    # `swiglu_limit`: the clamped SwiGLU, gate clamped to <= limit, up to [-limit, limit], and
    # (up + 1) * gate * sigmoid(alpha * gate); None = plain act(gate) * up.
    attn_sinks: bool = False
    attn_output_bias: bool = False
    moe_topk_softmax: bool = False
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def window(self, layer: int) -> int | None:
        """The sliding window of one layer, or None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    def rope_base(self, layer: int) -> float:
        """The rope base of one layer (Gemma 3's windowed layers use their own)."""
        if self.rope_local_theta is not None and self.window(layer) is not None:
            return self.rope_local_theta
        return self.rope_theta

    def is_moe_layer(self, layer: int) -> bool:
        """Whether this layer's MLP is a mixture of experts (else the dense gated MLP)."""
        return self.num_experts > 0 and layer in self.moe_layers

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.layer_windows)
