// Paged causal attention in 512-bit vectors (the _native_avx512 object; attention.h is the AVX2
// kernel of both objects, and what this one replaces where forward.cpp's attn512 says so).
//
// Why a second kernel: at c=32 attention was a third of a step on AVX-512 hosts, and most of that
// was not arithmetic: every key's float16 K and V rows were widened into a float buffer and read
// back, once per query row. Here a decode row (a tile of one) reads its float16 (or float32) K/V
// rows straight from the pool and widens them in registers, 16 features per vcvtph2ps, with the
// next keys' rows prefetched (a sequence's blocks are scattered over the pool, a few KiB each, too
// short for the hardware prefetcher to ramp up in). A tile of several rows (a prefill chunk, or
// speculation's verification rows) still widens each key block once into the buffer and reuses it
// for every row.
//
// The same numbers as attention.h, bit for bit: widening is exact, each score sums its features in
// attention.h's order (8 lanes, then the same hadd tree; here one 512-bit FMA does two keys' 8
// lanes), the softmax is attention.h's code, and the output's lanes take the same FMAs in key order.
// So a model gives the same bits on AVX2 and AVX-512 hosts, and a row's output does not depend on
// what shares its step: a lone row reading the pool and a tile reading the buffer agree
// (tests/engine/test_attention_kernels.py checks both). Needs head_dim a multiple of 8 (attend_runs);
// other models keep attention.h.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // see dot_avx512.cpp (and -Wuninitialized: the same)
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attn_tile.h"
#include "kv_fp8.h"
#include "tp_kernels.h"
#include "vec_math.h"

namespace tp {
namespace avx512 {
namespace {

using paged::kKeyBlock;
using paged::Tile;

constexpr int kPrefetchKeys = 8;  // keys ahead of the one read whose K/V rows are prefetched

// Features [c, c + 8) of two rows side by side: a in lanes 0..7, b in lanes 8..15.
inline __m512 load8x2(const float* a, const float* b, int c) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a + c)), _mm256_loadu_ps(b + c), 1);
}
inline __m512 load8x2(const uint16_t* a, const uint16_t* b, int c) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + c));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + c));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// _mm256_hadd_ps on each 256-bit half: [x0 + x1, x2 + x3, y0 + y1, y2 + y3] per 128-bit lane.
inline __m512 hadd2(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of Q queries against keys k[0..3], out[i] lane j = q[i] . k[j], summed exactly as
// attention.h's dots4 sums them: per key, 8 lanes accumulating features c = lane (mod 8) in order,
// then the same hadd tree. Here each FMA does two keys' 8 lanes (keys 0 and 2 in one register, 1 and
// 3 in another), so the tree's first level is one hadd2 and the lanes match attention.h's bit for bit.
template <int Q, class S>
inline void dots4(const float* const* q, const S* const* k, int D, __m128* out) {
    __m512 acc[Q][2];
    for (int i = 0; i < Q; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    int c = 0;
    for (; c + 8 <= D; c += 8) {
        const __m512 k02 = load8x2(k[0], k[2], c), k13 = load8x2(k[1], k[3], c);
        for (int i = 0; i < Q; ++i) {
            const __m512 x = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[i] + c));
            acc[i][0] = _mm512_fmadd_ps(x, k02, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, k13, acc[i][1]);
        }
    }
    for (int i = 0; i < Q; ++i) {
        const __m512 h = hadd2(acc[i][0], acc[i][1]);  // [hadd(k0, k1) | hadd(k2, k3)]
        const __m256 g = _mm256_hadd_ps(_mm512_castps512_ps256(h), _mm512_extractf32x8_ps(h, 1));
        out[i] = _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1));
    }
}

// o[i][c, c + 16 * NC) = alpha[i] * o[i] + sum_j p[i][j] * v[j][c, c + 16 * NC), j in key order
// (each lane's arithmetic is attention.h's accumulate).
template <int Q, int NC, class S>
inline void accumulate_slice(float* const* o, const float* alpha, const float (*p)[kKeyBlock], const S* const* v,
                             int n, int c) {
    __m512 acc[Q][NC];
    for (int i = 0; i < Q; ++i)
        for (int k = 0; k < NC; ++k)
            acc[i][k] = _mm512_mul_ps(_mm512_set1_ps(alpha[i]), _mm512_loadu_ps(o[i] + c + 16 * k));
    for (int j = 0; j < n; ++j) {
        __m512 pj[Q];
        for (int i = 0; i < Q; ++i) pj[i] = _mm512_set1_ps(p[i][j]);
        for (int k = 0; k < NC; ++k) {
            const __m512 x = load16(v[j] + c + 16 * k);
            for (int i = 0; i < Q; ++i) acc[i][k] = _mm512_fmadd_ps(pj[i], x, acc[i][k]);
        }
    }
    for (int i = 0; i < Q; ++i)
        for (int k = 0; k < NC; ++k) _mm512_storeu_ps(o[i] + c + 16 * k, acc[i][k]);
}

