// Paged causal attention for the fused forward (forward.cpp), AVX2 + FMA + F16C.
//
// One work item is a tile of up to kTileRows consecutive rows of one sequence (same block table,
// consecutive positions: a prefill chunk) and one KV head. Why tiles: a prefill chunk's rows all
// read the same K/V history, so reading each K/V row once per tile and using it for
// rows * (query heads per KV head) queries moves the work from memory to the FMA units. A decode
// row is a tile of one.
//
// How: keys go in blocks of kKeyBlock (flash-attention style online softmax: a running maximum
// and sum per query, the output rescaled when the maximum grows), so K and V are read in one pass
// and a block stays in L1 while every query of the tile uses it. A float16 or fp8 cache (kv_fp8.h)
// is widened once per block into a small float buffer (F16C), not once per query. The query heads of a row go
// three at a time through register-blocked kernels (3 queries x 4 keys of score accumulators,
// 3 queries x 32 output floats), so each K/V load feeds three FMAs; the 4 scores of a query come
// out of one transpose-add instead of one horizontal sum per score, and exp runs 8 lanes at once.
//
// attn_avx512.cpp is this kernel in 512-bit vectors, with the same bits; `attend` (the end of this file)
// runs one or the other per model. Included by forward.cpp only, after its `#pragma GCC target("avx2,fma,f16c")`.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "attn_tile.h"
#include "kv_fp8.h"
#include "tp_kernels.h"
#include "vec_math.h"

