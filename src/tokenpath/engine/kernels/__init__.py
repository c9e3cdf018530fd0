"""tokenpath's native CPU kernels: quantized GEMV/GEMM on GGUF blocks and a fused decoder forward.

The C++ library (csrc/) is built by the package's own setup.py and loaded here with ctypes: no
Python or PyTorch C++ API, tensors cross as raw pointers. One ctypes call costs a few
microseconds, and the engine makes one per step (the whole forward pass), so a binding layer
would buy nothing. `native_library()` returns None (and says why, once) when the library was not
built (TOKENPATH_NO_KERNELS=1 at install, no compiler) or the CPU lacks AVX2+FMA; the engine then
runs on torch float32.

ISA: AVX-512 VNNI when the CPU has it, else AVX2; TOKENPATH_KERNELS_ISA=avx2 forces the AVX2
kernels (the tests run both where the CPU allows).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("tokenpath.engine.kernels")

# ggml's GGMLQuantizationType numbers
F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
# The kernels' 16-row interleaved repacks (csrc/packed_impl.h, csrc/kquant_impl.h)
Q4X16, F16X16, Q5X16, Q8X16, Q4KX16, Q5KX16, Q6KX16, BF16X16 = 100, 101, 106, 108, 112, 113, 114, 130
# Bytes per GGUF block; the row kernels (GGUF layout, float activations too) read only these.
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
# Every type the kernels read, with (weights, bytes) per GGUF block (F16/BF16: 32 weights, as
# the repack groups them): the 5-bit, K-quant and float types run repacked only.
GGUF_BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
               Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), F16: (32, 64), BF16: (32, 64)}
PACKED_FROM = {Q4_0: Q4X16, Q4_1: Q4X16, Q5_0: Q5X16, Q5_1: Q5X16, Q8_0: Q8X16, Q4_K: Q4KX16, Q5_K: Q5KX16,
               Q6_K: Q6KX16, F16: F16X16, BF16: BF16X16}
FLOAT_PACKED = (F16X16, BF16X16)  # float weights: they multiply the float activations
GROUP_ROWS = 16
# Bytes of 16 rows x 32 weights with their scales (the K-quants' super-blocks are 8 of these),
# padded so that a group-block (super-block) is a multiple of 64 bytes.
GROUP_BLOCK_BYTES = {Q4X16: 320, Q5X16: 384, Q8X16: 576, Q4KX16: 296, Q5KX16: 360, Q6KX16: 424, F16X16: 1024,
                     BF16X16: 1024}
TYPE_NAMES = {F16: "F16", BF16: "BF16", F16X16: "F16X16", BF16X16: "BF16X16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
              Q6_K: "Q6_K", Q4X16: "Q4X16", Q5X16: "Q5X16", Q8X16: "Q8X16", Q4KX16: "Q4KX16", Q5KX16: "Q5KX16",
              Q6KX16: "Q6KX16"}
ISA_AVX2, ISA_AVX512 = 1, 2
FEATURE_AVX2, FEATURE_AVX512_VNNI, FEATURE_F16C = 1, 2, 4  # bits of tp_cpu_features()

_P = ctypes.c_void_p
_I = ctypes.c_int


@dataclass(frozen=True)
class NativeLibrary:
    lib: ctypes.CDLL
    features: int  # FEATURE_* bits: AVX2+FMA, AVX-512 VNNI, F16C (float16 KV cache)

    def isa(self, requested: str | None = None) -> int:
        """The kernel set to run: TOKENPATH_KERNELS_ISA (avx2 | avx512 | auto) within what the CPU has."""
        want = (requested or os.environ.get("TOKENPATH_KERNELS_ISA", "auto")).lower()
        if want == "avx2" or not self.features & 2:
            return ISA_AVX2
        return ISA_AVX512

    @property
    def has_f16c(self) -> bool:
        """Whether a float16 KV cache can run: its conversions are F16C instructions."""
        return bool(self.features & FEATURE_F16C)

    def available_isas(self) -> list[int]:
        return [ISA_AVX2] + ([ISA_AVX512] if self.features & 2 else [])


def _library_path() -> Path | None:
    found = sorted(Path(__file__).parent.glob("_native*.so"))
    return found[0] if found else None


# csrc/forward.cpp tp_model_abi: the argument layout this module passes (2: KV-cache groups;
# 3: tp_model_forward_lora, the LoRA deltas beside the base GEMMs; 4: their A and B^T in IEEE halves).
MODEL_ABI = 4


@functools.cache
def native_library() -> NativeLibrary | None:
    """The loaded kernels, or None with one log line saying why the engine falls back."""
    if os.environ.get("TOKENPATH_NO_KERNELS") == "1":
        log.warning("native kernels switched off (TOKENPATH_NO_KERNELS=1): using the torch float32 path")
        return None
    path = _library_path()
    if path is None:
        log.warning("native kernels are not built (reinstall without TOKENPATH_NO_KERNELS, with g++): "
                    "using the torch float32 path")
        return None
    import torch  # noqa: F401  -- load torch's OpenMP runtime first so both share one thread pool

    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("native kernels failed to load (%s): using the torch float32 path", exc)
        return None
    lib.tp_cpu_features.restype = _I
    abi = lib.tp_model_abi() if hasattr(lib, "tp_model_abi") else 1
    if abi != MODEL_ABI:
        log.warning("native kernels at %s are stale (model ABI %d, this code needs %d; rebuild: python setup.py "
                    "build_ext --inplace): using the torch float32 path", path, abi, MODEL_ABI)
        return None
    lib.tp_quantize.argtypes = [_I, _P, _I, _I, _P]
    lib.tp_dequantize_row.argtypes = [_I, _P, _I, _P]
    lib.tp_gemm.argtypes = [_I, _I, _P, _I, _I, _P, _I, _P, _I, _I]
    lib.tp_repack.restype = _I
    lib.tp_repack.argtypes = [_I, _P, _I, _I, _P]
    lib.tp_dequantize_packed_row.argtypes = [_I, _P, _I, _I, _I, _P]
    lib.tp_model_create.restype = _P
    lib.tp_model_create.argtypes = [_P, ctypes.c_float, _I, _P, _P, _P, _P]
    lib.tp_model_free.argtypes = [_P]
    lib.tp_model_forward.argtypes = [_P, _I, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I]
    lib.tp_model_forward_lora.argtypes = [_P, _I, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P]
    features = lib.tp_cpu_features()
    if not features & 1:
        log.warning("this CPU lacks AVX2+FMA: using the torch float32 path")
        return None
    return NativeLibrary(lib=lib, features=features)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def row_bytes(wtype: int, k: int) -> int:
    return -(-k // 32) * BLOCK_BYTES[wtype]


def quantize(lib: NativeLibrary, wtype: int, w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> GGUF blocks [N, row_bytes] (rows zero-padded to a multiple of 32)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    out = np.empty((n, row_bytes(wtype, k)), dtype=np.uint8)
    lib.lib.tp_quantize(wtype, _ptr(w), n, k, _ptr(out))
    return out


def dequantize(lib: NativeLibrary, wtype: int, q: np.ndarray, k: int) -> np.ndarray:
    if wtype not in BLOCK_BYTES:
        raise ValueError(f"{TYPE_NAMES.get(wtype, wtype)}: dequantized natively only once repacked")
    out = np.empty((q.shape[0], k), dtype=np.float32)
    for i in range(q.shape[0]):
        lib.lib.tp_dequantize_row(wtype, _ptr(q[i]), k, _ptr(out[i]))
    return out


def _aligned_empty(shape: tuple[int, int], align: int = 64) -> np.ndarray:
    """uint8 array whose data starts on an `align`-byte boundary: the packed kernels' 512-bit loads
    then never split a cache line (numpy itself only guarantees 16)."""
    raw: np.ndarray = np.empty(shape[0] * shape[1] + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + shape[0] * shape[1]].reshape(shape)


def repack(lib: NativeLibrary, wtype: int, w: np.ndarray) -> tuple[int, np.ndarray]:
    """GGUF blocks [N, row_bytes] -> (PACKED_FROM[wtype], [N / 16, group row bytes]): 16 rows
    interleaved so one vector instruction serves 16 outputs (8 on AVX2; csrc/packed_impl.h).
    Returns (wtype, w) unchanged when N is not a multiple of 16."""
    per_block, block_bytes = GGUF_BLOCKS[wtype]
    n, nb = w.shape[0], w.shape[1] // block_bytes
    w = np.ascontiguousarray(w)
    if n % GROUP_ROWS:
        return wtype, w
    out = _aligned_empty((n // GROUP_ROWS, nb * GROUP_BLOCK_BYTES[PACKED_FROM[wtype]] * per_block // 32))
    got = lib.lib.tp_repack(wtype, _ptr(w), n, nb, _ptr(out))
    return (wtype, w) if got < 0 else (got, out)


def output_rows(wtype: int, w: np.ndarray) -> int:
    """N of a weight matrix in either layout (a packed array has one row per 16 outputs)."""
    return w.shape[0] * GROUP_ROWS if wtype in GROUP_BLOCK_BYTES else w.shape[0]


def dequantize_packed(lib: NativeLibrary, wtype: int, w: np.ndarray, k: int) -> np.ndarray:
    n, nb = output_rows(wtype, w), -(-k // 32)
    out: np.ndarray = np.empty((n, k), dtype=np.float32)
    for i in range(n):
        lib.lib.tp_dequantize_packed_row(wtype, _ptr(w), nb, i, k, _ptr(out[i]))
    return out


def gemm(lib: NativeLibrary, wtype: int, w: np.ndarray, x: np.ndarray, k: int, isa: int, threads: int,
         exact: bool = False, fine: bool = False) -> np.ndarray:
    """y[M, N] = x[M, K] @ dequant(w)[N, K].T with x quantized to int8 per 32-block on the fly
    (fine: plus residual bytes, ~15 bits), or (exact, GGUF layouts only) kept in float32 against
    weights dequantized in registers."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, n = x.shape[0], output_rows(wtype, w)
    packed = wtype in GROUP_BLOCK_BYTES
    if not packed and wtype not in BLOCK_BYTES:
        raise ValueError(f"{TYPE_NAMES.get(wtype, wtype)} runs repacked only (repack() it first)")
    want = -(-k // 32) * GROUP_BLOCK_BYTES[wtype] if packed else row_bytes(wtype, k)
    if x.shape[1] != k or w.shape[1] != want:
        raise ValueError(f"shape mismatch: x {x.shape}, w {w.shape} for K={k}")
    if packed and exact:
        raise ValueError("float activations run on GGUF layouts only; repacked weights take int8 activations")
    y = np.empty((m, n), dtype=np.float32)
    lib.lib.tp_gemm(isa, wtype, _ptr(w), n, k, _ptr(x), m, _ptr(y), threads, 1 if exact else 2 if fine else 0)
    return y
