"""A llama-family decoder (Llama, SmolLM2, Qwen2): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Input is a flat batch of tokens from many sequences (prefill chunks and decode steps mixed); the
paged attention backend knows which rows belong to which sequence. Q/K/V and gate/up projections
are fused into one matmul each: fewer kernel launches per layer, which is what bounds a small
model's decode step on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenpath.engine.attention import AttentionMetadata, KVCache, paged_attention
from tokenpath.engine.model_config import ModelConfig


class Rope(nn.Module):
    def __init__(self, head_dim: int, theta: float, max_pos: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions: looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D]

    @staticmethod
    def apply(cos: torch.Tensor, sin: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for x in xs:
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
            out.append((x.float() * cos + rotated.float() * sin).to(x.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, idx: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        h = F.rms_norm(x, (cfg.hidden_size,), self.input_norm, cfg.rms_norm_eps)
        q, k, v = self.qkv(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = Rope.apply(*rope, q, k)
        a = paged_attention(idx, q, k, v, cache, meta, cfg.head_dim**-0.5)
        x = x + self.o_proj(a.reshape(t, self.q_size))
        h = F.rms_norm(x, (cfg.hidden_size,), self.post_norm, cfg.rms_norm_eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, max_positions)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, logit_rows: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits for the rows in `logit_rows` only: the other rows are prefill
        tokens whose next-token distribution nobody needs."""
        x = self.embed(input_ids)
        rope = self.rope.tables(positions)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, rope, cache, meta)
        x = F.rms_norm(x[logit_rows], (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Our checkpoint names -> fused parameters."""
        with torch.no_grad():
            self.embed.weight.copy_(weights["embed.weight"])
            self.norm.copy_(weights["norm.weight"])
            if self.lm_head is not None:
                self.lm_head.weight.copy_(weights["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                def w(name: str, i: int = i) -> torch.Tensor:
                    return weights[f"layers.{i}.{name}"]

                layer.input_norm.copy_(w("input_norm.weight"))
                layer.post_norm.copy_(w("post_norm.weight"))
                layer.qkv.weight.copy_(torch.cat([w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")]))
                if layer.qkv.bias is not None:
                    layer.qkv.bias.copy_(torch.cat([w("q_proj.bias"), w("k_proj.bias"), w("v_proj.bias")]))
                layer.o_proj.weight.copy_(w("o_proj.weight"))
                layer.gate_up.weight.copy_(torch.cat([w("gate_proj.weight"), w("up_proj.weight")]))
                layer.down.weight.copy_(w("down_proj.weight"))
