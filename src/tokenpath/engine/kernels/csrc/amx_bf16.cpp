// AMX-BF16 GEMM for BF16X16 weights (issue 42): a bf16 checkpoint's linears on tiles, as vLLM CPU
// and transformers compute that checkpoint (bf16 activations, bf16 weights, float32 sums).
//
// Why: on a CPU with AMX (Intel Sapphire Rapids and later), one TDPBF16PS does 16 x 16 x 32
// multiply-adds. The BF16X16 FMA kernels (kquant_impl.h float_tile) widen the weights to float32
// and run one FMA per weight and row: 121.6 GFLOP/s against 989.6 for a plain tile loop at
// SmolLM2's gate/up shape, one thread (benchmarks/probes/amx_probe.py). Prefill and batched decode
// of a bf16 checkpoint are bound by that arithmetic, not by reading the weights.
//
// Layout: BF16X16 keeps, per 16-row group and 32-weight block, weight e of row i at byte
// 32 e + 2 i (a 32 x 16 [k][n] bf16 matrix). A B tile wants k-pairs side by side: tile row r holds
// (k = 2r, k = 2r + 1) of each of the 16 columns. One vpermw per 64 bytes turns one into the
// other; a group's tiles are built once per call into a per-thread scratch and reused by every
// 16-row tile of activations, so the repacked weights stay the one copy and the FMA kernels keep
// reading them (rows whose matmul runs float32 activations, and CPUs without AMX).
//
// Rows: every row of a matmul that takes bf16 activations runs here, whatever M is (one row is a
// tile with 15 unused rows), and each output's sum runs over K in the same order whatever else
// shares the step: a row's result does not depend on the batch. Activation rows past M up to the
// next multiple of 16 are read and their outputs dropped: callers allocate them (forward.cpp
// make_act). Callers check tp::amx_permitted() first (quant.cpp): without it a tile instruction
// is a SIGILL.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")
#include <immintrin.h>
#include <algorithm>
#include <vector>

#include "amx_tiles.h"
#include "pair_pack.h"  // pack_pairs: B tiles from BF16X16 blocks
#include "tp_kernels.h"