namespace tp {
namespace paged {

using vec::exp2_ps;
using vec::hmax8;
using vec::hsum8;

// Scores of Q queries against 4 keys, out[i] lane k = q[i] . key[k]: a Q x 4 block of
// accumulators, so each loaded K chunk feeds Q FMAs and each query chunk 4 (7 loads per 12 FMAs at
// Q = 3, against 9 per 8 for one query), then one transpose-add per query for the 4 sums.
template <int Q>
inline void dots4(const float* const* q, const float* const* k, int D, __m128* out) {
    __m256 acc[Q][4];
    for (int i = 0; i < Q; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    int c = 0;
    for (; c + 8 <= D; c += 8) {
        __m256 x[Q];
        for (int i = 0; i < Q; ++i) x[i] = _mm256_loadu_ps(q[i] + c);
        for (int j = 0; j < 4; ++j) {
            const __m256 kj = _mm256_loadu_ps(k[j] + c);
            for (int i = 0; i < Q; ++i) acc[i][j] = _mm256_fmadd_ps(x[i], kj, acc[i][j]);
        }
    }
    for (int i = 0; i < Q; ++i) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
        out[i] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    }
    if (c < D) {  // head_dim not a multiple of 8
        for (int i = 0; i < Q; ++i) {
            alignas(16) float t[4] = {};
            for (int j = 0; j < 4; ++j)
                for (int cc = c; cc < D; ++cc) t[j] += q[i][cc] * k[j][cc];
            out[i] = _mm_add_ps(out[i], _mm_load_ps(t));
        }
    }
}

// o[i][c, c + 8 * NC) = alpha[i] * o[i] + sum_j p[i][j] * v[j][c, c + 8 * NC) for Q queries: each
// loaded V chunk feeds Q FMAs, and the Q x NC output block stays in registers over the keys.
template <int Q, int NC>
inline void accumulate_slice(float* const* o, const float* alpha, const float (*p)[kKeyBlock],
                             const float* const* v, int n, int c) {
    __m256 acc[Q][NC];
    for (int i = 0; i < Q; ++i)
        for (int k = 0; k < NC; ++k) acc[i][k] = _mm256_mul_ps(_mm256_set1_ps(alpha[i]), _mm256_loadu_ps(o[i] + c + 8 * k));
    for (int j = 0; j < n; ++j) {
        __m256 pj[Q];
        for (int i = 0; i < Q; ++i) pj[i] = _mm256_broadcast_ss(&p[i][j]);
        const float* vj = v[j] + c;
        for (int k = 0; k < NC; ++k) {
            const __m256 x = _mm256_loadu_ps(vj + 8 * k);
            for (int i = 0; i < Q; ++i) acc[i][k] = _mm256_fmadd_ps(pj[i], x, acc[i][k]);
        }
    }
    for (int i = 0; i < Q; ++i)
        for (int k = 0; k < NC; ++k) _mm256_storeu_ps(o[i] + c + 8 * k, acc[i][k]);
}

template <int Q>
inline void accumulate(float* const* o, const float* alpha, const float (*p)[kKeyBlock], const float* const* v, int n,
                       int D) {
    int c = 0;
    for (; c + 32 <= D; c += 32) accumulate_slice<Q, 4>(o, alpha, p, v, n, c);
    switch ((D - c) / 8) {
        case 3: accumulate_slice<Q, 3>(o, alpha, p, v, n, c); break;
        case 2: accumulate_slice<Q, 2>(o, alpha, p, v, n, c); break;
        case 1: accumulate_slice<Q, 1>(o, alpha, p, v, n, c); break;
        default: break;
    }
    for (c += (D - c) / 8 * 8; c < D; ++c)  // head_dim not a multiple of 8
        for (int i = 0; i < Q; ++i) {
            float s = alpha[i] * o[i][c];
            for (int j = 0; j < n; ++j) s += p[i][j] * v[j][c];
            o[i][c] = s;
        }
}

// Q consecutive query heads of one row (q, o: their first head; heads D apart) against the n
// keys of one block it sees: scores, the online-softmax update of their running max and sum, and
// the rescaled output accumulation.
template <int Q>
void block_update(const float* q0, float* o0, float* run_max, float* run_sum, const float* const* krow,
                  const float* const* vrow, int n, int D, float sl2e) {
    const float* q[Q];
    float* o[Q];
    for (int i = 0; i < Q; ++i) q[i] = q0 + size_t(i) * D, o[i] = o0 + size_t(i) * D;
    const int groups = (n + 7) / 8;
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), vsl2e = _mm256_set1_ps(sl2e);
    __m256 s[Q][kKeyBlock / 8], bmax[Q];
    for (int i = 0; i < Q; ++i) bmax[i] = _mm256_set1_ps(-INFINITY);
    for (int b = 0; b < groups; ++b) {
        __m128 lo[Q], hi[Q];
        dots4<Q>(q, krow + 8 * b, D, lo);
        dots4<Q>(q, krow + 8 * b + 4, D, hi);
        const bool partial = 8 * b + 8 > n;
        const __m256 valid = _mm256_cmp_ps(iota, _mm256_set1_ps(float(n - 8 * b)), _CMP_LT_OQ);
        for (int i = 0; i < Q; ++i) {
            s[i][b] = _mm256_mul_ps(_mm256_set_m128(hi[i], lo[i]), vsl2e);
            if (partial) s[i][b] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[i][b], valid);
            bmax[i] = _mm256_max_ps(bmax[i], s[i][b]);
        }
    }
    alignas(32) float p[Q][kKeyBlock];
    float alpha[Q];
    for (int i = 0; i < Q; ++i) {
        const float bm = hmax8(bmax[i]), mx = run_max[i] > bm ? run_max[i] : bm;
        alpha[i] = std::exp2(run_max[i] - mx);  // 0 on the first block (the max was -inf)
        run_max[i] = mx;
        __m256 sum = _mm256_setzero_ps();
        for (int b = 0; b < groups; ++b) {
            const __m256 e = exp2_ps(_mm256_sub_ps(s[i][b], _mm256_set1_ps(mx)));
            _mm256_store_ps(&p[i][8 * b], e);
            sum = _mm256_add_ps(sum, e);
        }
        run_sum[i] = run_sum[i] * alpha[i] + hsum8(sum);
    }
    accumulate<Q>(o, alpha, p, vrow, n, D);
}

// A cache row (n features) as floats: float32 rows are used in place, the others (float16, fp8, q8_0)
// widened into buf.
inline const float* widen(const float* row, float*, int) { return row; }
inline const float* widen(const uint16_t* row, float* buf, int D) {
    int c = 0;
    for (; c + 8 <= D; c += 8)
        _mm256_storeu_ps(buf + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c))));
    for (; c < D; ++c) buf[c] = _cvtsh_ss(row[c]);
    return buf;
}
inline const float* widen(const KvE5M2* row, float* buf, int D) { return fp8::decode(row, buf, D), buf; }
inline const float* widen(const KvE4M3* row, float* buf, int D) { return fp8::decode(row, buf, D), buf; }
inline const float* widen(const KvQ8* row, float* buf, int D) { return q8::decode(row, buf, D), buf; }

