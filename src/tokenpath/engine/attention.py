"""The attention backend: reads and writes the paged KV cache.

A small, swappable piece. This one works on any device with torch SDPA: new keys and values are
written to their slots (`slot_mapping`), then each query group gathers its context from the block
pool. Sequences with one query token (decode, the common case) are batched into one SDPA call
over a padded context; multi-token chunks (prefill, chunked prefill after a prefix hit) run one
SDPA call each, with a causal mask offset by the tokens already computed.
A layer with a sliding window (Mistral, Gemma 3's local layers) masks every key more than
`window - 1` positions behind its query, in prefill chunks and decode alike; the masks are built
once per step and window, and shared by every layer with that window.
With KV-cache groups (`kv_groups.py`: Gemma 3's window layers keep only their window's blocks)
each group has its own block table, so every slot tensor below may carry a leading group axis
([G, ...]); a layer reads the row of its own group. Without it, one table serves every layer.
The pool may store a narrower dtype than the model computes in (--kv-cache-dtype float16 with a
float32 model): K/V are rounded on write and widened back after each gather.
Attention sinks (gpt-oss: a learned logit per head in each query's softmax denominator, with no
value) ride on SDPA as one more key: a zero key (score 0) and zero value whose additive mask entry
is the head's sink, so the softmax is exactly that over [scores, sink] and the sink adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenpath.engine.kv_cache import KVCache


@dataclass
class PrefillChunk:
    start: int  # first row of this sequence's tokens in the flattened batch
    num_tokens: int
    # context slots [computed + num_tokens] (or [G, ...] per group); None when nothing was cached before
    slots: torch.Tensor | None
    mask: torch.Tensor | None  # [num_tokens, context] bool, None when plain causal from position 0
    computed: int = 0  # tokens of this sequence already in the cache: the first query's position


@dataclass
class DecodeGroup:
    """Single-token queries in rows [start, start + B), sorted by context length so padding to the
    group's longest context wastes little."""

    start: int
    slots: torch.Tensor  # [B, Lmax] context slots, padded (or [G, B, Lmax] per group)
    mask: torch.Tensor  # [B, 1, 1, Lmax] bool
    ctx: torch.Tensor  # [B] context lengths (each query's position + 1): the sliding windows' masks


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written (or [G, T] per group)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # (window, "d"/"p", index) -> windowed mask, filled by the first layer with that window.
    window_masks: dict[tuple[int, str, int], torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, i: int, window: int | None) -> torch.Tensor:
        g = self.decode_groups[i]
        if window is None:
            return g.mask
        key = (window, "d", i)
        if key not in self.window_masks:
            k = torch.arange(g.mask.shape[-1], device=g.mask.device)  # (masks: one per window, any group)
            recent = k[None, :] >= (g.ctx[:, None] - window)
            self.window_masks[key] = g.mask & recent[:, None, None, :]
        return self.window_masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        p = self.prefills[i]
        if window is None or p.computed + p.num_tokens <= window:  # nothing falls out of the window
            return p.mask
        key = (window, "p", i)
        if key not in self.window_masks:
            dev = p.mask.device if p.mask is not None else self.slot_mapping.device
            q = torch.arange(p.computed, p.computed + p.num_tokens, device=dev)[:, None]
            k = torch.arange(p.computed + p.num_tokens, device=dev)[None, :]  # slots None: computed is 0
            self.window_masks[key] = (k <= q) & (k > q - window)
        return self.window_masks[key]


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D]. `window`: this
    layer attends only to the last `window` positions (its own included). `sinks`: [Hq] logits
    that join each head's softmax denominator."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    group = cache.layer_group[layer]
    slot_mapping = _of_group(meta.slot_mapping, group, 1)
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for gi, g in enumerate(meta.decode_groups):
        slots = _of_group(g.slots, group, 2)
        b, ctx = slots.shape
        rows = slice(g.start, g.start + b)
        kd = _gather(k_cache, slots, q.dtype).view(b, ctx, *k_cache.shape[1:]).transpose(1, 2)  # [B, Hkv, L, D]
        vd = _gather(v_cache, slots, q.dtype).view(b, ctx, *v_cache.shape[1:]).transpose(1, 2)
        mask: torch.Tensor | None = meta.decode_mask(gi, window)
        if sinks is not None:
            kd, vd, mask = _with_sinks(kd, vd, mask, sinks, 1, q.dtype)
        out[rows] = F.scaled_dot_product_attention(q[rows].unsqueeze(2), kd, vd, attn_mask=mask, scale=scale,
                                                   enable_gqa=gqa).squeeze(2)
    for pi, p in enumerate(meta.prefills):
        mask = meta.prefill_mask(pi, window)
        rows = slice(p.start, p.start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if p.slots is None:
            kp, vp = k[rows], v[rows]
        else:
            slots = _of_group(p.slots, group, 1)
            kp, vp = _gather(k_cache, slots, q.dtype), _gather(v_cache, slots, q.dtype)
        kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
        if sinks is not None:
            if mask is None:  # plain causal from position 0, spelled out: the sink column joins it
                mask = torch.ones(p.num_tokens, p.num_tokens, dtype=torch.bool, device=q.device).tril()
            kp, vp, mask = _with_sinks(kp, vp, mask, sinks, p.num_tokens, q.dtype)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=gqa)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out


def _with_sinks(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor, n: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V [B, Hkv, L, D] with a zero key and value appended, and the boolean mask [.., n, L] as an
    additive float one [B, Hq, n, L + 1] whose last column is each head's sink logit."""
    b, hkv, _, d = k.shape
    zero = k.new_zeros(b, hkv, 1, d)
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
    hq = sinks.shape[0]
    if mask is None:
        mask = torch.ones(1, 1, n, k.shape[2] - 1, dtype=torch.bool, device=k.device)
    add = torch.zeros(mask.shape, dtype=dtype, device=k.device).masked_fill(~mask, float("-inf"))
    add = add.expand(b, hq, n, add.shape[-1])  # (decode [B, 1, 1, L]; prefill [n, L])
    sink = sinks.to(dtype).view(1, hq, 1, 1).expand(b, hq, n, 1)
    return k, v, torch.cat([add, sink], dim=-1)


def _of_group(slots: torch.Tensor, group: int, dims: int) -> torch.Tensor:
    """A group's slots from a tensor with a leading group axis, or the one table's."""
    return slots if slots.dim() == dims else slots[group]


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the pool at `slots`, as [len(slots), kv_heads, head_dim] in `dtype` (a no-op cast
    when the pool already stores it).

    `index_select` on a 2-D view is a plain row copy; advanced indexing (`cache[slots]`) took
    2-3x longer for the same gather on CPU.
    """
    flat = cache.view(cache.shape[0], -1).index_select(0, slots.reshape(-1))
    return flat.view(-1, *cache.shape[1:]).to(dtype)
