"""tokenpath's native CPU kernels: quantized GEMV/GEMM on GGUF blocks and a fused decoder forward.

The C++ library (csrc/) is built by the package's own setup.py and loaded with ctypes: no
Python or PyTorch C++ API, tensors cross as raw pointers. One ctypes call costs a few
microseconds, and the engine makes one per step (the whole forward pass), so a binding layer
would buy nothing. Its functions are declared once for ctypes in `abi.py` (and for the compiler
in csrc/tp_api.h). `native_library()` (library.py) returns None (and says why, once) when no
kernel object was built (TOKENPATH_NO_KERNELS=1 at install, no compiler) or the CPU lacks
AVX2+FMA; the engine then runs on torch float32.

ISA: AVX-512 VNNI when the CPU has it and its object was built, else AVX2; `--kernels-isa avx2`
(EngineConfig.kernels_isa, default TOKENPATH_KERNELS_ISA) forces the AVX2 kernels (the tests run
both where the CPU allows).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tokenpath.engine.kernels.abi import MODEL_ABI
from tokenpath.engine.kernels.library import (
    FEATURE_AMX_BF16,
    FEATURE_AVX2,
    FEATURE_AVX512_BF16,
    FEATURE_AVX512_VNNI,
    FEATURE_F16C,
    ISA_AVX2,
    ISA_AVX512,
    ISA_NAMES,
    NativeLibrary,
    load_library,
    native_library,
)

# ggml's GGMLQuantizationType numbers
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
# The kernels' 16-row interleaved repacks (csrc/packed_impl.h, csrc/kquant_impl.h); F32X16's
# number is tokenpath's own (100 + F32's 0 is Q4X16's).
Q4X16, F16X16, Q5X16, Q8X16, Q4KX16, Q5KX16, Q6KX16, BF16X16, F32X16 = 100, 101, 106, 108, 112, 113, 114, 130, 131
# Bytes per GGUF block; the row kernels (GGUF layout, float activations too) read only these.
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
# Every type the kernels read from a GGUF file, with (weights, bytes) per GGUF block (F16/BF16: 32
# weights, as the repack groups them): the 5-bit, K-quant and float types run repacked only.
GGUF_BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
               Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), F16: (32, 64), BF16: (32, 64)}
# What tp_repack takes: GGUF_BLOCKS and float32 rows (a float32 safetensors checkpoint's, 32 weights
# of 4 bytes per block). A GGUF file's F32 matrices are not among GGUF_BLOCKS: they stay Q8_0 at
# load as before (kernels/model.py _as_blocks; tiny test files are their only source).
REPACK_BLOCKS = {**GGUF_BLOCKS, F32: (32, 128)}
PACKED_FROM = {Q4_0: Q4X16, Q4_1: Q4X16, Q5_0: Q5X16, Q5_1: Q5X16, Q8_0: Q8X16, Q4_K: Q4KX16, Q5_K: Q5KX16,
               Q6_K: Q6KX16, F16: F16X16, BF16: BF16X16, F32: F32X16}
FLOAT_PACKED = (F16X16, BF16X16, F32X16)  # float weights: they multiply the float activations
GROUP_ROWS = 16
# Bytes of 16 rows x 32 weights with their scales (the K-quants' super-blocks are 8 of these),
# padded so that a group-block (super-block) is a multiple of 64 bytes.
GROUP_BLOCK_BYTES = {Q4X16: 320, Q5X16: 384, Q8X16: 576, Q4KX16: 296, Q5KX16: 360, Q6KX16: 424, F16X16: 1024,
                     BF16X16: 1024, F32X16: 2048}
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", F16X16: "F16X16", BF16X16: "BF16X16", F32X16: "F32X16",
              Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
              Q6_K: "Q6_K", Q4X16: "Q4X16", Q5X16: "Q5X16", Q8X16: "Q8X16", Q4KX16: "Q4KX16", Q5KX16: "Q5KX16",
              Q6KX16: "Q6KX16"}


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def row_bytes(wtype: int, k: int) -> int:
    return -(-k // 32) * BLOCK_BYTES[wtype]


def quantize(lib: NativeLibrary, wtype: int, w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> GGUF blocks [N, row_bytes]: Q4_0/Q4_1/Q8_0 rows zero-padded to a multiple of
    32; Q5_0 and Q4_K rows must be whole blocks (32, 256 weights)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if wtype in (Q5_0, Q4_K):
        per, size = GGUF_BLOCKS[wtype]
        if k % per:
            raise ValueError(f"{TYPE_NAMES[wtype]} rows are whole blocks of {per} weights, not {k}")
        out = np.empty((n, k // per * size), dtype=np.uint8)
    else:
        out = np.empty((n, row_bytes(wtype, k)), dtype=np.uint8)
    lib.lib.tp_quantize(wtype, _ptr(w), n, k, _ptr(out))
    return out


def quantize_as(lib: NativeLibrary, want: int | None, w: np.ndarray) -> tuple[int, np.ndarray]:
    """(type, blocks) of a float matrix quantized at load for `--quantization` (`want`: Q8_0 or Q4_K;
    None: Q8_0, the conversion of a type the kernels do not read). Q4_K needs rows of whole 256-weight
    super-blocks: a matrix whose rows are not (SmolLM2's 576 inputs) takes Q5_0, and one whose rows
    are not whole 32-blocks Q8_0, as llama.cpp's quantizer falls back for Q4_K."""
    k = w.shape[1]
    if want == Q4_K and k % GGUF_BLOCKS[Q4_K][0] == 0:
        return Q4_K, quantize(lib, Q4_K, w)
    if want == Q4_K and k % GGUF_BLOCKS[Q5_0][0] == 0:
        return Q5_0, quantize(lib, Q5_0, w)
    return Q8_0, quantize(lib, Q8_0, w)


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
    per_block, block_bytes = REPACK_BLOCKS[wtype]
    n, nb = w.shape[0], w.shape[1] // block_bytes
    w = np.ascontiguousarray(w)
    if n % GROUP_ROWS:
        return wtype, w
    out = _aligned_empty((n // GROUP_ROWS, nb * GROUP_BLOCK_BYTES[PACKED_FROM[wtype]] * per_block // 32))
    got = lib.lib.tp_repack(wtype, _ptr(w), n, nb, _ptr(out))
    return (wtype, w) if got < 0 else (got, out)


def repack_parts(lib: NativeLibrary, wtype: int, parts: list[np.ndarray],
                 done: Callable[[np.ndarray], None] | None = None, chunk_rows: int = 4096) -> tuple[int, np.ndarray]:
    """`repack` of the row-wise concatenation of `parts` (each [rows, row_bytes], rows a multiple
    of 16), written straight into the one output allocation `chunk_rows` rows at a time (16-row
    groups repack independently): no concatenated copy, and `done(chunk)` is told each source
    chunk once copied, so a memory-mapped source can drop its pages as the repack goes."""
    per_block, block_bytes = REPACK_BLOCKS[wtype]
    n, nb = sum(p.shape[0] for p in parts), parts[0].shape[1] // block_bytes
    pt = PACKED_FROM[wtype]
    group_bytes = nb * GROUP_BLOCK_BYTES[pt] * per_block // 32
    out = _aligned_empty((n // GROUP_ROWS, group_bytes))
    g = 0
    for part in parts:
        for lo in range(0, part.shape[0], chunk_rows):
            chunk = np.ascontiguousarray(part[lo:lo + chunk_rows])
            rows = chunk.shape[0]
            if lib.lib.tp_repack(wtype, _ptr(chunk), rows, nb, _ptr(out[g:])) < 0:
                raise ValueError(f"{TYPE_NAMES.get(wtype, wtype)}: cannot repack {rows} rows")
            g += rows // GROUP_ROWS
            if done is not None:
                done(chunk)
    return pt, out


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
         exact: bool = False, fine: bool = False, bf16: bool = False) -> np.ndarray:
    """y[M, N] = x[M, K] @ dequant(w)[N, K].T with x quantized to int8 per 32-block on the fly
    (fine: plus residual bytes, ~15 bits), or (exact, GGUF layouts only) kept in float32 against
    weights dequantized in registers. Float weights (F16X16, BF16X16, F32X16) take float32 x; with
    bf16, BF16X16 takes x rounded to bfloat16 on AMX tiles where `lib.has_amx_bf16`, on VDPBF16PS where
    `lib.has_bf16_dot` (float32 elsewhere)."""
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
    mode = 1 if exact else 2 if fine else 3 if bf16 else 0
    lib.lib.tp_gemm(isa, wtype, _ptr(w), n, k, _ptr(x), m, _ptr(y), threads, mode)
    return y


def decode_chunks(lib: NativeLibrary, parts: list[tuple[int, int]], n: int, k: int, threads: int) -> list[int]:
    """The ends of the row chunks a decode step's GEMM over `parts` ((kernel type, rows) each; n rows
    of K = k) is claimed in by `threads` threads (csrc/step_acts.h decode_chunks)."""
    types, rows = (np.array(v, dtype=np.int32) for v in zip(*parts, strict=True))
    ends: np.ndarray = np.zeros(96, dtype=np.int32)  # csrc/step_acts.h kMaxDecodeChunks
    count = lib.lib.tp_decode_chunks(_ptr(types), _ptr(rows), len(parts), n, -(-k // 32), threads, _ptr(ends))
    return [int(e) for e in ends[:count]]


def gemm_tiles(lib: NativeLibrary, wtype: int, m: int, isa: int, fine: bool = False) -> list[int]:
    """The rows of each tile, in order, that the repacked GEMM of `wtype` runs for an m-row step
    (csrc/packed_impl.h tile_rows); [] for a type that is not a repacked integer one."""
    sizes: np.ndarray = np.zeros(max(m, 1), dtype=np.int32)
    n = lib.lib.tp_gemm_tiles(isa, wtype, int(fine), m, _ptr(sizes))
    return [int(t) for t in sizes[:n]]


def stream_read(lib: NativeLibrary, buf: np.ndarray, threads: int, reps: int = 5,
                isa: int | None = None) -> tuple[float, int]:
    """(GB/s, checksum): `threads` threads of the kernels' own OpenMP team each XOR their slice of
    `buf` in the widest vectors of `isa` (default: the best here), the fastest of `reps` reads
    (csrc/read_bw.h). The checksum is the XOR of buf's 64-bit words, which a caller can recompute
    to see that every byte was read. The read-bandwidth bound a decode is measured against: buf
    should be several times the last-level cache, and its pages touched (not the shared zero page)."""
    import ctypes

    if buf.dtype != np.uint8 or not buf.flags.c_contiguous or buf.nbytes % 2**20 or not buf.nbytes:
        raise ValueError("stream_read reads a contiguous uint8 buffer of whole MiB")
    seconds, checksum = ctypes.c_double(), ctypes.c_uint64()
    lib.lib.tp_stream_read(lib.isa() if isa is None else isa, _ptr(buf), buf.nbytes // 2**20, threads, reps,
                           ctypes.addressof(seconds), ctypes.addressof(checksum))
    return buf.nbytes / seconds.value / 1e9, checksum.value


__all__ = ["FEATURE_AMX_BF16", "FEATURE_AVX512_BF16", "FEATURE_AVX2", "FEATURE_AVX512_VNNI", "FEATURE_F16C", "ISA_AVX2", "ISA_AVX512", "ISA_NAMES", "MODEL_ABI",
           "NativeLibrary", "load_library", "native_library"]
