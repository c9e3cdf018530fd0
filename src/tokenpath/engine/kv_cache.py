"""The KV cache's block pool: one K and one V array per layer slot, numpy on the native kernels,
torch on the torch path.

Why two storages behind one class: the native kernels read and write the pool through raw
pointers, so a numpy array serves them as well as a tensor did, and serving a GGUF then never
imports torch (issue 42: torch's import alone is ~218 MiB of RSS, more than llama.cpp's whole
server on SmolLM2). The torch path's attention (engine/attention.py) indexes tensors, on any
device. The dtype is a name ("float32", "float16", "bfloat16": numpy has no bfloat16, which only
the torch path uses; "fp8_e4m3", "fp8_e5m2": one-byte codes the native kernels convert, and
"q8_0": llama.cpp's blocks of 32, both held as numpy uint8, csrc/kv_fp8.h), so sizing the pool
needs neither library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tokenpath.engine.kv_groups import KVLayout

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# llama.cpp's q8_0: blocks of 32 values in 34 bytes (an IEEE half scale, 32 int8), within each head.
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34
# The numpy dtype holding each name the native kernels read (fp8 codes and q8_0 blocks, as bytes).
NUMPY_STORAGE = {"float32": "float32", "float16": "float16", "fp8_e4m3": "uint8", "fp8_e5m2": "uint8",
                 "q8_0": "uint8"}
NATIVE_ONLY = ("fp8_e4m3", "fp8_e5m2", "q8_0")  # no torch conversion: the native kernels' own


def head_bytes(dtype: str, head_dim: int) -> int:
    """Bytes of one token's K (or V) row of one KV head."""
    if dtype == "q8_0":
        if head_dim % Q8_BLOCK:
            raise ValueError(f"a q8_0 KV cache needs head_dim a multiple of {Q8_BLOCK} (this model's is {head_dim})")
        return head_dim // Q8_BLOCK * Q8_BLOCK_BYTES
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"KV cache dtype {dtype!r}: expected one of {', '.join([*DTYPE_BYTES, 'q8_0'])}")
    return head_dim * DTYPE_BYTES[dtype]


class KVCache:
    """One K and one V pool per layer, shaped [num_blocks * block_size, kv_heads, head_dim] so a
    token's slot index addresses it directly. With a KVLayout, layers of different groups share
    arrays (`k[layer]` is its slot's array): a block id is a page of `group_size` layers."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str, device: Any = None, zeroed: bool = True, layout: KVLayout | None = None) -> None:
        """device None: numpy arrays in this process's memory (the native kernels); a torch
        device: tensors there. zeroed=False leaves the pool unwritten, so its pages become
        resident only as slots are used: for readers that never touch a slot before writing it
        (the native kernels). The SDPA path pads gathers with unwritten slots, and a NaN there
        would survive its mask."""
        row = head_bytes(dtype, head_dim)  # (validates dtype)
        layout = layout or KVLayout.single(num_layers)
        # q8_0: each head's row as its bytes (blocks), the other dtypes as values
        shape = (num_blocks * block_size, num_kv_heads, row if dtype == "q8_0" else head_dim)
        alloc: Callable[[], Any]
        if device is None:
            if dtype not in NUMPY_STORAGE:
                raise ValueError(f"a numpy KV cache cannot hold {dtype} (the native kernels use "
                                 f"{', '.join(NUMPY_STORAGE)})")
            make_np = np.zeros if zeroed else np.empty
            alloc = lambda: make_np(shape, dtype=NUMPY_STORAGE[dtype])  # noqa: E731
        else:
            if dtype in NATIVE_ONLY:
                raise ValueError(f"a torch KV cache cannot hold {dtype} (only the native kernels convert it)")
            import torch

            make = torch.zeros if zeroed else torch.empty
            alloc = lambda: make(shape, dtype=getattr(torch, dtype), device=device)  # noqa: E731
        # Any: numpy arrays or torch tensors; each path's callers use its own methods.
        ks: list[Any] = [alloc() for _ in range(layout.group_size)]
        vs: list[Any] = [alloc() for _ in range(layout.group_size)]
        self.dtype = dtype
        self.k = [ks[j] for j in layout.layer_slot]
        self.v = [vs[j] for j in layout.layer_slot]
        self.layer_group = layout.layer_group

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_bytes(dtype, head_dim)
