// Small AVX2 helpers the kernels share: horizontal sum and max of 8 floats, 2^x on 8 lanes.
//
// Everything here is `static inline`: each file that includes it compiles its own copy under its
// own `#pragma GCC target` (dot_avx2.cpp, dot_avx512.cpp, forward.cpp). With ordinary inline
// functions the linker could keep the AVX-512 build of one for every caller, and an AVX2-only CPU
// would then fault in it.
#pragma once
#include <immintrin.h>

namespace tp::vec {

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// 2^x: 0 below 2^-125 (so -inf, a masked score, gives 0), x clamped at 127 above. Range reduction
// to f in [-0.5, 0.5] and the degree-7 Taylor series of 2^f: relative error ~1e-8. Attention's
// softmax and the MLP's SiLU (exp(-g) = 2^(-g log2 e)) both use it.
// The series' coefficients, highest degree first (attn_amx.cpp's 16-lane exp2 uses them too).
inline constexpr float kExp2Poly[8] = {1.5252734e-5f, 1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f,
                                       5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.f};
static inline __m256 exp2_ps(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-125.f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-125.f)), _mm256_set1_ps(127.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(kExp2Poly[0]);
    for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_and_ps(keep, _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e)));
}

}  // namespace tp::vec
