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
// and a block stays in L1 while every query of the tile uses it. A float16 cache is widened once
// per block into a small float buffer (F16C), not once per query. Scores are computed 8 keys at a
// time with one accumulator per key and a single transpose-add at the end (one horizontal
// reduction per 8 scores instead of one per score), and exp runs 8 lanes at once.
//
// Included by forward.cpp only, after its `#pragma GCC target("avx2,fma,f16c")`.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tp {
namespace paged {

constexpr int kTileRows = 8;   // rows per item: 8 rows x 3 query heads (SmolLM2) share each K/V row
constexpr int kKeyBlock = 32;  // keys per block: K + V of a block (16 KiB at head_dim 64) fit in L1

// Floats of per-thread scratch an item needs (widened K/V block, running max and sum per query).
inline size_t scratch_floats(int D, int rep) { return size_t(2) * kKeyBlock * D + size_t(2) * kTileRows * rep; }

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// 2^x for x <= 0 (scores minus their running maximum); 0 below 2^-125, so -inf (masked) gives 0.
// Range reduction to f in [-0.5, 0.5] and the degree-7 Taylor series of 2^f: relative error ~1e-8.
inline __m256 exp2_ps(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-125.f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5252734e-5f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530e-4f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_and_ps(keep, _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e)));
}

// Dot products of q with 8 key rows, lane i = q . k[i]: 8 accumulators, then one transpose-add.
inline __m256 dot8(const float* q, const float* const* k, int D) {
    const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3], *k4 = k[4], *k5 = k[5], *k6 = k[6], *k7 = k[7];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    int c = 0;
    for (; c + 8 <= D; c += 8) {
        const __m256 x = _mm256_loadu_ps(q + c);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + c), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + c), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + c), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + c), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k4 + c), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k5 + c), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k6 + c), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k7 + c), a7);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // keys 0-3, both halves
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));  // keys 4-7
    __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    if (c < D) {  // head_dim not a multiple of 8
        alignas(32) float t[8] = {};
        for (int i = 0; i < 8; ++i)
            for (int cc = c; cc < D; ++cc) t[i] += q[cc] * k[i][cc];
        s = _mm256_add_ps(s, _mm256_load_ps(t));
    }
    return s;
}

// o[0, 8 * NC) = alpha * o + sum_j p[j] * v[j][0, 8 * NC): the output slice stays in NC registers.
template <int NC>
inline void accumulate_slice(float* o, __m256 alpha, const float* p, const float* const* v, int n, int c) {
    __m256 acc[NC];
    for (int i = 0; i < NC; ++i) acc[i] = _mm256_mul_ps(alpha, _mm256_loadu_ps(o + 8 * i));
    for (int j = 0; j < n; ++j) {
        const __m256 pj = _mm256_broadcast_ss(p + j);
        const float* vj = v[j] + c;
        for (int i = 0; i < NC; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), acc[i]);
    }
    for (int i = 0; i < NC; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

// o = alpha * o + sum_{j < n} p[j] * v[j] over D values, in register-resident slices of 64.
inline void accumulate(float* o, float alpha, const float* p, const float* const* v, int n, int D) {
    const __m256 a = _mm256_set1_ps(alpha);
    int c = 0;
    for (; c + 64 <= D; c += 64) accumulate_slice<8>(o + c, a, p, v, n, c);
    switch ((D - c) / 8) {
        case 7: accumulate_slice<7>(o + c, a, p, v, n, c); break;
        case 6: accumulate_slice<6>(o + c, a, p, v, n, c); break;
        case 5: accumulate_slice<5>(o + c, a, p, v, n, c); break;
        case 4: accumulate_slice<4>(o + c, a, p, v, n, c); break;
        case 3: accumulate_slice<3>(o + c, a, p, v, n, c); break;
        case 2: accumulate_slice<2>(o + c, a, p, v, n, c); break;
        case 1: accumulate_slice<1>(o + c, a, p, v, n, c); break;
        default: break;
    }
    for (c += (D - c) / 8 * 8; c < D; ++c) {  // head_dim not a multiple of 8
        float s = alpha * o[c];
        for (int j = 0; j < n; ++j) s += p[j] * v[j][c];
        o[c] = s;
    }
}

// A cache row as floats: float32 rows are used in place, float16 rows widened into buf.
inline const float* widen(const float* row, float*, int) { return row; }
inline const float* widen(const uint16_t* row, float* buf, int D) {
    int c = 0;
    for (; c + 8 <= D; c += 8)
        _mm256_storeu_ps(buf + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c))));
    for (; c < D; ++c) buf[c] = _cvtsh_ss(row[c]);
    return buf;
}

