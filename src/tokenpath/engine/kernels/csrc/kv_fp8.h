// One-byte KV-cache formats (--kv-cache-dtype fp8_e5m2 | fp8_e4m3, vLLM's spellings): a quarter of
// float32's bytes per value, half of float16's, so the same byte budget holds twice float16's tokens.
//
//   E5M2: 1 sign, 5 exponent (bias 15), 2 mantissa bits: the top byte of an IEEE half (with its
//         inf and NaN codes). Max finite 57344.
//   E4M3: OCP "FN": 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities; S.1111.111 is
//         NaN, the max is 448.
//
// There is no per-tensor scale (vLLM's default k_scale = v_scale = 1.0): values are stored as they
// come, which suits K/V after the projections (|x| is rarely above tens). Writing rounds to nearest
// even and saturates to the max finite value (infinities too, in both formats); NaN stays NaN.
//
// How, 8 values at a time with F16C and SSE integer ops:
//   write: float -> half rounded to odd (F16C's truncation, then the lowest bit set when that was
//          inexact), then the half's bits rounded to nearest even at the format's width. Rounding
//          to odd first is what makes the two roundings equal one (the half keeps >= 2 bits more
//          than the byte): a plain nearest-even half could round up onto a tie and then to even.
//          E4M3 scales by 2^-8 first: then the half's exponent is E4M3's biased exponent and its
//          subnormals are E4M3's, so the byte is the half's bits shifted right by 7.
//   read:  E5M2 byte << 8 is the half; E4M3 (byte & 0x7f) << 7 with the sign is the half of
//          value * 2^-8, widened and scaled by 256 (exact), the NaN codes blended in.
//
// Also here, llama.cpp's q8_0 cache type (--kv-cache-dtype q8_0): blocks of 32 values, an IEEE half
// scale d = max|x| / 127 and 32 int8 q = round-to-nearest-even(x / d) (llama.cpp's AVX2
// quantize_row_q8_0), 34 bytes per 32 values. A row (one slot's n_kv * head_dim features) is whole
// blocks: head_dim must be a multiple of 32 (runner.py refuses others at load), so a head's
// features start on a block and kv_at below turns a feature offset into a block pointer.
//
// Included by attention.h (inside tp::paged), after forward.cpp's `#pragma GCC target("avx2,fma,f16c")`,
// and by attn_avx512.cpp under its AVX-512 target: the conversions are `static inline` (vec_math.h
// says why), so each object keeps the copy compiled for its own target.
#pragma once
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The cache's element types: one byte each, distinct so that widen and store_kv overload on them.
struct KvE5M2 {
    uint8_t b;
};
struct KvE4M3 {
    uint8_t b;
};
struct KvQ8 {  // 32 values: d (IEEE half), q
    uint16_t d;
    int8_t q[32];
};
static_assert(sizeof(KvQ8) == 34, "q8_0 blocks are llama.cpp's 34 bytes");

// Values per element of a pool type, and the element holding feature `f` of a pool (f a multiple
// of KvPer for blocks).
template <class KV>
constexpr int KvPer = 1;
template <>
constexpr int KvPer<KvQ8> = 32;
template <class KV>
inline KV* kv_at(KV* base, size_t f) {
    return base + f / KvPer<std::remove_const_t<KV>>;
}

// The KV kinds (tp_model_create dims[12], kernels/model.py KV_KINDS).
enum KvKind { kKvF32 = 0, kKvF16 = 1, kKvE5M2 = 2, kKvE4M3 = 3, kKvQ8 = 4 };

// f(KV*) with a null pointer of the pool's element type for KvKind `kind`.
template <class F>
inline void with_kv_type(int kind, F&& f) {
    switch (kind) {
        case kKvF16: f(static_cast<uint16_t*>(nullptr)); break;
        case kKvE5M2: f(static_cast<KvE5M2*>(nullptr)); break;
        case kKvE4M3: f(static_cast<KvE4M3*>(nullptr)); break;
        case kKvQ8: f(static_cast<KvQ8*>(nullptr)); break;
        default: f(static_cast<float*>(nullptr)); break;
    }
}

