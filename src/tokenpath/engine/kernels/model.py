"""The native decoder: a llama-family model whose weights stay in GGUF blocks, run as one native
call per engine step (`tp_model_forward` in csrc/forward.cpp).

What it holds: per layer the fused QKV and gate/up matrices (rows of the GGUF tensors stacked,
which keeps their blocks intact), the output and down projections, the norms; the embedding
(also the LM head when tied) and the RoPE tables. Tensor types the kernels lack (F16, K-quants)
and safetensors checkpoints under `--quantization q8_0` are quantized to Q8_0 at load.
The KV cache stays the engine's own block pool, float32 or float16: the kernels read and write it
in place, converting float16 in registers.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from tokenpath.engine.attention import KVCache
from tokenpath.engine.kernels import (
    BLOCK_BYTES,
    Q8_0,
    TYPE_NAMES,
    NativeLibrary,
    native_library,
    quantize,
    repack,
)
from tokenpath.engine.loader import LoadedModel
from tokenpath.engine.model_config import ModelConfig
from tokenpath.engine.models.llama import Rope

log = logging.getLogger("tokenpath.engine.kernels")


def native_unsupported(cfg: ModelConfig) -> list[str]:
    """The features of `cfg` the native forward does not compute (plain llama/qwen2 only):
    such a model runs on torch rather than natively and wrong. (head_dim != hidden / heads it
    does compute: tests/engine/test_native_attention.py's head_dim 20 model.)"""
    checks = {
        "rope scaling": cfg.rope_scaling is not None,
        "sliding windows": cfg.has_windows,
        "per-layer rope bases": cfg.rope_local_theta is not None,
        "QK-norm": cfg.qk_norm,
        "sandwich norms": cfg.sandwich_norms,
        f"activation {cfg.hidden_act}": cfg.hidden_act != "silu",
        "embedding scale": cfg.embed_scale != 1.0,
        "attention scale": cfg.attn_scale is not None,
        "norm offset": cfg.norm_offset != 0.0,
    }
    return [name for name, hit in checks.items() if hit]


def select_native(loaded: LoadedModel, quantization: str, device: torch.device) -> NativeLibrary | None:
    """The kernels to run this model with, or None for the torch path (saying why in one line).

    auto: GGUF checkpoints run natively on their own blocks; safetensors ones stay on torch
    (their float weights are what the user asked for). q8_0: any checkpoint, every matrix Q8_0.
    """
    if quantization == "none":
        return None
    if device.type != "cpu":
        if quantization != "auto":
            log.warning("--quantization %s: the native kernels are CPU-only; using torch on %s",
                        quantization, device)
        return None
    missing = native_unsupported(loaded.config)
    if missing:
        log.log(logging.INFO if quantization == "auto" else logging.WARNING,
                "the native kernels do not compute %s yet: torch path", ", ".join(missing))
        return None
    if quantization == "auto" and loaded.gguf is None:
        log.info("safetensors checkpoint: torch float path (--quantization q8_0 runs it on the native kernels)")
        return None
    return native_library()


def _as_blocks(lib: NativeLibrary, loaded: LoadedModel, name: str, want: int | None) -> tuple[int, np.ndarray]:
    """(ggml type, [rows, bytes]) of one matrix: the GGUF's own blocks when the kernels read that
    type (and `want` allows it), else quantized here to Q8_0."""
    if loaded.gguf is not None:
        raw = loaded.gguf.raw(name)
        if raw.ggml_type in BLOCK_BYTES and want in (None, raw.ggml_type):
            return raw.ggml_type, raw.data
        dense = loaded.gguf.dequantized(name)
    else:
        dense = loaded.weights[name].numpy()
    return Q8_0, quantize(lib, Q8_0, dense)


def _stacked(lib: NativeLibrary, loaded: LoadedModel, names: list[str], want: int | None) -> tuple[int, np.ndarray]:
    """Rows of several matrices with the same input size stacked into one (fused QKV, gate/up)."""
    parts = [_as_blocks(lib, loaded, n, want) for n in names]
    if len({t for t, _ in parts}) > 1:  # mixed types (e.g. a Q6_K attn_v): one format for the fused matrix
        parts = [_as_blocks(lib, loaded, n, Q8_0) for n in names]
    return parts[0][0], np.ascontiguousarray(np.concatenate([b for _, b in parts]))


def _dense(loaded: LoadedModel, name: str) -> np.ndarray:
    if loaded.gguf is not None:
        return np.ascontiguousarray(loaded.gguf.dequantized(name), dtype=np.float32).reshape(-1)
    return np.ascontiguousarray(loaded.weights[name].numpy(), dtype=np.float32).reshape(-1)


# Bits of TOKENPATH_KERNELS_EXACT and TOKENPATH_KERNELS_FINE, in the order forward.cpp numbers the matmuls.
EXACT_QKV, EXACT_O, EXACT_GATE_UP, EXACT_DOWN, EXACT_HEAD = 1, 2, 4, 8, 16
# Activations per matmul: int8 per 32-block (llama.cpp's q8 scheme), "fine" (int8 plus a second
# int8 pass over the rounding error, ~15 bits; csrc/tp_kernels.h QAct::q2), or float ("exact",
# GGUF layout, slowest). Measured on the quality test (perplexity of the committed text against
# float32 torch on the same weights; greedy: of 8 prompts, how many keep float32's first 16
# tokens), float16 KV, repacked kernels:
#   all int8 +0.75%, 3/8    all fine +0.01%, 8/8    fine but for one matmul +0.11 to +0.19%, 5-8/8
# Every int8 matmul left in costs about 0.1% perplexity, and with it the greedy agreement becomes
# a coin toss at the float32 path's near-ties (top two log-probabilities 0.01-0.09 apart), which
# any change of summation order flips. So fine everywhere is the default: it meets the quality bar
# with margin, for about 1.8x the integer work of int8 (GEMM time at M >= 32; 1.25x at M = 1, where
# reading the weights dominates). TOKENPATH_KERNELS_FINE=0 selects llama.cpp's all-int8 scheme.
DEFAULT_EXACT = 0
DEFAULT_FINE = 0b11111


def _mask_from_env(name: str, default: int) -> int:
    """A bit mask over qkv, o, gate_up, down, head from `name`: 1/all/true = all, 0 = none, or a
    number such as 0x8; unset means `default`."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "all", "true"):
        return 0b11111
    try:
        return int(value, 0) & 0b11111
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected 1, all, 0 or a bit mask such as 0x8 "
                         "(bits: qkv, o, gate_up, down, head)") from None


def fine_mask() -> int:
    """Which matmuls take int8 activations with residual bytes (~15 bits; TOKENPATH_KERNELS_FINE)."""
    return _mask_from_env("TOKENPATH_KERNELS_FINE", DEFAULT_FINE)


def exact_mask() -> int:
    """Which matmuls keep float activations (TOKENPATH_KERNELS_EXACT)."""
    return _mask_from_env("TOKENPATH_KERNELS_EXACT", DEFAULT_EXACT)


class NativeLlama:
    def __init__(self, lib: NativeLibrary, loaded: LoadedModel, quantization: str, cache: KVCache,
                 block_size: int, max_positions: int) -> None:
        cfg = loaded.config
        self.lib, self.vocab = lib, cfg.vocab_size
        want = Q8_0 if quantization == "q8_0" else None
        keep: list[np.ndarray | torch.Tensor] = []  # everything the C++ side points into

        def ptr(a: np.ndarray | torch.Tensor | None) -> int:
            if a is None:
                return 0
            keep.append(a)
            return a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data

        exact = exact_mask()

        def packed(kind: int, blocks: tuple[int, np.ndarray]) -> tuple[int, np.ndarray]:
            """The int8-activation matmuls run on 16-row interleaved weights (csrc/packed_impl.h):
            the same bytes moved, 2-4x the GEMM speed. Float-activation ones keep GGUF's layout."""
            return blocks if exact & kind else repack(lib, *blocks)

        layer_ptrs, layer_types = [], []
        for i in range(cfg.num_layers):
            def w(n: str, i: int = i) -> str:
                return f"layers.{i}.{n}"

            qkv_t, qkv = packed(EXACT_QKV, _stacked(lib, loaded, [w(f"{p}_proj.weight") for p in "qkv"], want))
            o_t, o = packed(EXACT_O, _stacked(lib, loaded, [w("o_proj.weight")], want))
            gu_t, gu = packed(EXACT_GATE_UP, _stacked(lib, loaded, [w("gate_proj.weight"), w("up_proj.weight")], want))
            d_t, down = packed(EXACT_DOWN, _stacked(lib, loaded, [w("down_proj.weight")], want))
            bias = (np.concatenate([_dense(loaded, w(f"{p}_proj.bias")) for p in "qkv"])
                    if cfg.attention_bias else None)
            layer_ptrs += [ptr(_dense(loaded, w("input_norm.weight"))), ptr(_dense(loaded, w("post_norm.weight"))),
                           ptr(bias), ptr(qkv), ptr(o), ptr(gu), ptr(down), ptr(cache.k[i]), ptr(cache.v[i])]
            layer_types += [qkv_t, o_t, gu_t, d_t]
        embed_t, embed = _stacked(lib, loaded, ["embed.weight"], want)
        if cfg.tie_word_embeddings:  # one copy: embedding lookups read the head's rows in either layout
            head_t, head = embed_t, embed = packed(EXACT_HEAD, (embed_t, embed))
        else:
            head_t, head = packed(EXACT_HEAD, _stacked(lib, loaded, ["lm_head.weight"], want))
        rope = Rope(cfg.head_dim, cfg.rope_theta, max_positions)
        glob = [ptr(embed), ptr(head), ptr(_dense(loaded, "norm.weight")), ptr(rope.cos.contiguous()),
                ptr(rope.sin.contiguous())]
        dims = np.array([cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                         cfg.head_dim, cfg.vocab_size, max_positions, block_size, embed_t, head_t,
                         exact, int(cache.k[0].dtype == torch.float16), fine_mask() & ~exact], dtype=np.int32)
        arrays = [np.array(glob, dtype=np.uint64), np.array(layer_ptrs, dtype=np.uint64),
                  np.array(layer_types, dtype=np.int32)]
        if cache.k[0].dtype not in (torch.float32, torch.float16) or (cache.k[0].dtype == torch.float16
                                                                      and not lib.has_f16c):
            raise ValueError(f"the native kernels cannot use a {cache.k[0].dtype} KV cache on this CPU")
        self.isa = lib.isa()
        self.kv_dtype = cache.k[0].dtype
        self._handle = lib.lib.tp_model_create(dims.ctypes.data, cfg.rms_norm_eps, self.isa,
                                               *(a.ctypes.data for a in arrays))
        self._keep = keep
        self.weight_bytes = sum(a.nbytes for a in {id(a): a for a in keep if isinstance(a, np.ndarray)}.values())
        names = ("qkv", "o", "gate_up", "down", "head")
        log.info("native kernels: %s, %s weights (%.0f MiB), activations float for [%s], fine (int8 + residual) "
                 "for [%s], int8 for the rest, %s KV cache", "AVX-512 VNNI" if self.isa == 2 else "AVX2",
                 "/".join(sorted({TYPE_NAMES[t] for t in layer_types})), self.weight_bytes / 2**20,
                 ",".join(n for i, n in enumerate(names) if dims[11] >> i & 1),
                 ",".join(n for i, n in enumerate(names) if dims[13] >> i & 1), str(self.kv_dtype).removeprefix("torch."))

    def forward(self, ids: np.ndarray, pos: np.ndarray, slot_mapping: np.ndarray, row_table: np.ndarray,
                tables: np.ndarray, logit_rows: np.ndarray) -> torch.Tensor:
        """One step over T rows -> float32 logits [len(logit_rows), vocab]. int32 inputs except
        slot_mapping (int64); row_table[t] is the offset of row t's block table in `tables`."""
        logits = torch.empty((len(logit_rows), self.vocab), dtype=torch.float32)
        self.lib.lib.tp_model_forward(self._handle, len(ids), ids.ctypes.data, pos.ctypes.data,
                                      slot_mapping.ctypes.data, row_table.ctypes.data, tables.ctypes.data,
                                      len(logit_rows), logit_rows.ctypes.data, logits.data_ptr(),
                                      torch.get_num_threads())
        return logits

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle:
            self.lib.lib.tp_model_free(handle)
            self._handle = None


__all__ = ["NativeLlama", "select_native", "native_library"]
