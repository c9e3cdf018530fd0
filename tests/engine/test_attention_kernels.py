"""The paged attention kernels (csrc/attention.h, and csrc/attn_avx512.cpp on AVX-512 hosts) against
a float64 softmax, and the invariances the engine relies on: a row's bits do not depend on its tile,
nor on the ISA.

Why bit-for-bit invariance matters: a decode row is a tile of one, a prefill chunk's rows (and
speculation's verification rows) share a tile. If a row's output depended on its tile, greedy
speculation would not reproduce plain decoding, and a prompt's logits would depend on how the
scheduler chunked it. The AVX-512 kernel reads a lone row's float16 K/V straight from the pool and
widens a tile's once into a buffer: both must give the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.test_kv_fp8 import ISAS, attend, attend_numpy

native_only = pytest.mark.requires("f16c")

# (n_kv, rep, head_dim): SmolLM2 (3, 3, 64), Qwen3 1B (8, 2, 128), Gemma 3 270M (1, 4, 256), Qwen3
# MoE's 8 query heads per KV head, and rep 5/6/7, which split into groups of 4 and 3.
SHAPES = [(3, 3, 64), (8, 2, 128), (1, 4, 256), (2, 8, 64), (4, 5, 32), (2, 6, 48), (2, 7, 64), (1, 1, 16),
          (2, 3, 20)]
# (first position, rows, sliding window): decodes at block edges and deep, prefill tiles, windows,
# and tiles of 9-16 rows (speculation's verification rows of one sequence: one tile since
# paged::kTileRows is 16, where a 9-row step was a tile of 8 and a lone row).
TILES = [(0, 1, 0), (31, 1, 0), (32, 1, 0), (300, 1, 0), (100, 8, 0), (29, 3, 0), (200, 1, 50), (200, 8, 50),
         (100, 16, 0), (250, 9, 0), (200, 12, 50)]


def pool(rng: np.random.Generator, slots: int, n_kv: int, d: int, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    k, v = ((rng.standard_normal((slots, n_kv, d)) * 2).astype(dtype) for _ in "kv")
    return k, v


BS = 16  # the block size of tile_cases' pools


def tile_cases(shape: tuple[int, int, int], tiles: list[tuple[int, int, int]]):  # noqa: ANN201
    """For one (n_kv, rep, head_dim): a float32 and a float16 pool of 32 shuffled blocks, and for
    each (p0, rows, window) of `tiles` its queries: yields (kind, k, v, table, q, p0, rows, window),
    seeded by the shape, so each test sees the same values."""
    n_kv, rep, d = shape
    rng = np.random.default_rng(n_kv * 100 + rep * 10 + d)
    blocks = 32
    table = rng.permutation(blocks).astype(np.int32)
    for dtype in (np.float32, np.float16):
        k, v = pool(rng, blocks * BS, n_kv, d, dtype)
        for p0, rows, window in tiles:
            q = rng.standard_normal((rows, n_kv * rep, d)).astype(np.float32)
            yield np.dtype(dtype).name, k, v, table, q, p0, rows, window


@native_only
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_matches_a_float64_softmax_and_each_row_alone(shape, isa):
    rep, bs = shape[1], BS
    for kind, k, v, table, q, p0, rows, window in tile_cases(shape, TILES):
        got = attend(kind, k, v, q, table, p0, bs, rep, window, isa)
        want = attend_numpy(k.astype(np.float32), v.astype(np.float32), q, table, p0, bs, rep, window)
        np.testing.assert_allclose(got, want, atol=3e-5, err_msg=f"{kind} p0={p0} rows={rows} w={window}")
        for r in range(rows):  # a row alone (a decode) gives the bits it got in the tile
            alone = attend(kind, k, v, q[r:r + 1], table, p0 + r, bs, rep, window, isa)
            assert np.array_equal(alone[0], got[r]), (kind, p0, rows, window, r)
        # and every ISA gives the AVX2 kernel's bits (a model computes the same on any host)
        assert np.array_equal(got, attend(kind, k, v, q, table, p0, bs, rep, window, ISAS[0])), (kind, p0, rows)


@native_only
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 6])
def test_a_float16_pool_is_the_float32_pool_of_its_values(isa, rows):
    """Widening float16 is exact, so reading the half pool (in place for a lone row, through the
    buffer for a tile) must give the float32 pool's bits."""
    rng = np.random.default_rng(rows)
    n_kv, rep, d, bs = 3, 3, 64, 16
    table = rng.permutation(24).astype(np.int32)
    k, v = pool(rng, 24 * bs, n_kv, d, np.float16)
    q = rng.standard_normal((rows, n_kv * rep, d)).astype(np.float32)
    for p0 in (0, 17, 250, 24 * bs - rows):
        half = attend("float16", k, v, q, table, p0, bs, rep, 0, isa)
        full = attend("float32", k.astype(np.float32), v.astype(np.float32), q, table, p0, bs, rep, 0, isa)
        assert np.array_equal(half, full), p0