// One tile: rows r = 0..nrows-1 at positions p0 + r (row r sees keys 0..p0 + r), query heads
// g * rep .. g * rep + rep - 1 of each row (q at q0 + r * q_stride + h * D), outputs likewise at o0.
struct Tile {
    const float* q0;
    float* o0;
    int q_stride, o_stride, nrows, p0;
    const int32_t* table;  // the sequence's block table
};

template <class KV>
void attend_tile(const KV* k_cache, const KV* v_cache, const Tile& tile, int bs, int nkv, int g, int D, int rep,
                 float scale, float* scratch) {
    const int nqry = tile.nrows * rep;
    float* kbuf = scratch;                          // [kKeyBlock][D] widened float16 K
    float* vbuf = kbuf + size_t(kKeyBlock) * D;     // [kKeyBlock][D] widened float16 V
    float* run_max = vbuf + size_t(kKeyBlock) * D;  // [nqry] running max of the scaled scores (log2 units)
    float* run_sum = run_max + nqry;                // [nqry] running sum of 2^(score - max)
    for (int i = 0; i < nqry; ++i) run_max[i] = -INFINITY, run_sum[i] = 0.f;
    for (int r = 0; r < tile.nrows; ++r) std::memset(tile.o0 + size_t(r) * tile.o_stride, 0, sizeof(float) * rep * D);
    const float sl2e = scale * 1.44269504f;  // scores in log2 units: exp(s * scale) = 2^(s * sl2e)
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), vsl2e = _mm256_set1_ps(sl2e);
    const int ctx_end = tile.p0 + tile.nrows;  // the last row's context length
    const float* krow[kKeyBlock];
    const float* vrow[kKeyBlock];
    alignas(32) float p[kKeyBlock];
    const size_t head = size_t(g) * D;
    for (int j0 = 0; j0 < ctx_end; j0 += kKeyBlock) {
        const int nk = ctx_end - j0 < kKeyBlock ? ctx_end - j0 : kKeyBlock;
        int page = j0 / bs, in_page = j0 % bs;
        for (int i = 0; i < nk; ++i) {
            const size_t off = (size_t(tile.table[page]) * bs + in_page) * nkv + head;
            krow[i] = widen(k_cache + off, kbuf + size_t(i) * D, D);
            vrow[i] = widen(v_cache + off, vbuf + size_t(i) * D, D);
            if (++in_page == bs) in_page = 0, ++page;
        }
        for (int i = nk; i < (nk + 7) / 8 * 8; ++i) krow[i] = krow[0];  // padding lanes, masked below
        for (int r = 0; r < tile.nrows; ++r) {
            const int n = tile.p0 + r + 1 - j0 < nk ? tile.p0 + r + 1 - j0 : nk;  // keys row r sees here
            if (n <= 0) continue;
            const int groups = (n + 7) / 8;
            for (int h = 0; h < rep; ++h) {
                const int qi = r * rep + h;
                const float* q = tile.q0 + size_t(r) * tile.q_stride + size_t(h) * D;
                __m256 s[kKeyBlock / 8];
                __m256 bmax = _mm256_set1_ps(-INFINITY);
                for (int b = 0; b < groups; ++b) {
                    s[b] = _mm256_mul_ps(dot8(q, krow + 8 * b, D), vsl2e);
                    if (8 * b + 8 > n)
                        s[b] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[b],
                                                _mm256_cmp_ps(iota, _mm256_set1_ps(float(n - 8 * b)), _CMP_LT_OQ));
                    bmax = _mm256_max_ps(bmax, s[b]);
                }
                const float mx = run_max[qi] > hmax8(bmax) ? run_max[qi] : hmax8(bmax);
                const float alpha = std::exp2(run_max[qi] - mx);  // 0 on the first block (max was -inf)
                run_max[qi] = mx;
                __m256 sum = _mm256_setzero_ps();
                for (int b = 0; b < groups; ++b) {
                    const __m256 e = exp2_ps(_mm256_sub_ps(s[b], _mm256_set1_ps(mx)));
                    _mm256_store_ps(p + 8 * b, e);
                    sum = _mm256_add_ps(sum, e);
                }
                run_sum[qi] = run_sum[qi] * alpha + hsum8(sum);
                accumulate(tile.o0 + size_t(r) * tile.o_stride + size_t(h) * D, alpha, p, vrow, n, D);
            }
        }
    }
    for (int r = 0; r < tile.nrows; ++r)
        for (int h = 0; h < rep; ++h) {
            float* o = tile.o0 + size_t(r) * tile.o_stride + size_t(h) * D;
            const float inv = 1.f / run_sum[r * rep + h];
            for (int c = 0; c < D; ++c) o[c] *= inv;
        }
}

}  // namespace paged
}  // namespace tp
