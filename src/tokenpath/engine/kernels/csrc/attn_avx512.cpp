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
// lanes), the softmax is the same code (attn_softmax.h), and the output's lanes take the same FMAs in key order.
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

#include "attn_softmax.h"
#include "attn_tile.h"
#include "attn_walk.h"
#include "kv_fp8.h"
#include "tp_kernels.h"
#include "vec_math.h"

namespace tp {
namespace avx512 {
namespace {

using paged::kKeyBlock;
using paged::Tile;

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

// The block's weighted V rows into o (accumulate_slice, then the last 8 features).
template <int Q, class S>
void accumulate(float* const* o, const float* alpha, const float (*p)[kKeyBlock], const S* const* vrow, int n, int D) {
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

// A cache row (n features) as floats in buf (a float32 pool is always read in place).
inline const float* widen(const uint16_t* row, float* buf, int n) {
    for (int c = 0; c < n; c += 16) _mm512_storeu_ps(buf + c, load16(row + c));
    return buf;
}
inline const float* widen(const KvE5M2* row, float* buf, int n) { return fp8::decode(row, buf, n), buf; }
inline const float* widen(const KvE4M3* row, float* buf, int n) { return fp8::decode(row, buf, n), buf; }
inline const float* widen(const KvQ8* row, float* buf, int n) { return q8::decode(row, buf, n), buf; }

// attention.h's attend_tile (the same items, tiles, windows and blocks), on this file's kernels. S
// is what dots4 and accumulate read: the pool's own rows (a tile of one row of float16 or float32) or
// floats widened into the scratch buffer.
template <class KV, class S>
void attend_tile_as(const KV* k_cache, const KV* v_cache, const Tile& tile, int bs, int kv_width, int g0, int g1,
                    int D, int rep, float scale, float* scratch) {
    paged::walk_tile<S>(
        k_cache, v_cache, tile, bs, kv_width, g0, g1, D, rep, scale, scratch,
        [](const KV* row, float* buf, int n) -> const S* {
            if constexpr (std::is_same_v<S, KV>) return row;  // read in place (a lone row)
            else return widen(row, buf, n);
        },
        [&](const float* q, float* o, float* mx, float* sm, const S* const* kr, const S* const* vr, int n,
            float sl2e) {
            paged::by_heads(rep, [&](auto heads, int h) {
                constexpr int Q = decltype(heads)::value;
                paged::block_step<Q>(
                    q + h * D, o + h * D, mx + h, sm + h, n, D, sl2e,
                    [&](const float* const* qs, int key0, __m128* out) { dots4<Q>(qs, kr + key0, D, out); },
                    [&](float* const* os, const float* alpha, const float (*p)[kKeyBlock]) {
                        accumulate<Q>(os, alpha, p, vr, n, D);
                    });
            });
        });
}

}  // namespace

bool attend_runs(int head_dim) { return head_dim % 8 == 0; }

void attend_tile(int kv_kind, const void* k_cache, const void* v_cache, const paged::Tile& tile, int bs,
                 int kv_width, int g0, int g1, int D, int rep, float scale, float* scratch) {
    with_kv_type(kv_kind, [&](auto* type) {
        using KV = std::remove_pointer_t<decltype(type)>;
        const KV* k = static_cast<const KV*>(k_cache);
        const KV* v = static_cast<const KV*>(v_cache);
        // In place: a float32 pool always, a float16 one for a lone row; else widened into scratch.
        if constexpr (std::is_same_v<KV, uint16_t>)
            if (tile.nrows == 1) return attend_tile_as<KV, KV>(k, v, tile, bs, kv_width, g0, g1, D, rep, scale, scratch);
        attend_tile_as<KV, float>(k, v, tile, bs, kv_width, g0, g1, D, rep, scale, scratch);
    });
}

}  // namespace avx512
}  // namespace tp