// The last 8 features (head_dim an odd multiple of 8), the same per lane.
template <int Q, class S>
inline void accumulate8(float* const* o, const float* alpha, const float (*p)[kKeyBlock], const S* const* v, int n,
                        int c) {
    __m256 acc[Q];
    for (int i = 0; i < Q; ++i) acc[i] = _mm256_mul_ps(_mm256_set1_ps(alpha[i]), _mm256_loadu_ps(o[i] + c));
    for (int j = 0; j < n; ++j) {
        __m256 x;
        if constexpr (std::is_same_v<S, float>) x = _mm256_loadu_ps(v[j] + c);
        else x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v[j] + c)));
        for (int i = 0; i < Q; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(p[i][j]), x, acc[i]);
    }
    for (int i = 0; i < Q; ++i) _mm256_storeu_ps(o[i] + c, acc[i]);
}

// Q query heads (q, o: the first; heads D apart) against the n keys of one block: scores, the
// online-softmax update of their running max and sum (log2 units), and the rescaled output, in
// attention.h's block_update order. krow/vrow hold n rows, padded to a multiple of 8 with
// readable rows (masked).
template <int Q, class S>
void block_update(const float* q0, float* o0, float* run_max, float* run_sum, const S* const* krow,
                  const S* const* vrow, int n, int D, float sl2e) {
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
    alignas(64) float p[Q][kKeyBlock];
    float alpha[Q];
    for (int i = 0; i < Q; ++i) {
        const float bm = vec::hmax8(bmax[i]), mx = run_max[i] > bm ? run_max[i] : bm;
        alpha[i] = std::exp2(run_max[i] - mx);  // 0 on the first block (the max was -inf)
        run_max[i] = mx;
        __m256 sum = _mm256_setzero_ps();
        for (int b = 0; b < groups; ++b) {
            const __m256 e = vec::exp2_ps(_mm256_sub_ps(s[i][b], _mm256_set1_ps(mx)));
            _mm256_store_ps(&p[i][8 * b], e);
            sum = _mm256_add_ps(sum, e);
        }
        run_sum[i] = run_sum[i] * alpha[i] + vec::hsum8(sum);
    }
    int c = 0;
    for (; c + 64 <= D; c += 64) accumulate_slice<Q, 4>(o, alpha, p, vrow, n, c);
    switch ((D - c) / 16) {
        case 3: accumulate_slice<Q, 3>(o, alpha, p, vrow, n, c); break;
        case 2: accumulate_slice<Q, 2>(o, alpha, p, vrow, n, c); break;
        case 1: accumulate_slice<Q, 1>(o, alpha, p, vrow, n, c); break;
        default: break;
    }
    if (D % 16) accumulate8<Q>(o, alpha, p, vrow, n, D - 8);
}

// The rep query heads of one KV head, three at a time, then the rest (attention.h's grouping).
template <class S>
void heads_update(int rep, const float* q, float* o, float* mx, float* sm, const S* const* kr, const S* const* vr,
                  int n, int D, float sl2e) {
    int h = 0;
    for (; h + 3 <= rep; h += 3) block_update<3>(q + h * D, o + h * D, mx + h, sm + h, kr, vr, n, D, sl2e);
    if (rep - h == 2) block_update<2>(q + h * D, o + h * D, mx + h, sm + h, kr, vr, n, D, sl2e);
    if (rep - h == 1) block_update<1>(q + h * D, o + h * D, mx + h, sm + h, kr, vr, n, D, sl2e);
}

