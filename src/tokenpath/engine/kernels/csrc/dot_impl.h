// The block dot-product kernels, included by dot_avx2.cpp (TP_VNNI 0) and dot_avx512.cpp
// (TP_VNNI 1, AVX-512 VL + VNNI: one vpdpbusd replaces maddubs + madd). 256-bit vectors in both:
// one 32-weight block per register; on Zen 4 512-bit ops are double-pumped anyway.
//
// Per block b of weight row n and activation row m:
//   Q4_1: d_w*d_a*dot(u4, q8) + m_w * (d_a*sum q8)       u4 in 0..15
//   Q4_0: d_w*d_a*dot(u4, q8) - 8 * d_w * (d_a*sum q8)   (weight = u4 - 8)
//   Q8_0: d_w*d_a*dot(q8w, q8a), with the sign trick: dot(|w|, sign(a, w)) keeps maddubs' unsigned
//         operand non-negative without overflowing int16 (|w| <= 127).
// A tile of MR activation rows shares each unpacked weight block (GEMM reuse; MR=1 is decode).
#include <immintrin.h>

#include <cmath>
#include <utility>
#include <vector>  // kquant_unpacked.h: a GEMM call's unpacked group

#include "tp_kernels.h"
#include "vec_math.h"

namespace TP_NS {
using namespace tp;

using vec::hsum8;

// 254 * coarse + fine: the integer dot of an activation block with residual bytes (QAct::q2).
static inline __m256i combine(__m256i coarse, __m256i fine) {
    return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(coarse, 8), _mm256_slli_epi32(coarse, 1)), fine);
}

// 4 x 8 int32 (each within int8) -> 32 int8 in order (packs interleave 128-bit lanes; the
// permute puts them back).
static inline __m256i pack_i8(const __m256i* v) {
    const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The sum of 4 x 8 int32.
static inline int32_t sum_i32(const __m256i* v) {
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    return _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
}

// Signed int32 lanes of sum(u[i] * s[i]) over groups of 4 bytes: u unsigned, s signed.
static inline __m256i dot_us(__m256i u, __m256i s) {
#if TP_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float h2f(const uint8_t* p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// 16 packed bytes -> 32 unsigned nibbles in element order (low nibbles are elements 0..15).
static inline __m256i unpack_q4(const uint8_t* qs) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}

template <int WT, int MR>
static inline void tile(const uint8_t* w, const QAct& a, int m0, float* out) {
    constexpr size_t BB = WT == W_Q4_0 ? 18 : WT == W_Q4_1 ? 20 : 34;
    const int nb = a.nb;
    __m256 acc[MR];
    float corr[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps(), corr[r] = 0.f;
    for (int b = 0; b < nb; ++b, w += BB) {
        const float dw = h2f(w);
        __m256i wu;
        __m256i wsgn = _mm256_setzero_si256();
        if constexpr (WT == W_Q8_0) {
            wsgn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
            wu = _mm256_sign_epi8(wsgn, wsgn);  // |w|
        } else {
            wu = unpack_q4(w + (WT == W_Q4_1 ? 4 : 2));
        }
        const float mw = WT == W_Q4_1 ? h2f(w + 2) : WT == W_Q4_0 ? -8.f * dw : 0.f;
        for (int r = 0; r < MR; ++r) {
            const size_t row = size_t(m0 + r) * nb;
            __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (row + b) * QK));
            if constexpr (WT == W_Q8_0) q = _mm256_sign_epi8(q, wsgn);
            __m256i dq = dot_us(wu, q);
            if (a.q2) {  // residual bytes (see QAct)
                __m256i q2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q2 + (row + b) * QK));
                if constexpr (WT == W_Q8_0) q2 = _mm256_sign_epi8(q2, wsgn);
                dq = combine(dq, dot_us(wu, q2));
            }
            __m256 p = _mm256_cvtepi32_ps(dq);
            acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * a.d[row + b]), acc[r]);
            if constexpr (WT != W_Q8_0) corr[r] += mw * a.s[row + b];
        }
    }
    for (int r = 0; r < MR; ++r) out[r] = hsum8(acc[r]) + corr[r];
}

