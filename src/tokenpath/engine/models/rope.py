"""Rotary position embeddings: plain, and the scaled variants of long-context checkpoints.

The inverse frequencies follow transformers' `modeling_rope_utils` formula for formula (llama3,
linear, yarn), so a checkpoint computes here what it computes there; a GGUF's `rope_freqs`
(llama.cpp's form of llama3 scaling) divides the plain frequencies instead. cos/sin tables are
built once for every position up to the engine's max length, per distinct rope (Gemma 3's
windowed and global layers each have their own base).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenpath.engine.model_config import ModelConfig, RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], factor on cos/sin)."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return base, 1.0
    if scaling.freq_factors is not None:
        base = base / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / factor, 1.0
    orig = scaling.original_max_position_embeddings
    if orig is None:  # (both loaders set it for llama3 and yarn, to the trained context by default)
        raise ValueError(f"rope type {kind!r} needs original_max_position_embeddings")
    if kind == "llama3":
        low_wl, high_wl = orig / scaling.low_freq_factor, orig / scaling.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wl, base / factor, base)
        smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        attn = scaling.attention_factor
        if attn is None:
            attn = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

        def corr(rot: float) -> float:
            return (head_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low = max(math.floor(corr(scaling.beta_fast)), 0)
        high: float = min(math.ceil(corr(scaling.beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extra = 1 - ramp
        return (base / factor) * (1 - extra) + base * extra, float(attn)
    raise ValueError(f"rope type {kind!r}")  # the loaders refuse these before a model is built


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
        keys: list[tuple[float, bool]] = []
        self.layer_rope: list[int] = []
        for i in range(cfg.num_layers):
            local = cfg.rope_local_theta is not None and cfg.window(i) is not None
            key = (cfg.rope_base(i), not local)
            if key not in keys:
                keys.append(key)
            self.layer_rope.append(keys.index(key))
        self.ropes = nn.ModuleList(Rope(cfg.head_dim, base, max_pos, cfg.rope_scaling if scaled else None)
                                   for base, scaled in keys)

    def tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [r.tables(positions) for r in self.ropes]
