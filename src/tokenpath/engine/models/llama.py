"""The decoder every supported family shares: RMSNorm, RoPE, grouped-query attention, a gated MLP.

Llama, SmolLM2, Mistral, Qwen2, Qwen3 and Gemma 3 differ only in switches the ModelConfig carries:
QK-norm (Qwen3, Gemma 3), sandwich norms around attention and MLP outputs, GeGLU instead of SwiGLU,
embedding scale, attention scale, per-layer sliding windows and rope bases (Gemma 3), Gemma's
(1 + w) norms. Qwen3-MoE, Mixtral, OLMoE and Granite MoE are the same decoder with a mixture-of-experts
MLP (`models/moe.py`) in their sparse layers (OLMoE's q/k norms span the whole projection; Granite
scales each sublayer's output and the logits: engine/moe_families.py); gpt-oss adds attention sinks, an o_proj bias and its
clamped SwiGLU (engine/gpt_oss.py). One module with those switches, rather than a copy per family, keeps the paged
attention and fused projections in one place.

Input is a flat batch of tokens from many sequences (prefill chunks and decode steps mixed); the
paged attention backend knows which rows belong to which sequence. Q/K/V and gate/up projections
are fused into one matmul each: fewer kernel launches per layer, which is what bounds a small
model's decode step on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenpath.engine.attention import AttentionMetadata, KVCache, paged_attention
from tokenpath.engine.lora_batch import TorchLoraBatch
from tokenpath.engine.model_config import ModelConfig
from tokenpath.engine.models.moe import MoEBlock, clamped_swiglu
from tokenpath.engine.models.rope import LayerRopes, Rope

__all__ = ["DecoderLayer", "LlamaModel", "Rope"]


def _norm_param(n: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.ones(n, dtype=dtype))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None, layer: int = 0) -> None:
        """`layer`: this layer's index, which decides a dense or mixture-of-experts MLP."""
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = _norm_param(h, dtype)
        self.post_norm = _norm_param(h, dtype)  # before the MLP
        qn, kn = (self.q_size, self.kv_size) if cfg.qk_norm_full else (d, d)  # OLMoE: over the projection
        self.q_norm = _norm_param(qn, dtype) if cfg.qk_norm else None
        self.k_norm = _norm_param(kn, dtype) if cfg.qk_norm else None
        self.attn_out_norm = _norm_param(h, dtype) if cfg.sandwich_norms else None
        self.ffn_out_norm = _norm_param(h, dtype) if cfg.sandwich_norms else None
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.attn_output_bias, dtype=dtype)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads, dtype=dtype)) if cfg.attn_sinks else None
        self.moe = MoEBlock(cfg, dtype) if cfg.is_moe_layer(layer) else None
        dense = self.moe is None
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False, dtype=dtype) if dense else None
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False, dtype=dtype) if dense else None
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else d**-0.5

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) if self.cfg.hidden_act == "silu" else F.gelu(gate, approximate="tanh")

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation: act(gate) * up, or gpt-oss' clamped SwiGLU."""
        if self.cfg.swiglu_limit is not None:
            return clamped_swiglu(gate, up, self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
        return self._act(gate) * up

    def forward(self, idx: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                meta: AttentionMetadata, lora: TorchLoraBatch | None = None) -> torch.Tensor:
        """`lora`: the step's adapters, whose deltas are added to their own rows' projections."""
        cfg = self.cfg
        t = x.shape[0]
        h = self._rms(x, self.input_norm)
        qkv = self.qkv(h)
        if lora is not None:
            lora.add(idx, "qkv", h, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and cfg.qk_norm_full:
            q, k = self._rms(q, self.q_norm), self._rms(k, cast(torch.Tensor, self.k_norm))
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and not cfg.qk_norm_full:
            q, k = self._rms(q, self.q_norm), self._rms(k, self.k_norm)
        q, k = Rope.apply(*rope, q, k)
        attn = paged_attention(idx, q, k, v, cache, meta, self.scale, cfg.window(idx), self.sinks).reshape(t, self.q_size)
        a = self.o_proj(attn)
        if lora is not None:
            lora.add(idx, "o", attn, a)
        if cfg.residual_scale != 1.0:  # Granite MoE: each sublayer's output scaled (a Python float, as transformers)
            a = a * cfg.residual_scale
        x = x + (a if self.attn_out_norm is None else self._rms(a, self.attn_out_norm))
        h = self._rms(x, self.post_norm)
        if self.moe is not None:  # LoRA never reaches here: adapters are refused on MoE models
            m = self.moe(h, self._glu)
            if cfg.residual_scale != 1.0:
                m = m * cfg.residual_scale
            return x + (m if self.ffn_out_norm is None else self._rms(m, self.ffn_out_norm))
        gate_up, down = cast(nn.Linear, self.gate_up), cast(nn.Linear, self.down)  # a dense layer: both set
        gu = gate_up(h)
        if lora is not None:
            lora.add(idx, "gate_up", h, gu)
        gate, up = gu.chunk(2, dim=-1)
        act = self._glu(gate, up)
        m = down(act)
        if lora is not None:
            lora.add(idx, "down", act, m)
        return x + (m if self.ffn_out_norm is None else self._rms(m, self.ffn_out_norm))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype | None = None) -> None:
        """`dtype` builds the parameters in the compute dtype directly: a bf16 model never has a
        float32 copy of itself (load_weights casts each checkpoint tensor as it copies it)."""
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = _norm_param(cfg.hidden_size, dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype))
        self.rope = LayerRopes(cfg, max_positions)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, logit_rows: torch.Tensor,
                lora: TorchLoraBatch | None = None) -> torch.Tensor:
        """Returns float32 logits for the rows in `logit_rows` only: the other rows are prefill
        tokens whose next-token distribution nobody needs."""
        x = self.embed(input_ids)
        if self.cfg.embed_scale != 1.0:  # Gemma: as transformers does, the scale in the model's dtype
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        tables = self.rope.tables(positions)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, tables[self.rope.layer_rope[i]], cache, meta, lora)
        x = F.rms_norm(x[logit_rows], (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, head)
        if self.cfg.logits_scaling != 1.0:  # Granite MoE: divided in the model's dtype, as transformers
            logits = logits / self.cfg.logits_scaling
        return logits.float()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Our checkpoint names -> fused parameters, cast to the parameters' dtype one by one.
        Norm weights get the config's offset (Gemma's 1 + w), added in float32."""
        off = self.cfg.norm_offset

        def norm(p: nn.Parameter, w: torch.Tensor) -> None:
            p.copy_(w.float() + off if off else w)

        with torch.no_grad():
            self.embed.weight.copy_(weights["embed.weight"])
            norm(self.norm, weights["norm.weight"])
            if self.lm_head is not None:
                self.lm_head.weight.copy_(weights["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                def w(name: str, i: int = i) -> torch.Tensor:
                    return weights[f"layers.{i}.{name}"]

                for pname in ("input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "ffn_out_norm"):
                    p = getattr(layer, pname)
                    if p is not None:
                        norm(p, w(f"{pname}.weight"))
                layer.qkv.weight.copy_(torch.cat([w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")]))
                if layer.qkv.bias is not None:
                    layer.qkv.bias.copy_(torch.cat([w("q_proj.bias"), w("k_proj.bias"), w("v_proj.bias")]))
                layer.o_proj.weight.copy_(w("o_proj.weight"))
                if layer.o_proj.bias is not None:
                    layer.o_proj.bias.copy_(w("o_proj.bias"))
                if layer.sinks is not None:
                    layer.sinks.copy_(w("sinks"))
                if layer.moe is not None and layer.moe.router_bias is not None:  # gpt-oss: fused, with biases
                    layer.moe.load_fused(w)
                    continue
                if layer.moe is not None:
                    stacked = f"layers.{i}.experts.gate_proj.weight" in weights  # GGUF's ffn_*_exps
                    fused = f"layers.{i}.experts.gate_up.weight" in weights  # Granite MoE's input_linear
                    layer.moe.load(w, stacked=stacked, fused_gate_up=fused)
                    continue
                cast(nn.Linear, layer.gate_up).weight.copy_(torch.cat([w("gate_proj.weight"), w("up_proj.weight")]))
                cast(nn.Linear, layer.down).weight.copy_(w("down_proj.weight"))
