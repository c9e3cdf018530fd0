// The online-softmax step of one key block (and the loops around it), shared by the two attention kernels (attention.h,
// attn_avx512.cpp), so that both compute the same bits: the scores of Q queries against the block's
// n keys (from the kernel's own dots4), scaled to log2 units and masked past n, the update of each
// query's running max and sum, and the block's weights p = 2^(score - max).
//
// `static inline` (vec_math.h says why): each file compiles its own copy under its own target.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <type_traits>

#include "attn_tile.h"
#include "vec_math.h"

namespace tp::paged {

// dots(key0, out): out[i] lane j = query i . key key0 + j, for j < 4. alpha[i]: the factor the
// query's output accumulated so far is rescaled by.
template <int Q, class Dots>
static inline void scores_softmax(Dots&& dots, int n, float sl2e, float* run_max, float* run_sum,
                                  float (*p)[kKeyBlock], float* alpha) {
    const int groups = (n + 7) / 8;
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), vsl2e = _mm256_set1_ps(sl2e);
    __m256 s[Q][kKeyBlock / 8], bmax[Q];
    for (int i = 0; i < Q; ++i) bmax[i] = _mm256_set1_ps(-INFINITY);
    for (int b = 0; b < groups; ++b) {
        __m128 lo[Q], hi[Q];
        dots(8 * b, lo);
        dots(8 * b + 4, hi);
        const bool partial = 8 * b + 8 > n;
        const __m256 valid = _mm256_cmp_ps(iota, _mm256_set1_ps(float(n - 8 * b)), _CMP_LT_OQ);
        for (int i = 0; i < Q; ++i) {
            s[i][b] = _mm256_mul_ps(_mm256_set_m128(hi[i], lo[i]), vsl2e);
            if (partial) s[i][b] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[i][b], valid);
            bmax[i] = _mm256_max_ps(bmax[i], s[i][b]);
        }
    }
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
}

// One row's Q consecutive query heads (q0, o0: the first; heads D apart) against the n keys of one
// block: the scores (dots(q, key0, out), the kernel's dots4), the softmax step above, and the
// rescaled output (accumulate(o, alpha, p), the kernel's).
template <int Q, class Dots, class Accumulate>
static inline void block_step(const float* q0, float* o0, float* run_max, float* run_sum, int n, int D, float sl2e,
                              Dots&& dots, Accumulate&& accumulate) {
    const float* q[Q];
    float* o[Q];
    for (int i = 0; i < Q; ++i) q[i] = q0 + size_t(i) * D, o[i] = o0 + size_t(i) * D;
    alignas(32) float p[Q][kKeyBlock];
    float alpha[Q];
    scores_softmax<Q>([&](int key0, __m128* out) { dots(q, key0, out); }, n, sl2e, run_max, run_sum, p, alpha);
    accumulate(o, alpha, p);
}

// A row's rep query heads of one KV head, three at a time (SmolLM2: rep = 3), then the rest:
// update(std::integral_constant<int, Q>, h) runs heads h .. h + Q - 1.
template <class Update>
static inline void by_heads(int rep, Update&& update) {
    int h = 0;
    for (; h + 3 <= rep; h += 3) update(std::integral_constant<int, 3>{}, h);
    if (rep - h == 2) update(std::integral_constant<int, 2>{}, h);
    if (rep - h == 1) update(std::integral_constant<int, 1>{}, h);
}

}  // namespace tp::paged
