"""The attention backend: reads and writes the paged KV cache.

A small, swappable piece. This one works on any device with torch SDPA: new keys and values are
written to their slots (`slot_mapping`), then each query group gathers its context from the block
pool. Sequences with one query token (decode, the common case) are batched into one SDPA call
over a padded context; multi-token chunks (prefill, chunked prefill after a prefix hit) run one
SDPA call each, with a causal mask offset by the tokens already computed.
The pool may store a narrower dtype than the model computes in (--kv-cache-dtype float16 with a
float32 model): K/V are rounded on write and widened back after each gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # first row of this sequence's tokens in the flattened batch
    num_tokens: int
    slots: torch.Tensor | None  # context slots [computed + num_tokens]; None when nothing was cached before
    mask: torch.Tensor | None  # [num_tokens, context] bool, None when plain causal from position 0


@dataclass
class DecodeGroup:
    """Single-token queries in rows [start, start + B), sorted by context length so padding to the
    group's longest context wastes little."""

    start: int
    slots: torch.Tensor  # [B, Lmax] context slots, padded
    mask: torch.Tensor  # [B, 1, 1, Lmax] bool


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


class KVCache:
    """One K and one V pool per layer, shaped [num_blocks * block_size, kv_heads, head_dim] so a
    token's slot index addresses it directly."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, zeroed: bool = True) -> None:
        """zeroed=False leaves the pool unwritten, so its pages become resident only as slots are
        used: for readers that never touch a slot before writing it (the native kernels). The SDPA
        path pads gathers with unwritten slots, and a NaN there would survive its mask."""
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        alloc = torch.zeros if zeroed else torch.empty
        self.k = [alloc(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [alloc(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D]."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for g in meta.decode_groups:
        b, ctx = g.slots.shape
        rows = slice(g.start, g.start + b)
        kd = _gather(k_cache, g.slots, q.dtype).view(b, ctx, *k_cache.shape[1:]).transpose(1, 2)  # [B, Hkv, L, D]
        vd = _gather(v_cache, g.slots, q.dtype).view(b, ctx, *v_cache.shape[1:]).transpose(1, 2)
        out[rows] = F.scaled_dot_product_attention(q[rows].unsqueeze(2), kd, vd, attn_mask=g.mask, scale=scale,
                                                   enable_gqa=gqa).squeeze(2)
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if p.slots is None:
            kp, vp = k[rows], v[rows]
        else:
            kp, vp = _gather(k_cache, p.slots, q.dtype), _gather(v_cache, p.slots, q.dtype)
        kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None,
                                           scale=scale, enable_gqa=gqa)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the pool at `slots`, as [len(slots), kv_heads, head_dim] in `dtype` (a no-op cast
    when the pool already stores it).

    `index_select` on a 2-D view is a plain row copy; advanced indexing (`cache[slots]`) took
    2-3x longer for the same gather on CPU.
    """
    flat = cache.view(cache.shape[0], -1).index_select(0, slots.reshape(-1))
    return flat.view(-1, *cache.shape[1:]).to(dtype)