// The exact variant: float activations against weights dequantized in registers (no int8 rounding
// of the activations). Each block becomes 4 x 8 floats once (w = d*q + m, with m = -8d for Q4_0 and
// 0 for Q8_0), then every activation row of the tile costs 4 FMAs per block.
template <int WT, int MR>
static inline void tile_f32(const uint8_t* w, const QAct& a, int m0, float* out) {
    constexpr size_t BB = WT == W_Q4_0 ? 18 : WT == W_Q4_1 ? 20 : 34;
    const int nb = a.nb;
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b, w += BB) {
        const float dw = h2f(w);
        __m256i q;  // the block's 32 integer weights as bytes (nibbles 0..15 for Q4: sign-safe)
        if constexpr (WT == W_Q8_0) q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
        else q = unpack_q4(w + (WT == W_Q4_1 ? 4 : 2));
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        const __m256 vd = _mm256_set1_ps(dw);
        const __m256 vm = _mm256_set1_ps(WT == W_Q4_1 ? h2f(w + 2) : WT == W_Q4_0 ? -8.f * dw : 0.f);
        const __m256 wf[4] = {
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), vd, vm),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), vd, vm),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), vd, vm),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), vd, vm)};
        for (int r = 0; r < MR; ++r) {
            const float* x = a.f + (size_t(m0 + r) * nb + b) * QK;
            for (int j = 0; j < 4; ++j) acc[r] = _mm256_fmadd_ps(wf[j], _mm256_loadu_ps(x + 8 * j), acc[r]);
        }
    }
    for (int r = 0; r < MR; ++r) out[r] = hsum8(acc[r]);
}

template <int WT, bool EXACT, int MR>
static inline void tile_any(const uint8_t* w, const QAct& a, int m0, float* out) {
    if constexpr (EXACT) tile_f32<WT, MR>(w, a, m0, out);
    else tile<WT, MR>(w, a, m0, out);
}

template <int WT, bool EXACT>
static void gemm_t(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                   const float* bias, bool accumulate) {
    const size_t row_bytes = size_t(nb) * block_bytes(WT);
    float out[4];
    auto store = [&](int n, int m0, int mr) {
        const float bn = bias ? bias[n] : 0.f;
        for (int r = 0; r < mr; ++r) {
            float* dst = y + size_t(m0 + r) * ldy + n;
            *dst = (accumulate ? *dst : 0.f) + out[r] + bn;
        }
    };
    // Chunks of 16 weight rows stay in L1/L2 while every 4-row activation tile passes over them.
    for (int c0 = n0; c0 < n1; c0 += 16) {
        const int c1 = c0 + 16 < n1 ? c0 + 16 : n1;
        int m0 = 0;
        for (; m0 + 4 <= M; m0 += 4)
            for (int n = c0; n < c1; ++n) tile_any<WT, EXACT, 4>(w + n * row_bytes, a, m0, out), store(n, m0, 4);
        const int rest = M - m0;
        for (int n = c0; n < c1 && rest; ++n) {
            if (rest == 3) tile_any<WT, EXACT, 3>(w + n * row_bytes, a, m0, out);
            else if (rest == 2) tile_any<WT, EXACT, 2>(w + n * row_bytes, a, m0, out);
            else tile_any<WT, EXACT, 1>(w + n * row_bytes, a, m0, out);
            store(n, m0, rest);
        }
    }
}

#include "packed_impl.h"
#include "tile_pack.h"
#include "amx_int8.h"

int gemm_tiles(int wtype, bool fine, int M, int32_t* sizes) {
#if TP_VNNI
    if (const int n = amx_int8_tiles(wtype, M, sizes)) return n;
#endif
    return packed_tiles(wtype, fine, M, sizes);
}

