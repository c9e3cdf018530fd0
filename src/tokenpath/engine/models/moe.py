"""The mixture-of-experts MLP of Qwen3-MoE and Mixtral, on the torch path.

Routing is transformers' own arithmetic, so greedy tokens and tie-breaking match it: router logits
in the model's dtype, softmax over all experts in float32, `torch.topk` for the chosen experts (a
tie goes to the lower expert index, as torch.topk orders it), the chosen weights renormalized to sum
to one when `norm_topk_prob` (Mixtral's softmax over the top-k logits is the same numbers), then
cast to the model's dtype.

The step's tokens are grouped by expert: one stable sort of the (token, expert) pairs, then each
expert that got tokens runs once on all its rows (index_select, gate/up, down, weight, index_add).
An expert's weights are read once per step however many tokens it got, and experts nobody chose
are not read at all. Experts are added in ascending index order, as transformers adds them, so a
token's sum is computed in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenpath.engine.model_config import ModelConfig


class MoEBlock(nn.Module):
    """`num_experts` gated MLPs and a router. Parameters: `router` [E, H], `gate_up` [E, 2I, H]
    (gate rows then up rows, as the dense layer fuses them), `down` [E, H, I]."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = nn.Parameter(torch.empty(e, h, dtype=dtype))
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype))
        self.down = nn.Parameter(torch.empty(e, h, i, dtype=dtype))
        # Cumulative, as csrc/moe.h counts them: pairs routed, experts read, the busiest expert's
        # rows, layer-steps (the engine's `moe_experts` figures; one writer, the step thread).
        self.counters = [0, 0, 0, 0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert indices [T, k]) for each token."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
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
            gate, up = F.linear(x.index_select(0, rows), self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(act(gate) * up, self.down[e]) * scale[start : start + n]
            out.index_add_(0, rows, y)
            start += n
        return out

    def load(self, w: Callable[[str], torch.Tensor], stacked: bool = False) -> None:
        """Copy in `router.weight` and `experts.{e}.{gate,up,down}_proj.weight` (our names, one
        layer's; `stacked`: `experts.{gate,up,down}_proj.weight` [E, rows, cols], GGUF's form),
        each cast as it is copied."""
        self.router.copy_(w("router.weight"))
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
