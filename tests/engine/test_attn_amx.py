"""Prompt rows' attention on AMX tiles (csrc/attn_amx.cpp): bf16 queries, keys, values and softmax
weights with float32 sums, as vLLM and transformers compute a bf16 checkpoint's prefill.

Checked against a float64 softmax over the same bf16-rounded queries, keys and values (what is left
is the weights' rounding to bf16 and float32 sums), with sliding windows, block edges and every
head shape the engine runs with a head_dim that is a multiple of 32. And the invariance prefix
caching and chunked prefill rely on: a prompt row gives the same bits alone as in any tile (its
keys are read in the same 32-key blocks, its sums run in the same order).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.test_attention_kernels import BS, tile_cases
from tests.engine.test_kv_fp8 import attend, attend_numpy, lib

AMX = 3  # tp_attend_tile_test's isa for the tile kernel
pytestmark = pytest.mark.requires("avx512_object")


def tiles_here() -> bool:
    """Whether this CPU and process run AMX-BF16 tiles (elsewhere the entry point writes nothing)."""
    return lib.has_amx_bf16 and 2 in lib.available_isas()


# (n_kv, rep, head_dim): SmolLM2, Qwen3 1B, Gemma 3 270M, 8 query heads per KV head, head_dim 32.
SHAPES = [(3, 3, 64), (8, 2, 128), (1, 4, 256), (2, 8, 64), (4, 5, 32)]
# (first position, rows, sliding window): a whole 16-row tile, short tiles across a block edge, a
# first chunk from position 0, deep positions, windows that cut blocks.
TILES = [(0, 16, 0), (0, 1, 0), (29, 7, 0), (100, 16, 0), (300, 5, 0), (200, 16, 50), (33, 16, 20)]


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 (ties to even), as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prompt_tiles_match_a_float64_softmax_of_the_bf16_values(shape):
    rep, bs = shape[1], BS
    for kind, k, v, table, q, p0, rows, window in tile_cases(shape, TILES):
        got = attend(kind, k, v, q, table, p0, bs, rep, window, AMX)
        if not tiles_here():  # (no tiles: nothing computed, and the engine never asks)
            assert not got.any()
            continue
        want = attend_numpy(bf16(k.astype(np.float32)), bf16(v.astype(np.float32)), bf16(q), table, p0, bs, rep,
                            window)
        # the weights' bf16 rounding: ~2^-9 relative per weight, on outputs of magnitude ~2
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-2, err_msg=f"{kind} p0={p0} rows={rows} w={window}")
        assert np.abs(got - want).mean() < 3e-3, (kind, p0, rows, window)
        for r in range(rows):  # a row alone gives the bits it got in the tile
            alone = attend(kind, k, v, q[r:r + 1], table, p0 + r, bs, rep, window, AMX)
            assert np.array_equal(alone[0], got[r]), (kind, p0, rows, window, r)


def test_more_rows_than_a_prompt_tile_or_an_odd_head_dim_are_not_computed():
    """The entry point writes nothing it cannot compute (the engine never asks: forward.cpp's tiles
    stop at 16 rows, and kernels/model.py turns the tiles off for such a head_dim)."""
    rng = np.random.default_rng(0)
    table = np.arange(4, dtype=np.int32)
    for rows, d in ((17, 64), (4, 48)):
        k, v = (rng.standard_normal((64, 1, d)).astype(np.float32) for _ in "kv")
        q = rng.standard_normal((rows, 1, d)).astype(np.float32)
        assert not attend("float32", k, v, q, table, 0, 16, 1, 0, AMX).any()
