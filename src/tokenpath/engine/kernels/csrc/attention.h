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

#include "attn_softmax.h"
#include "attn_tile.h"
#include "attn_walk.h"
#include "kv_fp8.h"
#include "tp_kernels.h"
#include "vec_math.h"

namespace tp {
namespace paged {

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

// The item: KV heads g0 .. g1-1 of one tile (query heads g * rep .. g * rep + rep - 1 each). Why
// several heads: a cache slot holds every KV head's row side by side (kv_width features), so a
// decode row that reads one head's 64 features per slot has the hardware prefetcher pull in its
// neighbours too: with one item per head, decode attention moved ~3x the bytes it used. An item
// over all heads reads each slot's rows whole, once.
template <class KV>
void attend_tile(const KV* k_cache, const KV* v_cache, const Tile& tile, int bs, int kv_width, int g0, int g1, int D,
                 int rep, float scale, float* scratch) {
    walk_tile<float>(
        k_cache, v_cache, tile, bs, kv_width, g0, g1, D, rep, scale, scratch,
        [](const KV* row, float* buf, int n) { return widen(row, buf, n); },
        [&](const float* q, float* o, float* mx, float* sm, const float* const* kr, const float* const* vr, int n,
            float sl2e) {
            by_heads(rep, [&](auto heads, int h) {
                constexpr int Q = decltype(heads)::value;
                block_step<Q>(
                    q + h * D, o + h * D, mx + h, sm + h, n, D, sl2e,
                    [&](const float* const* qs, int key0, __m128* out) { dots4<Q>(qs, kr + key0, D, out); },
                    [&](float* const* os, const float* alpha, const float (*p)[kKeyBlock]) {
                        accumulate<Q>(os, alpha, p, vr, n, D);
                    });
            });
        });
}

}  // namespace paged
}  // namespace tp

namespace tp {

// Whether a model runs attn_avx512.cpp's kernels: the AVX-512 ISA (2), in an object that has them,
// and a head_dim they take.
inline bool attn512_for(int isa, int head_dim) {
#ifndef TP_NO_AVX512
    return isa == 2 && avx512::attend_runs(head_dim);
#else
    (void)isa, (void)head_dim;
    return false;
#endif
}

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