void gemm_rows(int wtype, const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
               const float* bias, bool accumulate, bool exact) {
#if TP_VNNI
    // bf16 activations (forward.cpp sets QAct::bf only where amx_permitted() or bf16dot::runs()):
    // on AMX tiles BF16X16 weights every row, quantized ones the prompt rows (gemm_runs passes
    // QAct::bf only for them); without AMX, BF16X16 weights on VDPBF16PS and quantized ones keep
    // their int8 activations.
    if (a.bf) {
        if (amx_permitted()) {
            const amx::PackFn pack = wtype == W_BF16X16 ? nullptr : tile_packer(wtype);
            if (pack || wtype == W_BF16X16)
                return amx::gemm_tiles(pack, size_t(nb) * group_block_bytes(wtype), w, nb, a.bf, M, y, ldy, n0, n1,
                                       bias, accumulate);
        } else if (wtype == W_BF16X16 && bf16dot::runs()) {
            return bf16dot::gemm(w, nb, a.bf, M, y, ldy, n0, n1, bias, accumulate);
        }
    }
#endif
    // Repacked weights: int8 activations only (model.py keeps a float-activation matmul unpacked).
    // The 5-bit and K-quant types run repacked only (tp_repack), so they never reach the row kernels.
    if (wtype == W_Q4X16) return packed_gemm<W_Q4X16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    if (wtype == W_Q8X16) return packed_gemm<W_Q8X16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    if (wtype == W_Q5X16) return packed_gemm<W_Q5X16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
#if TP_VNNI
    // K-quants, several int8 rows (batched decode): AMX-INT8 tiles, the same bits (amx_int8.h).
    if (wtype == W_Q4KX16 && amx_int8_gemm<W_Q4KX16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate)) return;
    if (wtype == W_Q5KX16 && amx_int8_gemm<W_Q5KX16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate)) return;
    if (wtype == W_Q6KX16 && amx_int8_gemm<W_Q6KX16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate)) return;
#endif
    if (wtype == W_Q4KX16) return packed_gemm<W_Q4KX16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    if (wtype == W_Q5KX16) return packed_gemm<W_Q5KX16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    if (wtype == W_Q6KX16) return packed_gemm<W_Q6KX16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    if (wtype == W_F16X16) return packed_gemm<W_F16X16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
#if !TP_VNNI
    if (wtype == W_BF16X16) return float_gemm16<W_BF16X16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    if (wtype == W_F32X16) return float_gemm16<W_F32X16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
#endif
    if (wtype == W_BF16X16) return packed_gemm<W_BF16X16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    if (wtype == W_F32X16) return packed_gemm<W_F32X16>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    if (exact) {
        switch (wtype) {
            case W_Q4_0: return gemm_t<W_Q4_0, true>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
            case W_Q4_1: return gemm_t<W_Q4_1, true>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
            default: return gemm_t<W_Q8_0, true>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
        }
    }
    switch (wtype) {
        case W_Q4_0: return gemm_t<W_Q4_0, false>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
        case W_Q4_1: return gemm_t<W_Q4_1, false>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
        default: return gemm_t<W_Q8_0, false>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    }
}

// The float copies of one quantized block (QAct::f and fs, QAct::bf), where the row wants them.
static inline void float_copies(QAct& a, size_t off, const __m256* v) {
    if (a.bf) {  // bfloat16, rounded to nearest even (the AMX path's rows; finite activations)
        const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
        __m256i h[4];
        for (int j = 0; j < 4; ++j) {
            const __m256i u = _mm256_castps_si256(v[j]);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
            h[j] = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(half, odd)), 16);
        }
        uint16_t* dst = a.bf + off * QK;  // packus interleaves 128-bit lanes: the permute undoes it
        for (int j = 0; j < 2; ++j)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * j),
                                _mm256_permute4x64_epi64(_mm256_packus_epi32(h[2 * j], h[2 * j + 1]), 0xD8));
    }
    if (a.f) {  // the exact path's copy: padded floats and their block sum
        float* f = a.f + off * QK;
        __m256 t = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(f + 8 * j, v[j]), t = _mm256_add_ps(t, v[j]);
        a.fs[off] = hsum8(t);
    }
}

