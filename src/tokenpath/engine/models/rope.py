"""Rotary position embeddings on torch: cos/sin tables built once for every position up to the
engine's max length, per distinct rope (Gemma 3's windowed and global layers each have their own
base). The frequencies (plain and scaled: llama3, linear, yarn, GGUF rope_freqs) and which rope
each layer uses come from engine/rope_tables.py, which the native kernels share.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenpath.engine.model_config import ModelConfig, RopeScaling
from tokenpath.engine.rope_tables import inv_freq as _inv_freq
from tokenpath.engine.rope_tables import rope_keys


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], factor on cos/sin): rope_tables.inv_freq as a tensor."""
    freq, mscale = _inv_freq(head_dim, theta, scaling)
    return torch.from_numpy(freq), mscale


class Rope(nn.Module):
    """cos/sin tables for one rope: `tables` looks a step's positions up once for every layer."""

    def __init__(self, head_dim: int, theta: float, max_pos: int, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        freq, mscale = inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * mscale, persistent=False)
        self.register_buffer("sin", emb.sin() * mscale, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D]

    @staticmethod
    def apply(cos: torch.Tensor, sin: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for x in xs:
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
            out.append((x.float() * cos + rotated.float() * sin).to(x.dtype))
        return out


class LayerRopes(nn.Module):
    """One Rope per distinct (base, scaling) among the layers, and which one each layer uses.

    Gemma 3: the windowed layers' local base, plain; the global layers' base, with the
    checkpoint's scaling. Every other family: one rope for all layers."""

    def __init__(self, cfg: ModelConfig, max_pos: int) -> None:
        super().__init__()
        keys, self.layer_rope = rope_keys(cfg)
        self.ropes = nn.ModuleList(Rope(cfg.head_dim, base, max_pos, cfg.rope_scaling if scaled else None)
                                   for base, scaled in keys)

    def tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [r.tables(positions) for r in self.ropes]