template <class KV>
inline void prefetch_row(const KV* row, int n) {
    const char* p = reinterpret_cast<const char*>(row);
    const size_t bytes = size_t(n) / KvPer<KV> * sizeof(KV);
    for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// A cache row (n features) as floats in buf (float32 rows are used in place).
inline const float* widen(const float* row, float*, int) { return row; }
inline const float* widen(const uint16_t* row, float* buf, int n) {
    for (int c = 0; c < n; c += 16) _mm512_storeu_ps(buf + c, load16(row + c));
    return buf;
}
inline const float* widen(const KvE5M2* row, float* buf, int n) { return fp8::decode(row, buf, n), buf; }
inline const float* widen(const KvE4M3* row, float* buf, int n) { return fp8::decode(row, buf, n), buf; }
inline const float* widen(const KvQ8* row, float* buf, int n) { return q8::decode(row, buf, n), buf; }

// attention.h's attend_tile (the same items, tiles, windows and blocks), on this file's kernels. S
// is what block_update reads: the pool's own rows (a tile of one row of float16 or float32) or
// floats widened into the scratch buffer.
template <class KV, class S>
void attend_tile_as(const KV* k_cache, const KV* v_cache, const Tile& tile, int bs, int kv_width, int g0, int g1,
                    int D, int rep, float scale, float* scratch) {
    constexpr bool kDirect = std::is_same_v<S, KV>;
    const int span = (g1 - g0) * D, qpr = (g1 - g0) * rep;
    const int nqry = tile.nrows * qpr;
    float* kbuf = scratch;
    float* vbuf = kbuf + size_t(kKeyBlock) * span;
    float* run_max = vbuf + size_t(kKeyBlock) * span;
    float* run_sum = run_max + nqry;
    for (int i = 0; i < nqry; ++i) run_max[i] = -INFINITY, run_sum[i] = 0.f;
    for (int r = 0; r < tile.nrows; ++r) std::memset(tile.o0 + size_t(r) * tile.o_stride, 0, sizeof(float) * qpr * D);
    const float sl2e = scale * 1.44269504f;
    const int ctx_end = tile.p0 + tile.nrows;
    const S* kbase[kKeyBlock];
    const S* vbase[kKeyBlock];
    const S* krow[kKeyBlock + 8];  // + padding rows to a multiple of 8 keys (masked)
    const S* vrow[kKeyBlock + 8];
    const size_t first = size_t(g0) * D;
    for (int j0 = tile.key_lo(0) / kKeyBlock * kKeyBlock; j0 < ctx_end; j0 += kKeyBlock) {
        const int nk = ctx_end - j0 < kKeyBlock ? ctx_end - j0 : kKeyBlock;
        int page = j0 / bs, in_page = j0 % bs;
        for (int i = 0; i < nk; ++i) {
            const int ahead = j0 + i + kPrefetchKeys;
            if (ahead < ctx_end) {
                const size_t aoff = (size_t(tile.table[ahead / bs]) * bs + ahead % bs) * kv_width + first;
                prefetch_row(kv_at(k_cache, aoff), span);
                prefetch_row(kv_at(v_cache, aoff), span);
            }
            const size_t off = (size_t(tile.table[page]) * bs + in_page) * kv_width + first;
            if constexpr (kDirect) {
                kbase[i] = k_cache + off, vbase[i] = v_cache + off;
            } else {
                kbase[i] = widen(kv_at(k_cache, off), kbuf + size_t(i) * span, span);
                vbase[i] = widen(kv_at(v_cache, off), vbuf + size_t(i) * span, span);
            }
            if (++in_page == bs) in_page = 0, ++page;
        }
        for (int g = 0; g < g1 - g0; ++g) {
            for (int i = 0; i < nk; ++i) krow[i] = kbase[i] + size_t(g) * D, vrow[i] = vbase[i] + size_t(g) * D;
            for (int i = nk; i < nk + 8; ++i) krow[i] = krow[0];  // padding rows, masked in block_update
            for (int r = 0; r < tile.nrows; ++r) {
                int n = tile.p0 + r + 1 - j0 < nk ? tile.p0 + r + 1 - j0 : nk;
                const int skip = tile.key_lo(r) > j0 ? tile.key_lo(r) - j0 : 0;
                n -= skip;
                if (n <= 0) continue;
                const float* q = tile.q0 + size_t(r) * tile.q_stride + size_t(g) * rep * D;
                float* o = tile.o0 + size_t(r) * tile.o_stride + size_t(g) * rep * D;
                heads_update(rep, q, o, run_max + r * qpr + g * rep, run_sum + r * qpr + g * rep, krow + skip,
                             vrow + skip, n, D, sl2e);
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

}  // namespace

bool attend_runs(int head_dim) { return head_dim % 8 == 0; }

void attend_tile(int kv_kind, const void* k_cache, const void* v_cache, const paged::Tile& tile, int bs,
                 int kv_width, int g0, int g1, int D, int rep, float scale, float* scratch) {
    with_kv_type(kv_kind, [&](auto* type) {
        using KV = std::remove_pointer_t<decltype(type)>;
        const KV* k = static_cast<const KV*>(k_cache);
        const KV* v = static_cast<const KV*>(v_cache);
        if constexpr (std::is_same_v<KV, float>)
            attend_tile_as<KV, float>(k, v, tile, bs, kv_width, g0, g1, D, rep, scale, scratch);
        else if constexpr (std::is_same_v<KV, uint16_t>) {
            if (tile.nrows == 1) attend_tile_as<KV, KV>(k, v, tile, bs, kv_width, g0, g1, D, rep, scale, scratch);
            else attend_tile_as<KV, float>(k, v, tile, bs, kv_width, g0, g1, D, rep, scale, scratch);
        } else
            attend_tile_as<KV, float>(k, v, tile, bs, kv_width, g0, g1, D, rep, scale, scratch);
    });
}

}  // namespace avx512
}  // namespace tp
