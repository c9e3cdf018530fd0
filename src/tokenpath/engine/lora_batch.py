"""One step's LoRA adapters, as the model reads them (S-LoRA/punica style).

The base model's GEMMs run once over every row of the step; then each adapter in the step adds
its low-rank delta, `scaling * (x @ A^T) @ B^T` in float32, to its own rows only. Rows of the
base model cost nothing extra, and a step mixing four adapters runs four small delta GEMMs per
target, not four base GEMMs. `TorchLoraBatch` is the torch path's form (row index sets per
adapter, applied by `DecoderLayer`); `native_step` builds the native kernels' (a slot per row and
a pointer table per slot, applied inside `tp_model_forward_lora`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tokenpath.engine.lora import LORA_TARGETS, LoraWeights
from tokenpath.engine.model_config import ModelConfig

if TYPE_CHECKING:  # the torch path's form only; the native one is numpy (no torch in a GGUF engine)
    import torch

BLOCK_ROWS = 16  # rows per native work item (csrc/forward.cpp kLoraBlockRows)
MAX_NATIVE_RANK = 256  # (kLoraMaxRank)

# Which targets make up each fused matrix of the torch model, with their column offsets (filled
# from the model's sizes by `fused_offsets`).
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


def fused_offsets(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    nq, nkv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"qkv": [("q_proj", 0), ("k_proj", nq), ("v_proj", nq + nkv)], "o": [("o_proj", 0)],
            "gate_up": [("gate_proj", 0), ("up_proj", i)], "down": [("down_proj", 0)]}


class TorchLoraBatch:
    """Per adapter in the step: its rows (a slice when contiguous, else an index tensor)."""

    def __init__(self, groups: list[tuple[slice | torch.Tensor, LoraWeights]],
                 offsets: dict[str, list[tuple[str, int]]]) -> None:
        self.groups = groups
        self.offsets = offsets

    def add(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += delta(x[rows]) for each adapter's rows; `fused` names the matrix (FUSED)."""
        for rows, w in self.groups:
            targets = w.layers[layer]
            xr: torch.Tensor | None = None
            for target, off in self.offsets[fused]:
                ab = targets.get(target)
                if ab is None:
                    continue
                if xr is None:
                    xr = x[rows].float()
                a, b = ab
                delta = (xr @ a.T) @ b.T * w.scaling
                cols = slice(off, off + b.shape[0])
                if isinstance(rows, slice):
                    y[rows, cols] += delta.to(y.dtype)
                else:
                    y[rows, cols] = y[rows, cols] + delta.to(y.dtype)


def row_groups(spans: list[tuple[int, int, LoraWeights]], device: torch.device) -> list[tuple[slice | torch.Tensor,
                                                                                               LoraWeights]]:
    """(start row, rows, adapter) of each adapter-using sequence -> per adapter, its rows."""
    by: dict[int, tuple[list[tuple[int, int]], LoraWeights]] = {}
    for start, n, w in spans:
        by.setdefault(id(w), ([], w))[0].append((start, n))
    out: list[tuple[slice | torch.Tensor, LoraWeights]] = []
    for ranges, w in by.values():
        ranges.sort()
        contiguous = all(ranges[k][0] + ranges[k][1] == ranges[k + 1][0] for k in range(len(ranges) - 1))
        if contiguous:
            out.append((slice(ranges[0][0], ranges[-1][0] + ranges[-1][1]), w))
        else:
            idx = np.concatenate([np.arange(s, s + n) for s, n in ranges])
            import torch

            out.append((torch.from_numpy(idx).to(device), w))
    return out


def native_step(row_adapters: list[tuple[int, LoraWeights | None]]):  # noqa: ANN201 - NativeLoraStep
    """(rows, adapter or None) per scheduled sequence, in row order -> the kernels' LoRA arguments,
    or None when no row uses an adapter (the plain forward runs). A drafting sequence's rows are
    its 1 + K verification rows (speculative decoding), so its drafts run with its adapter too."""
    from tokenpath.engine.kernels.model import NativeLoraStep

    slots: dict[int, int] = {}
    adapters: list[LoraWeights] = []
    rows: list[list[int]] = []
    row = 0
    for n, w in row_adapters:
        if w is not None:
            slot = slots.get(id(w))
            if slot is None:
                slot = slots[id(w)] = len(adapters)
                adapters.append(w)
                rows.append([])
            rows[slot].extend(range(row, row + n))
        row += n
    if not adapters:
        return None
    ptrs = []
    for w in adapters:
        if w.native is None or w.rank > MAX_NATIVE_RANK:
            raise RuntimeError(f"LoRA adapter {w.name} is not resident in native form")
        ptrs.append(w.native.ptrs)
    blocks, start = [], 0
    for slot, r in enumerate(rows):
        for k in range(0, len(r), BLOCK_ROWS):
            blocks += [slot, start + k, min(BLOCK_ROWS, len(r) - k)]
        start += len(r)
    return NativeLoraStep(blocks=np.array(blocks, dtype=np.int32),
                          rows=np.array([i for r in rows for i in r], dtype=np.int32),
                          ptrs=np.concatenate(ptrs),
                          ranks=np.array([w.rank for w in adapters], dtype=np.int32),
                          scales=np.array([w.scaling for w in adapters], dtype=np.float32))


__all__ = ["FUSED", "LORA_TARGETS", "TorchLoraBatch", "fused_offsets", "native_step", "row_groups"]