namespace tp {
namespace fp8 {

// Per format: the float scale before the half, the bits the byte drops from the half's magnitude,
// the largest finite magnitude code and the NaN code.
template <class T>
struct Format;
template <>
struct Format<KvE5M2> {
    static constexpr float kScale = 1.f, kUnscale = 1.f;
    static constexpr int kShift = 8, kMax = 0x7b, kNan = 0x7e;
};
template <>
struct Format<KvE4M3> {
    static constexpr float kScale = 1.f / 256, kUnscale = 256.f;
    static constexpr int kShift = 7, kMax = 0x7e, kNan = 0x7f;
};

// 8 floats -> 8 codes (the low 8 bytes of the result).
template <class T>
static inline __m128i encode8(__m256 x) {
    using F = Format<T>;
    if (F::kScale != 1.f) x = _mm256_mul_ps(x, _mm256_set1_ps(F::kScale));
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256i inexact = _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtph_ps(h), x, _CMP_NEQ_UQ));
    const __m128i inexact16 = _mm_packs_epi32(_mm256_castsi256_si128(inexact), _mm256_extracti128_si256(inexact, 1));
    h = _mm_or_si128(h, _mm_and_si128(inexact16, _mm_set1_epi16(1)));  // rounded to odd
    const __m128i sign = _mm_srli_epi16(_mm_and_si128(h, _mm_set1_epi16(int16_t(0x8000))), 8);
    const __m128i mag = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
    const __m128i nan = _mm_cmpgt_epi16(mag, _mm_set1_epi16(0x7c00));
    // nearest even: + (half an output ulp - 1) + the kept lowest bit, then drop kShift bits
    const __m128i odd = _mm_and_si128(_mm_srli_epi16(mag, F::kShift), _mm_set1_epi16(1));
    __m128i code = _mm_add_epi16(_mm_add_epi16(mag, _mm_set1_epi16((1 << (F::kShift - 1)) - 1)), odd);
    code = _mm_min_epu16(_mm_srli_epi16(code, F::kShift), _mm_set1_epi16(F::kMax));  // saturate
    code = _mm_blendv_epi8(code, _mm_set1_epi16(F::kNan), nan);
    code = _mm_or_si128(code, sign);
    return _mm_packus_epi16(code, code);
}

// 8 codes (the low 8 bytes of b) -> 8 floats.
template <class T>
static inline __m256 decode8(__m128i b);
template <>
inline __m256 decode8<KvE5M2>(__m128i b) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
}
template <>
inline __m256 decode8<KvE4M3>(__m128i b) {
    const __m128i w = _mm_cvtepu8_epi16(b);
    const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(mag, 7));
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(Format<KvE4M3>::kUnscale));
    const __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
    return _mm256_or_ps(x, _mm256_castsi256_ps(nan));  // all ones: a NaN
}

template <class T>
static inline void encode(T* dst, const float* src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), encode8<T>(_mm256_loadu_ps(src + i)));
    if (i < n) {  // the tail through a padded copy: one rounding code path
        alignas(32) float in[8] = {};
        alignas(16) uint8_t out[16];
        std::memcpy(in, src + i, sizeof(float) * (n - i));
        _mm_store_si128(reinterpret_cast<__m128i*>(out), encode8<T>(_mm256_load_ps(in)));
        std::memcpy(dst + i, out, n - i);
    }
}

template <class T>
static inline void decode(const T* src, float* dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, decode8<T>(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i))));
    if (i < n) {
        alignas(16) uint8_t in[16] = {};
        alignas(32) float out[8];
        std::memcpy(in, src + i, n - i);
        _mm256_store_ps(out, decode8<T>(_mm_load_si128(reinterpret_cast<const __m128i*>(in))));
        std::memcpy(dst + i, out, sizeof(float) * (n - i));
    }
}

}  // namespace fp8

namespace q8 {

// n floats (a multiple of 32) -> n / 32 blocks.
static inline void encode(KvQ8* dst, const float* src, int n) {
    const __m256 sign_bit = _mm256_set1_ps(-0.f);
    for (int b = 0; b < n / 32; ++b) {
        const float* x = src + 32 * b;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + 8 * j), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[j]));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int j = 0; j < 4; ++j)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // int32 -> int8 (llama.cpp's sequence): the packs interleave 128-bit lanes, the permute restores the order
        const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[b].q),
                            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        dst[b].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
}

// n / 32 blocks -> n floats.
static inline void decode(const KvQ8* src, float* dst, int n) {
    for (int b = 0; b < n / 32; ++b) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(src[b].d));
        for (int j = 0; j < 4; ++j) {
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src[b].q + 8 * j));
            _mm256_storeu_ps(dst + 32 * b + 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        }
    }
}

}  // namespace q8
}  // namespace tp
