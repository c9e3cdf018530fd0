"""The mixture-of-experts MLP of Qwen3-MoE, Mixtral, OLMoE, Granite MoE and gpt-oss, on the torch path.

Routing is transformers' own arithmetic, so greedy tokens and tie-breaking match it: router logits
in the model's dtype, softmax over all experts in float32, `torch.topk` for the chosen experts (a
tie goes where torch.topk's CPU kernel leaves it, not always to the lower index: csrc/moe.h's
topk_select does the same), the chosen weights renormalized to sum
to one when `norm_topk_prob` (Mixtral's softmax over the top-k logits is the same numbers), then
cast to the model's dtype.

The step's tokens are grouped by expert: one stable sort of the (token, expert) pairs, then each
expert that got tokens runs once on all its rows (index_select, gate/up, down, weight, index_add).
An expert's weights are read once per step however many tokens it got, and experts nobody chose
are not read at all. Experts are added in ascending index order, as transformers adds them, so a
token's sum is computed in the same order.

gpt-oss and Granite MoE (ModelConfig.moe_topk_softmax): torch.topk over the router logits, a
softmax over the k chosen ones in the logits' dtype. gpt-oss (moe_bias): the router and every
expert matrix have biases, and its fused, interleaved gate/up columns are split into this block's
gate rows and up rows at load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenpath.engine.model_config import ModelConfig


class MoEBlock(nn.Module):
    """`num_experts` gated MLPs and a router. Parameters: `router` [E, H], `gate_up` [E, 2I, H]
    (gate rows then up rows, as the dense layer fuses them), `down` [E, H, I]; with `moe_bias`,
    `router_bias` [E], `gate_up_bias` [E, 2I] and `down_bias` [E, H] too."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk, self.topk_softmax = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.moe_topk_softmax
        self.router = nn.Parameter(torch.empty(e, h, dtype=dtype))
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype))
        self.down = nn.Parameter(torch.empty(e, h, i, dtype=dtype))
        bias = cfg.moe_bias
        self.router_bias = nn.Parameter(torch.empty(e, dtype=dtype)) if bias else None
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(e, h, dtype=dtype)) if bias else None
        # Cumulative, as csrc/moe.h counts them: pairs routed, experts read, the busiest expert's
        # rows, layer-steps (the engine's `moe_experts` figures; one writer, the step thread).
        self.counters = [0, 0, 0, 0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert indices [T, k]) for each token."""
        logits = F.linear(x, self.router, self.router_bias)
        if self.topk_softmax:  # gpt-oss: the softmax over the chosen logits, in their dtype
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), experts
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`glu(gate, up)`: the gated activation (act(gate) * up, or gpt-oss' clamped SwiGLU)."""
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        scale = weights.reshape(-1)[order].unsqueeze(-1)
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        c = self.counters
        c[0], c[1], c[2], c[3] = c[0] + len(flat), c[1] + sum(n > 0 for n in counts), c[2] + max(counts), c[3] + 1
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            gu_bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
            gate, up = F.linear(x.index_select(0, rows), self.gate_up[e], gu_bias).chunk(2, dim=-1)
            y = F.linear(glu(gate, up), self.down[e], None if self.down_bias is None else self.down_bias[e])
            y = y * scale[start : start + n]
            out.index_add_(0, rows, y)
            start += n
        return out

    def load(self, w: Callable[[str], torch.Tensor], stacked: bool = False, fused_gate_up: bool = False) -> None:
        """Copy in `router.weight` and `experts.{e}.{gate,up,down}_proj.weight` (our names, one
        layer's; `stacked`: `experts.{gate,up,down}_proj.weight` [E, rows, cols], GGUF's form;
        `fused_gate_up`: `experts.gate_up.weight` [E, 2I, H] and `experts.down.weight` [E, H, I],
        Granite MoE's, already in this block's layout), each cast as it is copied."""
        self.router.copy_(w("router.weight"))
        if fused_gate_up:
            self.gate_up.copy_(w("experts.gate_up.weight"))
            self.down.copy_(w("experts.down.weight"))
            return
        i = self.down.shape[2]
        if stacked:
            self.gate_up[:, :i].copy_(w("experts.gate_proj.weight"))
            self.gate_up[:, i:].copy_(w("experts.up_proj.weight"))
            self.down.copy_(w("experts.down_proj.weight"))
            return
        for e in range(self.gate_up.shape[0]):
            self.gate_up[e, :i].copy_(w(f"experts.{e}.gate_proj.weight"))
            self.gate_up[e, i:].copy_(w(f"experts.{e}.up_proj.weight"))
            self.down[e].copy_(w(f"experts.{e}.down_proj.weight"))

    def load_fused(self, w: Callable[[str], torch.Tensor]) -> None:
        """gpt-oss' form (our names, one layer's): `router.{weight,bias}`, `experts.gate_up_proj`
        [E, H, 2I] whose even columns are gate and odd ones up (applied as x @ W), its bias [E, 2I]
        interleaved alike, `experts.down_proj` [E, I, H] and its bias [E, H]."""
        if self.router_bias is None or self.gate_up_bias is None or self.down_bias is None:
            raise ValueError("load_fused: a block built without moe_bias")  # (a loader bug, not input)
        i = self.down.shape[2]
        self.router.copy_(w("router.weight"))
        self.router_bias.copy_(w("router.bias"))
        gate_up, gate_up_bias = w("experts.gate_up_proj"), w("experts.gate_up_proj_bias")
        self.gate_up[:, :i].copy_(gate_up[:, :, 0::2].transpose(1, 2))
        self.gate_up[:, i:].copy_(gate_up[:, :, 1::2].transpose(1, 2))
        self.gate_up_bias[:, :i].copy_(gate_up_bias[:, 0::2])
        self.gate_up_bias[:, i:].copy_(gate_up_bias[:, 1::2])
        self.down.copy_(w("experts.down_proj").transpose(1, 2))
        self.down_bias.copy_(w("experts.down_proj_bias"))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss' activation, as transformers' GptOssExperts._apply_gate computes it: the gate
    clamped from above only, up from both sides, and up's + 1."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
