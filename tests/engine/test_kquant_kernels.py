"""The native kernels on the 5-bit, K-quant and float blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16,
and F32 rows) against gguf-py (numpy for F32).

The weights are random GGUF blocks (random bytes, with fp16 scales set to sane values), so every
bit pattern of the quants and 6-bit scales is exercised, and the reference is gguf-py's own
dequantize followed by a float64 matmul: an independent reader of the same bytes. Bounds, per
output, relative to the largest |output|:
  - against the activations as the kernels quantize them (int8 per 32-block, or int8 plus
    residual bytes), then float64: 1e-5, the float32 accumulation only;
  - against the float activations: 3e-2 with int8 activations, 2e-4 with residual bytes;
  - F16, BF16 and F32 weights take the float activations: 1e-5.
AVX2 and AVX-512 VNNI give the same bits, and a row's result does not depend on its batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from tokenpath.engine import kernels as K

lib = K.native_library()
pytestmark = pytest.mark.requires("kernels")

ISAS = [] if lib is None else lib.available_isas()
TYPES = [K.Q5_0, K.Q5_1, K.Q4_K, K.Q5_K, K.Q6_K, K.F16, K.BF16, K.F32]
FLOATS = (K.F16, K.BF16, K.F32)
# (M, N, K): the tile sizes 8/4/2/1 and their tails; K multiples of 256 (a K-quant row is whole
# super-blocks; Q5 runs on them too).
SHAPES = [(1, 16, 256), (3, 48, 512), (16, 32, 256), (33, 64, 768)]
# Byte offsets of the fp16 scale fields of each block type, and the range they are drawn from.
SCALE_FIELDS = {K.Q8_0: (0,), K.Q5_0: (0,), K.Q5_1: (0, 2), K.Q4_K: (0, 2), K.Q5_K: (0, 2), K.Q6_K: (208,)}


def random_blocks(wtype: int, n: int, k: int, rng: np.random.Generator, size: float = 1 / 64) -> np.ndarray:
    """[n, row bytes] of random blocks: random quants and sub-block scales, fp16 scales of
    magnitude `size` / 5 to `size`, either sign."""
    if wtype in FLOATS:  # values, not blocks: normal floats of magnitude `size` * 8
        w = (rng.standard_normal((n, k)) * size * 8).astype(np.float32)
        if wtype == K.F32:
            return w.view(np.uint8)
        return (w.astype(np.float16) if wtype == K.F16 else (w.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8)
    per_block, block_bytes = K.REPACK_BLOCKS[wtype]
    nb = k // per_block
    blocks = rng.integers(0, 256, size=(n * nb, block_bytes), dtype=np.uint8)
    for off in SCALE_FIELDS[wtype]:
        scale = (rng.uniform(0.2, 1.0, n * nb) * rng.choice([-1, 1], n * nb) * size).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, nb * block_bytes)


def dequantized(wtype: int, q: np.ndarray) -> np.ndarray:
    if wtype == K.F16:
        return q.view(np.float16).astype(np.float32)
    if wtype == K.F32:
        return q.view(np.float32).copy()
    return gguf_dequantize(q, GGMLQuantizationType(wtype)).reshape(q.shape[0], -1)


def activations(x: np.ndarray, fine: bool) -> np.ndarray:
    """x as the kernels see it: per 32-block d = max|x| / 127, q = round(x / d); with residual
    bytes also q2 = round((x - d q) / (d / 254)), clipped to int8."""
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    amax = np.abs(b).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(b * inv)
    d = (amax / np.float32(127)).astype(np.float32)
    out = q.astype(np.float64) * d
    if fine:
        rest = (b - (q * d).astype(np.float32)).astype(np.float32)
        inv2 = np.where(d > 0, np.float32(254) / np.where(d > 0, d, 1), 0).astype(np.float32)
        q2 = np.clip(np.rint(rest * inv2), -127, 127)
        out = (254 * q + q2).astype(np.float64) * (d / np.float32(254)).astype(np.float32)
    return out.reshape(m, k)


@pytest.mark.parametrize("wtype", TYPES, ids=lambda t: K.TYPE_NAMES[t])
def test_repack_keeps_the_files_numbers(wtype):
    """The repacked rows dequantize to gguf-py's floats bit for bit: bytes moved, not changed."""
    rng = np.random.default_rng(wtype)
    q = random_blocks(wtype, 32, 512, rng)
    packed_type, packed = K.repack(lib, wtype, q)
    assert packed_type == K.PACKED_FROM[wtype]
    assert packed.ctypes.data % 64 == 0
    assert np.array_equal(K.dequantize_packed(lib, packed_type, packed, 512), dequantized(wtype, q))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", TYPES, ids=lambda t: K.TYPE_NAMES[t])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemm_matches_gguf_dequantize_in_float64(isa, wtype, shape):
    m, n, k = shape
    rng = np.random.default_rng(m * 1000 + n + k + wtype)
    q = random_blocks(wtype, n, k, rng)
    wd = dequantized(wtype, q).astype(np.float64)
    packed_type, packed = K.repack(lib, wtype, q)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    plain = x.astype(np.float64) @ wd.T
    scale = np.abs(plain).max()
    for fine, bound in ((False, 3e-2), (True, 2e-4)):
        y = K.gemm(lib, packed_type, packed, x, k, isa, threads=2, fine=fine)
        if packed_type in K.FLOAT_PACKED:
            assert np.abs(y - plain).max() <= 1e-5 * scale
            continue
        assert np.abs(y - activations(x, fine) @ wd.T).max() <= 1e-5 * scale
        assert np.abs(y - plain).max() <= bound * scale