// Round-to-nearest symmetric int8 per 32-block: d = max|x| / 127 (llama.cpp's quantize_row_q8_1).
// Without QAct::q (a model whose every matrix is float: forward.cpp make_act) only the float copies.
void quantize_row(const float* x, int K, QAct& a, int r) {
    const int nb = a.nb;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int b = 0; b < nb; ++b) {
        alignas(32) float buf[QK];
        const int k0 = b * QK, n = K - k0 < QK ? K - k0 : QK;
        const float* src = x + k0;
        if (n < QK) {  // the tail block of a K that is not a multiple of 32
            for (int i = 0; i < QK; ++i) buf[i] = i < n ? src[i] : 0.f;
            src = buf;
        }
        __m256 v[4];
        if (!a.q) {
            for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(src + 8 * j);
            float_copies(a, size_t(r) * nb + b, v);
            continue;
        }
        __m256 mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(src + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.f;
        const __m256 id = _mm256_set1_ps(d > 0.f ? 127.f / amax : 0.f);
        __m256i i32[4];
        for (int j = 0; j < 4; ++j)
            i32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_ROUND_NEAREST | _MM_FROUND_NO_EXC));
        __m256i r32[4] = {};  // the residual bytes, when wanted (QAct::q2): d2 = d / 254
        float dsc = d;
        if (a.q2) {
            const __m256 vd = _mm256_set1_ps(d), id2 = _mm256_set1_ps(d > 0.f ? 254.f / d : 0.f);
            for (int j = 0; j < 4; ++j) {
                const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(i32[j]), vd, v[j]);
                r32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(rest, id2), _MM_ROUND_NEAREST | _MM_FROUND_NO_EXC));
                r32[j] = _mm256_max_epi32(_mm256_min_epi32(r32[j], _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
            }
            dsc = d / 254.f;
        }
        const size_t off = size_t(r) * nb + b;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q + off * QK), pack_i8(i32));
        a.qsum[off] = sum_i32(i32);
        if (a.q2) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q2 + off * QK), pack_i8(r32));
            a.qsum[off] = 254 * a.qsum[off] + sum_i32(r32);
            if (!TP_VNNI && a.q16) {  // 254 q + q2 as int16 (the AVX2 Q8X16 kernel's), in order: the
                // permute undoes the packs' 128-bit lane interleave
                __m256i c32[4];
                for (int j = 0; j < 4; ++j)
                    c32[j] = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(i32[j], 8), _mm256_slli_epi32(i32[j], 1)), r32[j]);
                int16_t* dst = a.q16 + off * QK;
                for (int j = 0; j < 2; ++j)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * j),
                                        _mm256_permute4x64_epi64(_mm256_packs_epi32(c32[2 * j], c32[2 * j + 1]), 0xD8));
            }
        }
        if (a.qsum16) {  // half-block sums (Q6_K's scale per 16 weights)
            const __m256i h0[4] = {i32[0], i32[1], _mm256_setzero_si256(), _mm256_setzero_si256()};
            const __m256i h1[4] = {i32[2], i32[3], _mm256_setzero_si256(), _mm256_setzero_si256()};
            a.qsum16[2 * off] = sum_i32(h0), a.qsum16[2 * off + 1] = sum_i32(h1);
            if (a.q2) {
                const __m256i f0[4] = {r32[0], r32[1], _mm256_setzero_si256(), _mm256_setzero_si256()};
                const __m256i f1[4] = {r32[2], r32[3], _mm256_setzero_si256(), _mm256_setzero_si256()};
                a.qsum16[2 * off] = 254 * a.qsum16[2 * off] + sum_i32(f0);
                a.qsum16[2 * off + 1] = 254 * a.qsum16[2 * off + 1] + sum_i32(f1);
            }
        }
        a.d[off] = dsc;
        a.s[off] = dsc * float(a.qsum[off]);
        float_copies(a, off, v);
    }
}

}  // namespace TP_NS