// Keys ahead of the one being widened whose K and V rows are prefetched. Why: a sequence's keys
// lie in blocks scattered over the pool, a few KiB each, too short for the hardware prefetcher to
// ramp up in; decode at c=32 spent most of its attention time waiting on these loads.
constexpr int kPrefetchKeys = 8;

template <class KV>
inline void prefetch_rows(const KV* row, int n) {
    const char* p = reinterpret_cast<const char*>(row);
    const size_t bytes = size_t(n) / KvPer<KV> * sizeof(KV);
    for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// The item: KV heads g0 .. g1-1 of one tile (query heads g * rep .. g * rep + rep - 1 each). Why
// several heads: a cache slot holds every KV head's row side by side (kv_width features), so a
// decode row that reads one head's 64 features per slot has the hardware prefetcher pull in its
// neighbours too: with one item per head, decode attention moved ~3x the bytes it used. An item
// over all heads reads each slot's rows whole, once.
template <class KV>
void attend_tile(const KV* k_cache, const KV* v_cache, const Tile& tile, int bs, int kv_width, int g0, int g1, int D,
                 int rep, float scale, float* scratch) {
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
    auto key_lo = [&](int r) { return tile.key_lo(r); };
    const float* kbase[kKeyBlock];
    const float* vbase[kKeyBlock];
    const float* krow[kKeyBlock + 8];  // + padding lanes past a window's skipped keys
    const float* vrow[kKeyBlock + 8];
    const size_t first = size_t(g0) * D;
    // Key blocks stay aligned to multiples of kKeyBlock whatever the tile, so a row sums its keys
    // in the same blocks in any batch (batch invariance).
    for (int j0 = key_lo(0) / kKeyBlock * kKeyBlock; j0 < ctx_end; j0 += kKeyBlock) {
        const int nk = ctx_end - j0 < kKeyBlock ? ctx_end - j0 : kKeyBlock;
        int page = j0 / bs, in_page = j0 % bs;
        for (int i = 0; i < nk; ++i) {
            const int ahead = j0 + i + kPrefetchKeys;  // a later key's rows, which may be on another page
            if (ahead < ctx_end) {
                const size_t aoff = (size_t(tile.table[ahead / bs]) * bs + ahead % bs) * kv_width + first;
                prefetch_rows(kv_at(k_cache, aoff), span);
                prefetch_rows(kv_at(v_cache, aoff), span);
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
                const int skip = key_lo(r) > j0 ? key_lo(r) - j0 : 0;        // ones before its window
                n -= skip;
                if (n <= 0) continue;
                const float* q = tile.q0 + size_t(r) * tile.q_stride + size_t(g) * rep * D;
                float* o = tile.o0 + size_t(r) * tile.o_stride + size_t(g) * rep * D;
                float *mx = run_max + r * qpr + g * rep, *sm = run_sum + r * qpr + g * rep;
                int h = 0;  // the head's queries three at a time (SmolLM2: rep = 3), then the rest
                const float* const* kr = krow + skip;
                const float* const* vr = vrow + skip;
                for (; h + 3 <= rep; h += 3) block_update<3>(q + h * D, o + h * D, mx + h, sm + h, kr, vr, n, D, sl2e);
                if (rep - h == 2) block_update<2>(q + h * D, o + h * D, mx + h, sm + h, kr, vr, n, D, sl2e);
                if (rep - h == 1) block_update<1>(q + h * D, o + h * D, mx + h, sm + h, kr, vr, n, D, sl2e);
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

}  // namespace paged
}  // namespace tp

namespace tp {

// One attention item on the model's kernels: attn_avx512.cpp's (attn512) or attention.h's.
inline void attend(bool attn512, int kv_kind, const void* k_cache, const void* v_cache, const paged::Tile& tile,
                   int bs, int kv_width, int g0, int g1, int D, int rep, float scale, float* scratch) {
#ifndef TP_NO_AVX512
    if (attn512) return avx512::attend_tile(kv_kind, k_cache, v_cache, tile, bs, kv_width, g0, g1, D, rep, scale, scratch);
#else
    (void)attn512;
#endif
    with_kv_type(kv_kind, [&](auto* type) {
        using KV = std::remove_pointer_t<decltype(type)>;
        paged::attend_tile(static_cast<const KV*>(k_cache), static_cast<const KV*>(v_cache), tile, bs, kv_width, g0,
                           g1, D, rep, scale, scratch);
    });
}

}  // namespace tp

