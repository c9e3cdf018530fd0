"""A sparse layer's router and experts as the native kernels run them (csrc/moe.h, tp_model_set_moe).

Each of the experts' gate, up and down matrices becomes one allocation holding every expert's
rows, expert e at e * stride: GGUF's stacked 3D tensors (ffn_{gate,up,down}_exps [experts, rows,
cols]) are already that, rows of expert after expert, and a safetensors checkpoint's per-expert 2D
tensors are concatenated. They keep the file's own blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K,
F16, BF16, and a safetensors checkpoint's F32) and are repacked 16 rows at a time like the dense
matrices (an expert's rows are a multiple of 16, so no 16-row group straddles two experts); no
float copy is made. A GGUF file's float32 experts (tiny test files) and every expert under
`--quantization q8_0` are quantized to Q8_0. Any other
type (Q2_K, Q3_K, the IQ types, MXFP4, ...) is refused at load naming the tensor: requantizing
tens of gigabytes of experts at load is not a fallback worth having.
The router stays float32 ([experts, hidden], a few MiB at most): routing decides which weights are
read at all, so it is computed exactly as the torch path computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenpath.engine.kernels import (
    BF16,
    BLOCK_BYTES,
    F16,
    F32,
    GGUF_BLOCKS,
    GROUP_ROWS,
    Q8_0,
    REPACK_BLOCKS,
    NativeLibrary,
    quantize,
    quantize_as,
    repack,
)
from tokenpath.engine.loader import LoadedModel
from tokenpath.engine.loader_hf import hf_weights
from tokenpath.errors import ModelLoadError

PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class ExpertLayer:
    """tp_model_set_moe's arguments for one layer; `blocks` and `router` must outlive the model."""

    dims: np.ndarray  # int32 [experts, top-k, expert FFN rows, norm_topk]
    router: np.ndarray  # float32 [experts * hidden]
    types: np.ndarray  # int32 [3]: gate, up, down kernel types
    ptrs: np.ndarray  # uint64 [6]: gate, up, down, then the bytes between consecutive experts
    blocks: list[np.ndarray]


def _file_name(loaded: LoadedModel, name: str) -> str:
    return loaded.gguf.names[name] if loaded.gguf is not None else name


def _float(loaded: LoadedModel, i: int, proj: str, rows: int) -> np.ndarray:
    """Every expert's `proj` rows, dequantized to float32 [experts * rows, cols]."""
    if loaded.gguf is not None:
        return np.asarray(loaded.gguf.dequantized(f"layers.{i}.experts.{proj}.weight"), dtype=np.float32).reshape(
            loaded.config.num_experts * rows, -1)
    weights = hf_weights(loaded)
    return np.concatenate([weights.dense(f"layers.{i}.experts.{e}.{proj}.weight")
                           for e in range(loaded.config.num_experts)])


def _stored(loaded: LoadedModel, i: int, proj: str) -> tuple[int, np.ndarray | None, str]:
    """(ggml type, blocks [experts * rows, row bytes] or None where they must be quantized (a GGUF's
    float32, mixed dtypes), the tensor's name in the file)."""
    if loaded.gguf is not None:
        name = f"layers.{i}.experts.{proj}.weight"
        raw = loaded.gguf.raw(name)
        data = None if raw.ggml_type == F32 else np.ascontiguousarray(raw.data).view(np.uint8)
        return raw.ggml_type, data, _file_name(loaded, name)
    weights = hf_weights(loaded)
    names = [f"layers.{i}.experts.{e}.{proj}.weight" for e in range(loaded.config.num_experts)]
    dtype = weights.dtypes[names[0]]
    kind = {"BF16": BF16, "F16": F16, "F32": F32}.get(dtype)
    views = [v for n in names if (v := weights.matrix_bytes(n)) is not None]
    if kind is None or any(weights.dtypes[n] != dtype for n in names) or len(views) != len(names):
        return F32, None, names[0]  # dequantized to float32 and quantized to Q8_0 by the caller
    blocks = np.concatenate(views)
    for v in views:
        weights.release_view(v)
    return kind, blocks, names[0]


def _type_name(t: int) -> str:
    try:
        from tokenpath.engine.ggml_types import GGMLType

        return GGMLType(t).name
    except ValueError:
        return str(t)


def expert_matrix(lib: NativeLibrary, loaded: LoadedModel, i: int, proj: str, want: int | None,
                  pack: bool) -> tuple[int, np.ndarray]:
    """(kernel type, blocks) of every expert's `proj` matrix of layer i, one allocation."""
    cfg = loaded.config
    rows, cols = (cfg.hidden_size, cfg.moe_intermediate_size) if proj == "down_proj" else \
        (cfg.moe_intermediate_size, cfg.hidden_size)
    t, blocks, name = _stored(loaded, i, proj)
    if t != F32 and t not in GGUF_BLOCKS:
        raise ModelLoadError(f"expert tensor '{name}' has type {_type_name(t)}: the native expert kernels run "
                             f"{', '.join(sorted(_type_name(k) for k in GGUF_BLOCKS))} (and float32, as Q8_0)")
    if blocks is None or want not in (None, t):
        t, blocks = quantize_as(lib, want, _float(loaded, i, proj, rows))
    if pack and rows % GROUP_ROWS == 0 and cols % REPACK_BLOCKS[t][0] == 0:
        return repack(lib, t, blocks)
    if t not in BLOCK_BYTES:  # unpacked, the kernels run Q4_0/Q4_1/Q8_0 rows only
        t, blocks = Q8_0, quantize(lib, Q8_0, _float(loaded, i, proj, rows))
    if pack and rows % GROUP_ROWS == 0:  # Q8_0 rows are whole (zero-padded) blocks: they repack
        return repack(lib, t, blocks)
    return t, blocks


def expert_layer(lib: NativeLibrary, loaded: LoadedModel, i: int, want: int | None, pack_gate_up: bool,
                 pack_down: bool) -> ExpertLayer:
    cfg = loaded.config
    mats = [expert_matrix(lib, loaded, i, p, want, pack) for p, pack in
            zip(PROJS, (pack_gate_up, pack_gate_up, pack_down), strict=True)]
    if loaded.gguf is not None:
        router = loaded.gguf.dequantized(f"layers.{i}.router.weight")
    else:
        router = hf_weights(loaded).dense(f"layers.{i}.router.weight")
    # A copy: a GGUF's F32 router is otherwise a view of the mapping, whose pages the load drops
    # after each matrix (kernels/model.py `_matrix`) and every step would fault back in.
    router = np.array(router, dtype=np.float32, order="C", copy=True).reshape(-1)
    blocks = [np.ascontiguousarray(b) for _, b in mats]
    return ExpertLayer(
        dims=np.array([cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, int(cfg.norm_topk_prob)],
                      dtype=np.int32),
        router=router, types=np.array([t for t, _ in mats], dtype=np.int32),
        ptrs=np.array([b.ctypes.data for b in blocks] + [b.nbytes // cfg.num_experts for b in blocks], dtype=np.uint64),
        blocks=blocks)