def test_isas_agree_bit_for_bit_and_rows_are_batch_invariant():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((13, 512)).astype(np.float32)
    for wtype in TYPES:
        packed_type, w = K.repack(lib, wtype, random_blocks(wtype, 48, 512, rng))
        for fine in (False, True):
            results = []
            for isa in ISAS:
                whole = K.gemm(lib, packed_type, w, x, 512, isa, threads=2, fine=fine)
                alone = np.concatenate([K.gemm(lib, packed_type, w, x[i : i + 1], 512, isa, threads=1, fine=fine)
                                        for i in range(len(x))])
                assert np.array_equal(whole, alone), (K.TYPE_NAMES[wtype], isa, fine)
                for m in range(2, len(x)):  # every tile size of a few-row step (packed_impl.h tile_rows)
                    part = K.gemm(lib, packed_type, w, x[:m], 512, isa, threads=1, fine=fine)
                    assert np.array_equal(part, alone[:m]), (K.TYPE_NAMES[wtype], isa, fine, m)
                results.append(whole)
            assert all(np.array_equal(results[0], r) for r in results[1:]), (K.TYPE_NAMES[wtype], fine)


def test_new_types_run_repacked_only():
    q = random_blocks(K.Q4_K, 24, 256, np.random.default_rng(0))  # 24 rows: no 16-row groups
    assert K.repack(lib, K.Q4_K, q)[0] == K.Q4_K
    with pytest.raises(ValueError, match="Q4_K runs repacked only"):
        K.gemm(lib, K.Q4_K, q, np.ones((1, 256), dtype=np.float32), 256, K.ISA_AVX2, threads=1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", [t for t in TYPES if t not in FLOATS], ids=lambda t: K.TYPE_NAMES[t])
def test_largest_weights_and_activations_keep_exact_integer_sums(isa, wtype):
    """Every quant at its largest value against activations whose int8 bytes (and residual bytes)
    sit at the clamp: the integer sums are as large as the formats allow. The AVX2 kernels add
    maddubs' int16 pair sums over several 4-weight chunks before widening them (kquant_impl.h); one
    chunk too many saturates int16 here and misses the float64 reference by far more than 1e-5.
    Steps of 1 and 2 rows too: on AVX2 they run the one-pass decode tiles (packed_impl.h any_tile2),
    whose sums are written apart from the 3-row tile's."""
    rng = np.random.default_rng(wtype)
    k = 512
    q = random_blocks(wtype, 32, k, rng)
    per_block, block_bytes = K.GGUF_BLOCKS[wtype]
    blocks = q.reshape(-1, block_bytes)
    scales = {off for off in SCALE_FIELDS[wtype]}
    keep = np.zeros(block_bytes, dtype=bool)
    for off in scales:
        keep[off : off + 2] = True
    if wtype == K.Q6_K:
        keep[192:208] = True  # the int8 sub-block scales stay random (either sign)
    blocks[:, ~keep] = 0xFF  # quants (and Q4_K/Q5_K's 6-bit scales and minimums) at their maximum
    wd = dequantized(wtype, q).astype(np.float64)
    packed_type, packed = K.repack(lib, wtype, q)
    # Per 32-block: one 127 (sets the step d = 1), the rest 126.4999: q = 126 and the residual
    # 0.4999 * 254 rounds to 127, both bytes near the clamp. Row 1 is the same, negated.
    row = np.full(k, 126.4999, dtype=np.float32)
    row[::32] = 127
    x = np.stack([row, -row, np.full(k, 3.0, dtype=np.float32)])
    for fine in (False, True):
        ref = activations(x, fine) @ wd.T
        for rows in (slice(0, 3), slice(0, 2), slice(0, 1), slice(1, 2)):
            y = K.gemm(lib, packed_type, packed, x[rows], k, isa, threads=1, fine=fine)
            err = np.abs(y - ref[rows]).max()
            assert err <= 1e-5 * np.abs(ref[rows]).max(), (K.TYPE_NAMES[wtype], fine, rows)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (nearest even), as float64: the activations the AMX tiles multiply."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("wtype", [K.BF16, K.Q5_0, K.Q5_1, K.Q4_K, K.Q5_K, K.Q6_K], ids=lambda t: K.TYPE_NAMES[t])
@pytest.mark.parametrize("shape", [(1, 16, 256), (5, 48, 256), (17, 32, 512), (37, 80, 1536), (64, 64, 256),
                                   (70, 1104, 512), (40, 112, 12288)], ids=str)
def test_bf16_activations_on_amx_tiles_or_vdpbf16ps(wtype, shape):
    """bf16 activations on AMX tiles (csrc/amx_bf16.cpp): BF16X16 weights as stored, quantized ones
    dequantized into bf16 tiles (csrc/tile_pack.h, a prompt row's path); float32 sums of the bf16
    products, each row alone what it is in any batch (one row is a tile of its own; up to 32 rows
    stream BF16 weights, more pack them once, a panel of up to 8 groups at a time: 1104 outputs
    give whole panels, a short last one and a lone group, at one thread and two; K = 12288 panels
    of 2). Without AMX, BF16 runs on VDPBF16PS where the CPU has AVX512_BF16 (csrc/bf16_dot.cpp,
    the same numbers' bounds: under 12 rows it streams, from 12 packs panels of 4 to 16 groups);
    otherwise the request runs what it would without it: float32 activations for BF16, int8 for
    the quantized types, exactly."""
    m, n, k = shape
    rng = np.random.default_rng(m + n + k + wtype)
    q = random_blocks(wtype, n, k, rng)
    wd = dequantized(wtype, q).astype(np.float64)
    packed_type, packed = K.repack(lib, wtype, q)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    isa = max(ISAS)
    y = K.gemm(lib, packed_type, packed, x, k, isa, threads=2, bf16=True)
    dot = wtype == K.BF16 and lib.has_bf16_dot
    if not ((lib.has_amx_bf16 or dot) and isa == K.ISA_AVX512):
        assert np.array_equal(y, K.gemm(lib, packed_type, packed, x, k, isa, threads=2))
        return
    ref, plain = bf16_rounded(x) @ bf16_rounded(wd).T, x.astype(np.float64) @ wd.T
    scale = np.abs(plain).max()
    assert np.abs(y - ref).max() <= 1e-5 * scale  # float32 accumulation only
    assert 1e-5 * scale < np.abs(y - plain).max() <= 2e-2 * scale  # bf16 activations, not float32 ones
    rows = np.concatenate([K.gemm(lib, packed_type, packed, x[i : i + 1], k, isa, threads=1, bf16=True) for i in range(m)])
    assert np.array_equal(rows, y)
    assert np.array_equal(K.gemm(lib, packed_type, packed, x, k, isa, threads=1, bf16=True), y)
    if m > 32:
        head = K.gemm(lib, packed_type, packed, x[:32], k, isa, threads=2, bf16=True)  # BF16: one streaming pass
        assert np.array_equal(head, y[:32])


KQUANTS = [K.Q4_K, K.Q5_K, K.Q6_K]


@pytest.mark.parametrize("isa", ISAS)
def test_kquant_steps_of_8_rows_or_more_run_on_amx_int8_tiles(isa):
    """A batched decode step of 8+ int8 rows on a K-quant matrix runs on AMX-INT8 tiles of up to 16
    rows, of nearly equal rows (csrc/amx_int8.h): on the VNNI kernels its cost grew with every row
    (a 32-row step ~9x a 1-row one on the ~1B Qwen3). Fewer rows keep the VNNI tiles."""
    amx = isa == K.ISA_AVX512 and lib.has_amx_bf16
    for wtype in (K.Q4KX16, K.Q5KX16, K.Q6KX16):
        for fine in (False, True):
            assert max(K.gemm_tiles(lib, wtype, 7, isa, fine)) <= 8
            for m, want in ((8, [8]), (16, [16]), (20, [10, 10]), (32, [16, 16]), (33, [11, 11, 11])):
                tiles = K.gemm_tiles(lib, wtype, m, isa, fine)
                assert sum(tiles) == m
                if amx:
                    assert tiles == want, (K.TYPE_NAMES[wtype], fine, m, tiles)
                else:
                    assert max(tiles) <= 8, (K.TYPE_NAMES[wtype], fine, m, tiles)


@pytest.mark.parametrize("wtype", KQUANTS, ids=lambda t: K.TYPE_NAMES[t])
def test_kquant_steps_of_8_and_32_rows_keep_each_rows_bits(wtype):
    """The tile path gives each row the bits of the same row alone (1-row VNNI step) and of AVX2, and
    stays within the reference's tolerance: a batch does not change a greedy decode."""
    rng = np.random.default_rng(42 + wtype)
    n, k = 80, 768
    q = random_blocks(wtype, n, k, rng)
    wd = dequantized(wtype, q).astype(np.float64)
    packed_type, packed = K.repack(lib, wtype, q)
    x = rng.standard_normal((40, k)).astype(np.float32) * 3
    for fine in (False, True):
        ref = activations(x, fine) @ wd.T
        for isa in ISAS:
            alone = np.concatenate([K.gemm(lib, packed_type, packed, x[i : i + 1], k, isa, threads=1, fine=fine)
                                    for i in range(len(x))])
            for m in (8, 9, 17, 32, 40):
                y = K.gemm(lib, packed_type, packed, x[:m], k, isa, threads=2, fine=fine)
                assert np.array_equal(y, alone[:m]), (isa, fine, m)
                assert np.abs(y - ref[:m]).max() <= 1e-5 * np.abs(ref[:m]).max()


@pytest.mark.parametrize("wtype", [K.Q5_0, *KQUANTS], ids=lambda t: K.TYPE_NAMES[t])
def test_prompt_steps_keep_each_rows_bits_and_tiles(wtype):
    """Steps of more than 16 rows (a prompt) on AVX2 run some formats on groups unpacked once
    (csrc/kquant_unpacked.h), in tiles of up to 6 rows and a tail: each row keeps the bits of the
    same row alone (the decode tiles) and of AVX-512 VNNI, whatever its tile."""
    _steps_keep_each_rows_bits(wtype, 48, 512, (17, 19, 23, 31), seed=7)


def _steps_keep_each_rows_bits(wtype: int, n: int, k: int, steps: tuple[int, ...], seed: int) -> None:
    """Each step of m rows (int8 and fine, every ISA here, 2 threads) equals, row for row, the same
    rows run alone; the tiles the kernels report cover the step."""
    rng = np.random.default_rng(seed + wtype)
    packed_type, packed = K.repack(lib, wtype, random_blocks(wtype, n, k, rng))
    x = rng.standard_normal((max(steps), k)).astype(np.float32) * 3
    for fine in (False, True):
        alone = np.concatenate([K.gemm(lib, packed_type, packed, x[i : i + 1], k, ISAS[0], threads=1, fine=fine)
                                for i in range(len(x))])
        for isa in ISAS:
            for m in steps:
                tiles = K.gemm_tiles(lib, packed_type, m, isa, fine)
                assert sum(tiles) == m and max(tiles) <= 8, (isa, fine, m, tiles)
                y = K.gemm(lib, packed_type, packed, x[:m], k, isa, threads=2, fine=fine)
                assert np.array_equal(y, alone[:m]), (isa, fine, m)


@pytest.mark.parametrize("wtype", [K.Q5_0, K.Q4_K, K.Q6_K], ids=lambda t: K.TYPE_NAMES[t])
def test_prompt_steps_over_long_rows_keep_each_rows_bits(wtype):
    """AVX2 prompt steps unpack a group a slice of 64 blocks of K at a time (csrc/kquant_unpacked.h)
    and keep a row's float sums between slices: at K = 2560 (a slice and a 16-block one) each row
    of a 19-row step still has the bits of the same row alone, int8 and fine."""
    _steps_keep_each_rows_bits(wtype, 32, 2560, (19,), seed=11)
