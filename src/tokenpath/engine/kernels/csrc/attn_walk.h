// The walk over one attention item (a tile of rows, KV heads g0 .. g1-1) that both kernels share
// (attention.h, attn_avx512.cpp): key blocks, block tables, sliding windows, prefetch, the rows each
// block serves, and the final normalization. What differs per kernel comes in as `widen` (a cache
// row -> the S rows the kernel reads: floats widened into scratch, or the pool's own rows) and
// `heads` (one row's query heads of one KV head against one block's n keys).
//
// `static inline` (vec_math.h says why): each kernel's file compiles it under its own target.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstring>

#include "attn_tile.h"
#include "kv_fp8.h"

namespace tp::paged {

// Keys ahead of the one being read whose K and V rows are prefetched. Why: a sequence's keys
// lie in blocks scattered over the pool, a few KiB each, too short for the hardware prefetcher to
// ramp up in; decode at c=32 spent most of its attention time waiting on these loads.
constexpr int kPrefetchKeys = 8;

template <class KV>
static inline void prefetch_row(const KV* row, int n) {
    const char* p = reinterpret_cast<const char*>(row);
    const size_t bytes = size_t(n) / KvPer<KV> * sizeof(KV);
    for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

template <class S, class KV, class Widen, class Heads>
static inline void walk_tile(const KV* k_cache, const KV* v_cache, const Tile& tile, int bs, int kv_width, int g0,
                             int g1, int D, int rep, float scale, float* scratch, Widen&& widen, Heads&& heads) {
    const int span = (g1 - g0) * D, qpr = (g1 - g0) * rep;  // features per key read, queries per row
    const int nqry = tile.nrows * qpr;
    float* kbuf = scratch;                             // [kKeyBlock][span] widened K (float16, fp8)
    float* vbuf = kbuf + size_t(kKeyBlock) * span;     // [kKeyBlock][span] widened V (float16, fp8)
    float* run_max = vbuf + size_t(kKeyBlock) * span;  // [nqry] running max of the scaled scores (log2 units)
    float* run_sum = run_max + nqry;                   // [nqry] running sum of 2^(score - max)
    for (int i = 0; i < nqry; ++i) run_max[i] = -INFINITY, run_sum[i] = 0.f;
    for (int r = 0; r < tile.nrows; ++r) std::memset(tile.o0 + size_t(r) * tile.o_stride, 0, sizeof(float) * qpr * D);
    const float sl2e = scale * 1.44269504f;  // scores in log2 units: exp(s * scale) = 2^(s * sl2e)
    const int ctx_end = tile.p0 + tile.nrows;  // the last row's context length
    const S* kbase[kKeyBlock];
    const S* vbase[kKeyBlock];
    const S* krow[kKeyBlock + 8];  // + padding lanes past a window's skipped keys
    const S* vrow[kKeyBlock + 8];
    const size_t first = size_t(g0) * D;
    // Key blocks stay aligned to multiples of kKeyBlock whatever the tile, so a row sums its keys
    // in the same blocks in any batch (batch invariance).
    for (int j0 = tile.key_lo(0) / kKeyBlock * kKeyBlock; j0 < ctx_end; j0 += kKeyBlock) {
        const int nk = ctx_end - j0 < kKeyBlock ? ctx_end - j0 : kKeyBlock;
        int page = j0 / bs, in_page = j0 % bs;
        for (int i = 0; i < nk; ++i) {
            const int ahead = j0 + i + kPrefetchKeys;  // a later key's rows, which may be on another page
            if (ahead < ctx_end) {
                const size_t aoff = (size_t(tile.table[ahead / bs]) * bs + ahead % bs) * kv_width + first;
                prefetch_row(kv_at(k_cache, aoff), span);
                prefetch_row(kv_at(v_cache, aoff), span);
            }
            const size_t off = (size_t(tile.table[page]) * bs + in_page) * kv_width + first;
            kbase[i] = widen(kv_at(k_cache, off), kbuf + size_t(i) * span, span);
            vbase[i] = widen(kv_at(v_cache, off), vbuf + size_t(i) * span, span);
            if (++in_page == bs) in_page = 0, ++page;
        }
        for (int g = 0; g < g1 - g0; ++g) {
            for (int i = 0; i < nk; ++i) krow[i] = kbase[i] + size_t(g) * D, vrow[i] = vbase[i] + size_t(g) * D;
            for (int i = nk; i < nk + 8; ++i) krow[i] = krow[0];  // padding lanes, masked below
            for (int r = 0; r < tile.nrows; ++r) {
                int n = tile.p0 + r + 1 - j0 < nk ? tile.p0 + r + 1 - j0 : nk;  // keys row r sees here
                const int skip = tile.key_lo(r) > j0 ? tile.key_lo(r) - j0 : 0;        // ones before its window
                n -= skip;
                if (n <= 0) continue;
                const float* q = tile.q0 + size_t(r) * tile.q_stride + size_t(g) * rep * D;
                float* o = tile.o0 + size_t(r) * tile.o_stride + size_t(g) * rep * D;
                heads(q, o, run_max + r * qpr + g * rep, run_sum + r * qpr + g * rep, krow + skip, vrow + skip, n, sl2e);
            }
        }
    }
    for (int r = 0; r < tile.nrows; ++r)
        for (int h = 0; h < qpr; ++h) {
            float* o = tile.o0 + size_t(r) * tile.o_stride + size_t(h) * D;
            const float inv = 1.f / run_sum[r * qpr + h];
            for (int c = 0; c < D; ++c) o[c] *= inv;
        }
}

}  // namespace tp::paged