namespace tp::amx {
namespace {


// C tiles 0..3 = (m-tile i, group j) at 2 i + j; A tiles 4, 5; B tiles 6, 7. NM m-tiles (1 or 2)
// by NG groups (1 or 2), K in blocks of 32. B: the groups' packed tiles (b0, b1), or with STREAM
// their BF16X16 blocks (w0, w1), packed a block at a time into `ring` just before use: one pass
// of rows (M <= 32) reuses no tile, and the weights stream from memory beside the multiplies.
template <int NM, int NG, bool STREAM>
void tiles(const uint16_t* x, size_t lda, const uint16_t* b0, const uint16_t* b1, const uint8_t* w0,
           const uint8_t* w1, int nb, uint16_t* ring) {
    _tile_zero(0);
    if (NG == 2) _tile_zero(1);
    if (NM == 2) _tile_zero(2);
    if (NM == 2 && NG == 2) _tile_zero(3);
    for (int b = 0; b < nb; ++b) {
        const uint16_t *t0 = b0 + 512 * size_t(b), *t1 = b1 + 512 * size_t(b);
        if constexpr (STREAM) {
            t0 = ring + 1024 * (b & 1), t1 = t0 + 512;
            if (b + 4 < nb)  // from memory: ask for the block 4 ahead (the pack's loads wait on it)
                for (int l = 0; l < 1024; l += 64) {
                    _mm_prefetch(reinterpret_cast<const char*>(w0 + 1024 * size_t(b + 4) + l), _MM_HINT_T0);
                    if (NG == 2) _mm_prefetch(reinterpret_cast<const char*>(w1 + 1024 * size_t(b + 4) + l), _MM_HINT_T0);
                }
            pack_pairs(w0 + 1024 * size_t(b), 1, ring + 1024 * (b & 1));
            if (NG == 2) pack_pairs(w1 + 1024 * size_t(b), 1, ring + 1024 * (b & 1) + 512);
        }
        _tile_loadd(4, x + 32 * b, lda);
        _tile_loadd(6, t0, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (NG == 2) {
            _tile_loadd(7, t1, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (NM == 2) {
            _tile_loadd(5, x + 16 * (lda / 2) + 32 * b, lda);
            _tile_dpbf16ps(2, 5, 6);
            if (NG == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

template <bool STREAM>
void tiles_any(int nm, int ng, const uint16_t* x, size_t lda, const uint16_t* b0, const uint16_t* b1,
               const uint8_t* w0, const uint8_t* w1, int nb, uint16_t* ring) {
    if (nm == 2 && ng == 2) tiles<2, 2, STREAM>(x, lda, b0, b1, w0, w1, nb, ring);
    else if (nm == 2) tiles<2, 1, STREAM>(x, lda, b0, b1, w0, w1, nb, ring);
    else if (ng == 2) tiles<1, 2, STREAM>(x, lda, b0, b1, w0, w1, nb, ring);
    else tiles<1, 1, STREAM>(x, lda, b0, b1, w0, w1, nb, ring);
}

// Groups per panel (even, 2 to 8): their B tiles (nb KiB each) take at most ~768 KiB of the
// core's L2 beside a 32-row block of activations (64 nb bytes a row): 8 groups at K = 2048,
// 4 at K = 6144.
inline int panel_groups(int nb) {
    const int fit = int((size_t(768) << 10) / (size_t(nb) << 10));
    return std::max(2, std::min(8, fit & ~1));
}

// The C tiles of m-tiles (m0, nm) x groups (g, ng) into y, adding the bias and what y holds
// where asked.
inline void store_tiles(float (*c)[256], float* y, int ldy, int M, int m0, int nm, int g, int ng, const float* bias,
                        bool accumulate) {
    // Whole tiles of rows with nothing to add: straight into y (the same values: the epilogue
    // below adds zero).
    if (!bias && !accumulate && (m0 + 16 * nm <= M || M < 16)) {
        float* yb = y + size_t(m0) * ldy + 16 * g;
        const size_t stride = size_t(ldy) * 4;
        _tile_stored(0, yb, stride);
        if (ng == 2) _tile_stored(1, yb + 16, stride);
        if (nm == 2) _tile_stored(2, yb + size_t(16) * ldy, stride);
        if (nm == 2 && ng == 2) _tile_stored(3, yb + size_t(16) * ldy + 16, stride);
        return;
    }
    _tile_stored(0, c[0], 64);
    if (ng == 2) _tile_stored(1, c[1], 64);
    if (nm == 2) _tile_stored(2, c[2], 64);
    if (nm == 2 && ng == 2) _tile_stored(3, c[3], 64);
    for (int i = 0; i < nm; ++i)
        for (int j = 0; j < ng; ++j) {
            const int n = 16 * (g + j);
            const __m512 vb = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
            for (int r = 0; r < 16 && m0 + 16 * i + r < M; ++r) {
                float* dst = y + size_t(m0 + 16 * i + r) * ldy + n;
                __m512 v = _mm512_add_ps(_mm512_load_ps(c[2 * i + j] + 16 * r), vb);
                if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(dst));
                _mm512_storeu_ps(dst, v);
            }
        }
}

}  // namespace

void gemm_tiles(PackFn pack, size_t group_bytes, const uint8_t* w, int nb, const uint16_t* x, int M, float* y,
                int ldy, int n0, int n1, const float* bias, bool accumulate) {
    // Fewer than 16 rows (decode): C and A tiles of M rows, so that neither loads nor multiplies
    // the rows that would be dropped.
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = uint8_t(t < 6 && M < 16 ? M : 16), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    const bool stream = !pack && M <= 32;  // BF16X16 only: a quantized group is dequantized whole
    // More than one pass of rows: the B tiles of a panel of groups are built once into a
    // per-thread scratch (grown once and kept: no allocation per call), and every 32-row block
    // of activations passes over the whole panel before the next block is read, so that block
    // (32 rows x K, 128 KiB at K = 2048) is read from memory once per panel and from L2 for
    // the panel's other pairs of groups. Group by group (a panel of 2), each block was read
    // again for every 32 outputs: a 1024-row prompt's activations (4 MiB at K = 2048) do not
    // stay in L2, so the tiles waited on the activations. Each output's sum still runs over K
    // in the same order: the results are the same bits.
    const int panel = stream ? 2 : panel_groups(nb);
    thread_local std::vector<uint16_t> scratch;
    const size_t per_group = stream ? 1024 : size_t(nb) * 512;
    if (scratch.size() < panel * per_group + 32) scratch.resize(panel * per_group + 32);  // + 64 bytes to align
    uint16_t* base = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
    const size_t lda = size_t(nb) * 64;  // bytes per activation row
    alignas(64) float c[4][256];
    const int g0 = n0 / 16, g1 = n1 / 16;
    for (int gp = g0; gp < g1; gp += panel) {
        const int gn = std::min(panel, g1 - gp);
        if (!stream)
            for (int j = 0; j < gn; ++j) {
                const uint8_t* wg = w + size_t(gp + j) * group_bytes;
                pack ? pack(wg, nb, base + j * per_group) : pack_pairs(wg, size_t(nb), base + j * per_group);
            }
        for (int m0 = 0; m0 < M; m0 += 32) {
            const int nm = M - m0 > 16 ? 2 : 1;
            const uint16_t* xa = x + size_t(m0) * nb * 32;
            for (int g = gp; g < gp + gn; g += 2) {
                const int ng = gp + gn - g >= 2 ? 2 : 1;
                const uint8_t *w0 = w + size_t(g) * group_bytes, *w1 = w + size_t(g + ng - 1) * group_bytes;
                const uint16_t* b0 = base + (g - gp) * per_group;
                if (stream) tiles_any<true>(nm, ng, xa, lda, b0, b0 + per_group, w0, w1, nb, base);
                else tiles_any<false>(nm, ng, xa, lda, b0, b0 + per_group, w0, w1, nb, base);
                store_tiles(c, y, ldy, M, m0, nm, g, ng, bias, accumulate);
            }
        }
    }
    _tile_release();
}

}  // namespace tp::amx
