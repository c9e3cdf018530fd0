// What the two attention kernels share: a tile of rows (attention.h, the AVX2 kernel forward.cpp
// compiles, and attn_avx512.cpp), its key blocks and the per-thread scratch it needs. No ISA code
// here, so both targets include it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tp {
namespace paged {

// Rows per item: a tile's rows (x 3 query heads on SmolLM2) share each K/V row read and widened.
// 16, not 8: speculation verifies 1 + K rows of one sequence in a step, and with the doubling
// draft lengths (1, 2, 4, 8, 16) a 9-row step ran as a tile of 8 and a lone row that streamed the
// whole context's K/V again (1.6-1.8 ms of a ~30 ms step on one thread, perf, SmolLM2 at context
// 400: as much as 2-3 more rows in a tile; benchmarks/results/step_rows_verify.md). A row's sums
// do not depend on its tile (walk_tile), so the bits do not change.
constexpr int kTileRows = 16;
constexpr int kKeyBlock = 32;  // keys per block: K + V of a block (16 KiB at head_dim 64) fit in L1
// Rows per tile of prompt rows on AMX tiles (attn_amx.cpp): 16 rows x 3 query heads fill three
// 16-query A tiles, so the block's K and V tiles are built once for 48 queries.
constexpr int kPromptTileRows = 16;

// Floats of per-thread scratch an item needs (widened K/V block of up to `width` features per key,
// running max and sum per query of up to `queries` per row).
inline size_t scratch_floats(int width, int queries) {
    return size_t(2) * kKeyBlock * width + size_t(2) * kTileRows * queries;
}

// One tile: rows r = 0..nrows-1 at positions p0 + r (row r sees keys 0..p0 + r, or with a sliding
// window the last `window` of them: p0 + r - window + 1 .. p0 + r); q0 and o0 point at the first
// query head of the item's first KV head in row 0 (row r at + r * q_stride / o_stride).
struct Tile {
    const float* q0;
    float* o0;
    int q_stride, o_stride, nrows, p0;
    const int32_t* table;  // the sequence's block table
    int window = 0;        // 0: full causal attention

    // The first key row r sees (keys before the first row's are read by no row of the tile).
    int key_lo(int r) const { return window > 0 && p0 + r + 1 > window ? p0 + r + 1 - window : 0; }
};

}  // namespace paged
}  // namespace tp
