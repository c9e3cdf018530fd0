"""The native quantized GEMV/GEMM kernels against a float64 reference, on every ISA this CPU has.

Two references per case: the exact one (the activations quantized to int8 per 32-block the way
the kernels do it, then everything in float64) bounds the kernels' own arithmetic; the plain one
(float64 x @ dequantized W) bounds what the int8 activations cost. Weight dequantization comes
from the `gguf` package, so the block layouts are checked against an independent reader.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from tests.engine.test_kquant_kernels import bf16_rounded
from tokenpath.engine import kernels as K

lib = K.native_library()
pytestmark = pytest.mark.requires("kernels")

ISAS = [] if lib is None else lib.available_isas()
TYPES = [K.Q4_0, K.Q4_1, K.Q8_0]
SHAPES = [(1, 37, 64), (3, 65, 100), (17, 130, 576), (64, 33, 1536), (1, 16, 33)]  # (M, N, K)


def ref_weights(wtype: int, q: np.ndarray, k: int) -> np.ndarray:
    w = gguf_dequantize(q, GGMLQuantizationType(wtype))
    return w.reshape(q.shape[0], -1)[:, :k].astype(np.float64)


def _int8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x's 32-blocks (zero-padded), their q = round(x * 127 / max|x|) and d = max|x| / 127, as
    the kernels quantize an activation row."""
    m, k = x.shape
    xp = np.zeros((m, -(-k // 32) * 32), dtype=np.float32)
    xp[:, :k] = x
    blocks = xp.reshape(m, -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    q = np.rint(blocks * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32))
    return blocks, q, (amax / np.float32(127)).astype(np.float32)


def quantized_activations(x: np.ndarray) -> np.ndarray:
    """x as the kernels see it: per 32-block d = max|x| / 127, q = round(x * 127 / max|x|)."""
    m, k = x.shape
    _, q, d = _int8_blocks(x)
    return (q.astype(np.float64) * d).reshape(m, -1)[:, :k]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", TYPES, ids=lambda t: K.TYPE_NAMES[t])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemm_matches_float64(isa, wtype, shape):
    m, n, k = shape
    rng = np.random.default_rng(m * 1000 + n + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    q = K.quantize(lib, wtype, w)
    wd = ref_weights(wtype, q, k)
    y = K.gemm(lib, wtype, q, x, k, isa, threads=2)
    exact = quantized_activations(x) @ wd.T
    plain = x.astype(np.float64) @ wd.T
    scale = np.abs(plain).max()
    assert np.abs(y - exact).max() <= 1e-5 * scale  # float32 accumulation only
    assert np.abs(y - plain).max() <= 0.03 * scale  # int8 activations: ~0.5% typical
    y_exact = K.gemm(lib, wtype, q, x, k, isa, threads=2, exact=True)  # float activations
    assert np.abs(y_exact - plain).max() <= 1e-5 * scale
    y_fine = K.gemm(lib, wtype, q, x, k, isa, threads=2, fine=True)  # int8 + residual bytes: ~15 bits
    assert np.abs(y_fine - plain).max() <= 2e-4 * scale  # measured ~3e-5; int8 alone ~7e-3
    # The weights' own rounding: within a block's step (Q4: range / 15 or max / 8, Q8: max / 127).
    step = {K.Q4_0: 1 / 8, K.Q4_1: 1 / 15, K.Q8_0: 1 / 127}[wtype]
    assert np.abs(wd - w).max() <= step * np.abs(w).max() * 1.01 + 1e-3


PACKED_SHAPES = [(1, 48, 64), (3, 64, 100), (17, 144, 576), (64, 32, 1536), (9, 16, 33)]  # N % 16 == 0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", TYPES, ids=lambda t: K.TYPE_NAMES[t])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=str)
def test_repacked_gemm_matches_float64(isa, wtype, shape):
    """The 16-row interleaved layout holds the same weights (dequantized row by row, bit for bit) and
    its kernel meets the same float64 bounds, for every M tile size (8, 4, 2, 1) and K tail."""
    m, n, k = shape
    rng = np.random.default_rng(m * 1000 + n + k + 7)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    q = K.quantize(lib, wtype, w)
    packed_type, packed = K.repack(lib, wtype, q)
    assert packed_type == (K.Q8X16 if wtype == K.Q8_0 else K.Q4X16)
    assert packed.nbytes == n * -(-k // 32) * K.GROUP_BLOCK_BYTES[packed_type] // K.GROUP_ROWS
    assert np.array_equal(K.dequantize_packed(lib, packed_type, packed, k), K.dequantize(lib, wtype, q, k))
    wd = ref_weights(wtype, q, k)
    y = K.gemm(lib, packed_type, packed, x, k, isa, threads=2)
    exact = quantized_activations(x) @ wd.T
    plain = x.astype(np.float64) @ wd.T
    assert np.abs(y - exact).max() <= 1e-5 * np.abs(plain).max()
    y_fine = K.gemm(lib, packed_type, packed, x, k, isa, threads=2, fine=True)
    assert np.abs(y_fine - plain).max() <= 2e-4 * np.abs(plain).max()
    # The same arithmetic as the GGUF-layout kernel: exact integer block dots, so equal to rounding.
    y_rows = K.gemm(lib, wtype, q, x, k, isa, threads=2, fine=True)
    assert np.abs(y_fine - y_rows).max() <= 1e-5 * np.abs(plain).max()
    # A prompt row's tiles (AMX-BF16 where the CPU has them, csrc/tile_pack.h): bf16 activations
    # against the weights rounded to bf16, float32 sums; elsewhere the int8 kernel's numbers exactly.
    y_tiles = K.gemm(lib, packed_type, packed, x, k, isa, threads=2, bf16=True)
    if lib.has_amx_bf16 and isa == K.ISA_AVX512:
        xb = bf16_rounded(np.pad(x, ((0, 0), (0, -k % 32))))[:, :k]
        assert np.abs(y_tiles - xb @ bf16_rounded(wd).T).max() <= 1e-5 * np.abs(plain).max()
    else:
        assert np.array_equal(y_tiles, y)


def test_repack_keeps_the_gguf_layout_when_rows_are_not_a_multiple_of_16():
    q = K.quantize(lib, K.Q4_1, np.ones((24, 64), dtype=np.float32))
    wtype, same = K.repack(lib, K.Q4_1, q)
    assert wtype == K.Q4_1 and np.array_equal(same, q)


def test_repacked_rows_are_batch_invariant_and_isas_agree():
    """Each row's result is the same whichever tile it falls in, and AVX2 and AVX-512 VNNI give the
    same bits (exact integer dots, the same float order; Q8X16's VNNI offset is undone in integers)."""
    rng = np.random.default_rng(3)
    for wtype in TYPES:
        packed_type, w = K.repack(lib, wtype, K.quantize(lib, wtype, rng.standard_normal((48, 96)).astype(np.float32)))
        x = rng.standard_normal((15, 96)).astype(np.float32)
        for fine in (False, True):
            results = []
            for isa in ISAS:
                whole = K.gemm(lib, packed_type, w, x, 96, isa, threads=2, fine=fine)
                alone = np.concatenate([K.gemm(lib, packed_type, w, x[i : i + 1], 96, isa, threads=1, fine=fine)
                                        for i in range(15)])
                assert np.array_equal(whole, alone)
                results.append(whole)
            assert all(np.array_equal(results[0], r) for r in results[1:])


def fine_activations(x: np.ndarray) -> np.ndarray:
    """x as the kernels see it with residual bytes (QAct::q2): q as in quantized_activations, then
    the rest x - q d re-quantized at d / 254, clamped to int8; values (254 q + q2) * d / 254."""
    m, k = x.shape
    blocks, q, d = _int8_blocks(x)
    rest = (blocks.astype(np.float64) - q * d.astype(np.float64)).astype(np.float32)
    inv2 = np.where(d > 0, np.float32(254) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q2 = np.clip(np.rint(rest * inv2), -127, 127)
    return ((254 * q + q2) * (d.astype(np.float64) / 254)).reshape(m, -1)[:, :k]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", [K.Q4_1, K.Q8_0], ids=lambda t: K.TYPE_NAMES[t])
def test_small_m_rows_equal_single_rows_and_the_dequantized_reference(isa, wtype):
    """A verification step's M = 2..17 rows (every tile size: one tile of up to 8 rows on VNNI, two of
    nearly equal rows, tiles of 4 then the rest) give each row exactly what a 1-row decode step gives it, on int8 and fine activations (AVX2's Q8X16 fine kernel takes
    int16 activations, QAct::q16: the same integer sums by another route), and match the weights
    dequantized row by row times the activations as the kernels quantize them."""
    rng = np.random.default_rng(39)
    for k in (100, 576):
        w = rng.standard_normal((48, k)).astype(np.float32)
        q = K.quantize(lib, wtype, w)
        packed_type, packed = K.repack(lib, wtype, q)
        wd = K.dequantize_packed(lib, packed_type, packed, k).astype(np.float64)
        x = rng.standard_normal((17, k)).astype(np.float32) * 3
        for fine in (False, True):
            alone = np.concatenate([K.gemm(lib, packed_type, packed, x[i : i + 1], k, isa, threads=1, fine=fine)
                                    for i in range(17)])
            ref = (fine_activations(x) if fine else quantized_activations(x)) @ wd.T
            assert np.abs(alone - ref).max() <= 1e-5 * np.abs(ref).max()
            for m in range(2, 18):
                rows = K.gemm(lib, packed_type, packed, x[:m], k, isa, threads=2, fine=fine)
                assert np.array_equal(rows, alone[:m]), (k, fine, m)


@pytest.mark.parametrize("isa", ISAS)
def test_few_row_steps_run_in_few_tiles_of_nearly_equal_rows(isa):
    """A step of a few rows (speculation's verification: 1 + K rows) runs each 16-row weight group in
    as few tiles as the registers hold (up to 8 rows for Q4X16 and Q8X16 on AVX-512 VNNI, 4 on AVX2),
    of nearly equal rows: no tile re-reads the weights for a 1-row tail that waits on its lone chains
    (the old tiles of 4, 2, 1 ran 5 rows as 4 + 1 and 9 as 4 + 4 + 1). Prefill sizes keep their tiles."""
    vnni = isa == K.ISA_AVX512
    for wtype in (K.Q4X16, K.Q8X16):
        for fine in (False, True):
            cap = 8 if vnni else 4
            for m in range(1, 2 * cap + 1):
                tiles = K.gemm_tiles(lib, wtype, m, isa, fine)
                assert sum(tiles) == m and len(tiles) == -(-m // cap), (K.TYPE_NAMES[wtype], fine, m, tiles)
                assert max(tiles) - min(tiles) <= 1, (K.TYPE_NAMES[wtype], fine, m, tiles)
            mr = 8 if vnni and not fine else 4  # prefill: the tile measured best, until 2 cap rows are left
            tiles = K.gemm_tiles(lib, wtype, 128, isa, fine)
            assert sum(tiles) == 128 and tiles[: (128 - 2 * cap) // mr] == [mr] * ((128 - 2 * cap) // mr)
    assert K.gemm_tiles(lib, K.Q4_1, 5, isa) == []  # GGUF rows: not repacked


def test_rows_are_batch_invariant():
    """A row's result does not depend on which other rows share the call (greedy decoding relies on it)."""
    rng = np.random.default_rng(1)
    w = K.quantize(lib, K.Q4_1, rng.standard_normal((70, 96)).astype(np.float32))
    x = rng.standard_normal((9, 96)).astype(np.float32)
    for isa in ISAS:
        whole = K.gemm(lib, K.Q4_1, w, x, 96, isa, threads=2)
        alone = np.concatenate([K.gemm(lib, K.Q4_1, w, x[i : i + 1], 96, isa, threads=1) for i in range(9)])
        assert np.array_equal(whole, alone)


@pytest.fixture(scope="module")
def smol_gguf(smol_loaded):
    return smol_loaded.gguf


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["layers.0.down_proj.weight", "layers.5.q_proj.weight", "embed.weight"])
def test_real_weights(smol_gguf, isa, name):
    raw = smol_gguf.raw(name)
    rows = np.ascontiguousarray(raw.data[:300])
    wd = smol_gguf.dequantized(name)[:300].astype(np.float64)
    x = np.random.default_rng(2).standard_normal((3, raw.cols)).astype(np.float32)
    exact = quantized_activations(x) @ wd.T
    for wtype, w in ((raw.ggml_type, rows), K.repack(lib, raw.ggml_type, rows)):
        y = K.gemm(lib, wtype, w, x, raw.cols, isa, threads=2)
        assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()


def test_isa_forced_by_environment(monkeypatch):
    monkeypatch.setenv("TOKENPATH_KERNELS_ISA", "avx2")
    assert lib.isa() == K.ISA_AVX2
    monkeypatch.setenv("TOKENPATH_KERNELS_ISA", "auto")
    assert lib.isa() == (K.ISA_AVX512 if lib.features & 2 else K.ISA_AVX2)


def test_switched_off_by_environment(monkeypatch, caplog):
    monkeypatch.setenv("TOKENPATH_NO_KERNELS", "1")
    K.native_library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="tokenpath.engine.kernels"):
            assert K.native_library() is None
        assert "TOKENPATH_NO_KERNELS" in caplog.text
    finally:
        monkeypatch.delenv("TOKENPATH_NO_KERNELS")
        K.native_library.cache_clear()


def test_activation_masks_from_environment(monkeypatch):
    from tokenpath.engine.kernels.precision import DEFAULT_FINE, exact_mask, fine_mask

    monkeypatch.delenv("TOKENPATH_KERNELS_FINE", raising=False)
    assert fine_mask() == DEFAULT_FINE == 0b11111
    for value, mask in (("0", 0), ("all", 0b11111), ("0x8", 8), ("0x3f", 0b11111)):
        monkeypatch.setenv("TOKENPATH_KERNELS_FINE", value)
        assert fine_mask() == mask
    monkeypatch.setenv("TOKENPATH_KERNELS_EXACT", "down")
    with pytest.raises(ValueError, match="TOKENPATH_KERNELS_EXACT='down'"):
        exact_mask()


def _guided(groups: int, floor: int, threads: int) -> list[int]:
    """Claims (in groups) of 1/threads of what is left, none under `floor` (the last: what remains)."""
    done, claims = 0, []
    while done < groups:
        claims.append(min(groups - done, max(floor, (groups - done) // threads)))
        done += claims[-1]
    return claims


def test_decode_chunks_cover_the_matrix_in_at_most_96_claims():
    """A decode GEMM's claims (csrc/step_acts.h decode_chunks): 1/threads of what is left, down to
    32 KiB of weights, in order, ending on 16-row groups, and never more than the 96-slot table
    holds: where that rule would need more (many threads on a large matrix), no claim is under 1/96
    of the matrix instead. That branch runs here at 64 and 256 threads; the engine's steps run 2."""
    q4, q8, bf = K.Q4X16, K.Q8X16, K.BF16X16
    # SmolLM2's tied head (Q8X16, 49152 x 576: 10368 bytes a group) at 2 threads: 11 claims, the
    # first half the matrix, the last two 3 groups (30 KiB).
    head = K.decode_chunks(lib, [(q8, 49152)], 49152, 576, 2)
    assert len(head) == 11 and head[0] == 24576 and head[-1] - head[-2] == head[-2] - head[-3] == 48
    floored = 0
    for parts, k in (([(q8, 49152)], 576), ([(q4, 300000)], 2048), ([(bf, 4096)], 9216), ([(q4, 24), (q8, 40)], 64),
                     ([(q4, 2048), (q8, 512), (q8, 512)], 2048), ([(bf, 16)], 32)):
        n = sum(rows for _, rows in parts)
        groups, nb = -(-n // 16), -(-k // 32)
        per_group = max(sum(rows * nb * K.GROUP_BLOCK_BYTES[t] // 16 for t, rows in parts) // groups, 1)
        tail = min(max(32768 // per_group, 1), groups)
        for threads in (1, 2, 3, 8, 64, 256):
            ends = K.decode_chunks(lib, parts, n, k, threads)
            assert ends[-1] == n and all(e % 16 == 0 for e in ends[:-1]), (parts, threads)
            want = _guided(groups, tail, threads)
            if len(want) > 96:  # the table's bound: every claim at least 1/96 of the matrix
                floored += 1
                want = _guided(groups, max(tail, -(-groups // 96)), threads)
            assert len(want) <= 96
            assert ends == [min(16 * sum(want[: i + 1]), n) for i in range(len(want))], (parts, threads)
    assert floored >= 2
