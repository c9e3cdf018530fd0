"""Rotary position embeddings' frequencies and tables, on numpy: plain, and the scaled variants of
long-context checkpoints.

The inverse frequencies follow transformers' `modeling_rope_utils` formula for formula (llama3,
linear, yarn), in float32 as there, so a checkpoint computes here what it computes there; a GGUF's
`rope_freqs` (llama.cpp's form of llama3 scaling) divides the plain frequencies instead. Both
paths take them from here: the torch path's `Rope` (models/rope.py) builds its tensors from them,
and the native kernels read `rope_tables`' cos/sin arrays, without importing torch (issue 42).
"""

from __future__ import annotations

import math
import mmap

import numpy as np

from tokenpath.engine.model_config import ModelConfig, RopeScaling

ROPE_FIRST_ROWS = 256  # positions RopeTables computes at load (1 MiB for Gemma 3's two ropes)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim / 2], float32; factor on cos/sin)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    base = np.float32(1.0) / (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)
    if scaling is None:
        return base, 1.0
    if scaling.freq_factors is not None:
        base = base / np.asarray(scaling.freq_factors, dtype=np.float32)
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return (base / np.float32(factor)).astype(np.float32), 1.0
    orig = scaling.original_max_position_embeddings
    if orig is None:  # (both loaders set it for llama3 and yarn, to the trained context by default)
        raise ValueError(f"rope type {kind!r} needs original_max_position_embeddings")
    if kind == "llama3":
        low_wl, high_wl = orig / scaling.low_freq_factor, orig / scaling.high_freq_factor
        wavelen = np.float32(2 * math.pi) / base
        scaled = np.where(wavelen > low_wl, base / np.float32(factor), base).astype(np.float32)
        smooth = (np.float32(orig) / wavelen - np.float32(scaling.low_freq_factor)) / np.float32(
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if kind == "yarn":
        attn = scaling.attention_factor
        if attn is None:
            attn = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

        def corr(rot: float) -> float:
            return (head_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low: float = corr(scaling.beta_fast)
        high: float = corr(scaling.beta_slow)
        if scaling.truncate:  # (transformers' default; gpt-oss keeps the fractional range)
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extra = (1 - ramp).astype(np.float32)
        return ((base / np.float32(factor)) * (1 - extra) + base * extra).astype(np.float32), float(attn)
    raise ValueError(f"rope type {kind!r}")  # the loaders refuse these before a model is built


def rope_keys(cfg: ModelConfig) -> tuple[list[tuple[float, bool]], list[int]]:
    """The distinct ropes among the layers, (base, scaled), and which one each layer uses.

    Gemma 3: the windowed layers' local base, plain; the global layers' base, with the
    checkpoint's scaling. Every other family: one rope for all layers."""
    keys: list[tuple[float, bool]] = []
    layer_rope: list[int] = []
    for i in range(cfg.num_layers):
        local = cfg.rope_local_theta is not None and cfg.window(i) is not None
        key = (cfg.rope_base(i), not local)
        if key not in keys:
            keys.append(key)
        layer_rope.append(keys.index(key))
    return keys, layer_rope


def rope_tables(head_dim: int, theta: float, max_pos: int, scaling: RopeScaling | None = None,
                start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin, [max_pos - start, head_dim], of positions start..max_pos-1 (each
    frequency twice: the halves rotate together). Each position's row is computed on its own, so a
    range is the same rows as the whole table's (RopeTables fills its tables by ranges).

    The angles are float32 products, as on the torch path; their cos and sin are computed in
    float64 and rounded once, so each entry is the float32 nearest the exact value, the same on
    every CPU. (torch's and numpy's float32 cos are SIMD approximations within an ulp whose last
    bit depends on the library and the CPU's vector width; the native kernels' int8 activations
    turn such an ulp into logprob differences near 1e-3, so tables that never vary are worth it.)"""
    freq, mscale = inv_freq(head_dim, theta, scaling)
    freqs: np.ndarray = np.outer(np.arange(start, max_pos, dtype=np.float32), freq).astype(np.float64)
    emb = np.concatenate((freqs, freqs), axis=-1)
    scale = np.float32(mscale)
    return np.cos(emb).astype(np.float32) * scale, np.sin(emb).astype(np.float32) * scale


class RopeTables:
    """One rope's cos and sin tables for the native kernels, [max_pos, head_dim] float32 at
    addresses that never move (the kernels keep the pointers), filled only up to the highest
    position a step has reached (`ensure`, doubling). The tables live in anonymous mappings, whose
    pages become resident only when written: computed whole, Gemma 3's two ropes (head_dim 256) at
    8192 positions were 32 MiB resident from the load on, however short the requests (issue 42's
    peak RSS); llama.cpp computes rope on the fly and holds none."""

    def __init__(self, head_dim: int, theta: float, max_pos: int, scaling: RopeScaling | None = None) -> None:
        self.head_dim, self.theta, self.max_pos, self.scaling = head_dim, theta, max_pos, scaling
        count = max_pos * head_dim
        # (an explicit mapping: numpy's large arrays come from malloc, which may hand back heap pages
        # that are resident already, or keep them after a free)
        self._maps = [mmap.mmap(-1, max(count * 4, 1)) for _ in range(2)]
        self.cos, self.sin = (np.frombuffer(m, dtype=np.float32, count=count).reshape(max_pos, head_dim)
                              for m in self._maps)
        self.filled = 0
        self.ensure(ROPE_FIRST_ROWS)

    def ensure(self, n: int) -> None:
        """Rows 0..n-1 are computed (n is clipped to max_pos: the kernels refuse a position past it)."""
        if n <= self.filled or self.filled >= self.max_pos:
            return
        end = min(self.max_pos, max(n, 2 * self.filled, ROPE_FIRST_ROWS))
        self.cos[self.filled:end], self.sin[self.filled:end] = rope_tables(
            self.head_dim, self.theta, end, self.scaling, start=self.filled)
        self.filled = end
