// GEMM/GEMV on weights repacked 8 rows at a time (Q4X8, Q8X8; see tp_repack in quant.cpp).
// Included by dot_impl.h inside its namespace, so it is compiled once per ISA (TP_VNNI).
//
// Why repack: with GGUF's row-major blocks, one 256-bit integer dot covers one weight row, so
// every (activation row, weight row, block) pays its own float conversion, scale multiply and FMA,
// and every output a horizontal sum. That bookkeeping, not the integer multiplies, bounded the
// old kernel at ~140 GFLOP/s for prefill on 2 cores. Interleaved, one register holds 4 weights of
// each of 8 rows, the activation's 4 bytes are broadcast, and the 8 lanes are 8 outputs: a
// block's integer dot for 8 rows is 8 multiply-adds, its scales are one vector FMA, and the
// outputs leave as one store. The same loop serves decode (M = 1), where it also reads each
// weight byte once, in order.
//
// Layout of one group-block (8 rows x 32 weights), the group's blocks in K order:
//   Q4X8: d[8] fp16, m[8] fp16 (Q4_0's m = -8 d), then 128 bytes: byte c*32 + i*4 + j holds row
//         i's weights 4c+j (low nibble) and 16+4c+j (high nibble), c = 0..3: each GGUF qs byte of
//         row i moved, not changed.
//   Q8X8: d[8] fp16, then 256 bytes: byte c*32 + i*4 + j = row i's weight 4c+j, c = 0..7.
static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// Integer block dots of MR activation rows (qa[r]: a block's 32 int8 values) against one 8-row
// group-block: isum[r] lane i = dot(row i's weights, qa[r]). For Q8X8 on VNNI the weights enter
// as w + 128, so the caller takes 128 * sum(q_a) off.
template <int WT, int MR>
static inline void packed_isum(const uint8_t* wg, const int8_t* const* qa, __m256i* isum) {
    for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
    if constexpr (WT == W_Q4X8) {
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        const uint8_t* qs = wg + 32;
#if !TP_VNNI
        // u4 * s8 pairs: |maddubs lane| <= 2*15*127, so 8 of them still fit int16.
        __m256i s16[MR];
        for (int r = 0; r < MR; ++r) s16[r] = _mm256_setzero_si256();
#endif
        for (int c = 0; c < 4; ++c) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
            const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            for (int r = 0; r < MR; ++r) {
                const __m256i x0 = bcast4(qa[r] + 4 * c), x1 = bcast4(qa[r] + 16 + 4 * c);
#if TP_VNNI
                isum[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(isum[r], lo, x0), hi, x1);
#else
                s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0),
                                                                   _mm256_maddubs_epi16(hi, x1)));
#endif
            }
        }
#if !TP_VNNI
        for (int r = 0; r < MR; ++r) isum[r] = _mm256_madd_epi16(s16[r], _mm256_set1_epi16(1));
#endif
    } else {  // Q8X8: signed weights
        const uint8_t* qs = wg + 16;
        for (int c = 0; c < 8; ++c) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
#if TP_VNNI
            // w ^ 0x80 = w + 128 as unsigned bytes; the int32 sums cannot overflow.
            const __m256i wu = _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80)));
            for (int r = 0; r < MR; ++r) isum[r] = _mm256_dpbusd_epi32(isum[r], wu, bcast4(qa[r] + 4 * c));
#else
            // maddubs would saturate on (w + 128) * q_a pairs: the sign trick keeps |w| unsigned.
            const __m256i wa = _mm256_sign_epi8(w, w);
            for (int r = 0; r < MR; ++r)
                isum[r] = _mm256_add_epi32(isum[r], dot_us(wa, _mm256_sign_epi8(bcast4(qa[r] + 4 * c), w)));
#endif
        }
    }
}

// Both passes of a Q4X8 block at once (RES): each weight register is unpacked once and meets the
// int8 values and the residual bytes; isum[r] = 254 * dot(q) + dot(q2).
template <int MR>
static inline void packed_isum_fine_q4(const uint8_t* wg, const int8_t* const* qa, const int8_t* const* qb,
                                       __m256i* isum) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const uint8_t* qs = wg + 32;
    __m256i coarse[MR], fine[MR];
    for (int r = 0; r < MR; ++r) coarse[r] = fine[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        for (int r = 0; r < MR; ++r) {
#if TP_VNNI
            coarse[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(coarse[r], lo, bcast4(qa[r] + 4 * c)), hi,
                                            bcast4(qa[r] + 16 + 4 * c));
            fine[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(fine[r], lo, bcast4(qb[r] + 4 * c)), hi,
                                          bcast4(qb[r] + 16 + 4 * c));
#else
            coarse[r] = _mm256_add_epi16(coarse[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(qa[r] + 4 * c)),
                                                                     _mm256_maddubs_epi16(hi, bcast4(qa[r] + 16 + 4 * c))));
            fine[r] = _mm256_add_epi16(fine[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(qb[r] + 4 * c)),
                                                                 _mm256_maddubs_epi16(hi, bcast4(qb[r] + 16 + 4 * c))));
#endif
        }
    }
    for (int r = 0; r < MR; ++r) {
#if !TP_VNNI
        coarse[r] = _mm256_madd_epi16(coarse[r], _mm256_set1_epi16(1));
        fine[r] = _mm256_madd_epi16(fine[r], _mm256_set1_epi16(1));
#endif
        isum[r] = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(coarse[r], 8), _mm256_slli_epi32(coarse[r], 1)),
                                   fine[r]);
    }
}

// Block dot products of MR activation rows against one 8-row group, over all nb blocks:
// out[r] (8 floats) = sum_b d_w*d_a*dot(q_w, q_a) + m_w*s_a (Q4) or d_w*d_a*dot (Q8).
// RES (the activations' residual bytes a.q2, see QAct): q_a = 254 q + q2, formed in integers.
// Every row's operations are the same whatever MR is, so results do not depend on the batch, and
// the integer sums are exact, so AVX2 and VNNI agree bit for bit.
template <int WT, int MR, bool RES>
static inline void packed_tile(const uint8_t* wg, const QAct& a, const int* rows, __m256* out) {
    constexpr size_t GB = WT == W_Q4X8 ? 160 : 272;
    const int nb = a.nb;
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b, wg += GB) {
        const int8_t* qa[MR];
        __m256i isum[MR];
        for (int r = 0; r < MR; ++r) qa[r] = a.q + (size_t(rows[r]) * nb + b) * QK;
        if constexpr (RES && WT == W_Q4X8) {
            const int8_t* qb[MR];
            for (int r = 0; r < MR; ++r) qb[r] = a.q2 + (size_t(rows[r]) * nb + b) * QK;
            packed_isum_fine_q4<MR>(wg, qa, qb, isum);
        } else {
            packed_isum<WT, MR>(wg, qa, isum);
        }
        if constexpr (RES && WT == W_Q8X8) {
            __m256i fine[MR];
            for (int r = 0; r < MR; ++r) qa[r] = a.q2 + (size_t(rows[r]) * nb + b) * QK;
            packed_isum<WT, MR>(wg, qa, fine);
            for (int r = 0; r < MR; ++r)  // 254 * isum + fine
                isum[r] = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(isum[r], 8), _mm256_slli_epi32(isum[r], 1)),
                                           fine[r]);
        }
#if TP_VNNI
        if constexpr (WT == W_Q8X8)
            for (int r = 0; r < MR; ++r)
                isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(128 * a.qsum[size_t(rows[r]) * nb + b]));
#endif
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg)));
        for (int r = 0; r < MR; ++r) {
            const size_t ab = size_t(rows[r]) * nb + b;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[ab])), acc[r]);
        }
        if constexpr (WT == W_Q4X8) {
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16)));
            for (int r = 0; r < MR; ++r)
                acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[size_t(rows[r]) * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < MR; ++r) out[r] = acc[r];
}

// y[m, n0..n1) for all M rows; n0 and n1 multiples of 8 (gemm_team hands out multiples of 16).
// Groups outermost: a group's weights (nb * 160 or 272 bytes) stay in L1 while every tile of
// activation rows passes over them.
template <int WT, bool RES>
static void packed_gemm_t(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                          const float* bias, bool accumulate) {
    constexpr size_t GB = WT == W_Q4X8 ? 160 : 272;
    // 32 vector registers with AVX-512 VL, 16 without; the residual pass doubles the integer sums held.
    constexpr int MR = TP_VNNI && !RES ? 8 : 4;
    int rows[MR];
    __m256 out[MR];
    for (int g = n0 / 8; g < n1 / 8; ++g) {
        const uint8_t* wg = w + size_t(g) * nb * GB;
        const __m256 vb = bias ? _mm256_loadu_ps(bias + 8 * g) : _mm256_setzero_ps();
        auto store = [&](int m, __m256 v) {
            float* dst = y + size_t(m) * ldy + 8 * g;
            v = _mm256_add_ps(v, vb);
            if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(dst));
            _mm256_storeu_ps(dst, v);
        };
        int m0 = 0;
        for (; m0 + MR <= M; m0 += MR) {
            for (int r = 0; r < MR; ++r) rows[r] = m0 + r;
            packed_tile<WT, MR, RES>(wg, a, rows, out);
            for (int r = 0; r < MR; ++r) store(m0 + r, out[r]);
        }
        for (int rest; (rest = M - m0) > 0;) {  // the tail in tiles of 4, 2, 1 rows
            const int mr = rest >= 4 ? 4 : rest >= 2 ? 2 : 1;
            for (int r = 0; r < mr; ++r) rows[r] = m0 + r;
            if (mr == 4) packed_tile<WT, 4, RES>(wg, a, rows, out);
            else if (mr == 2) packed_tile<WT, 2, RES>(wg, a, rows, out);
            else packed_tile<WT, 1, RES>(wg, a, rows, out);
            for (int r = 0; r < mr; ++r) store(m0 + r, out[r]);
            m0 += mr;
        }
    }
}

template <int WT>
static void packed_gemm(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                        const float* bias, bool accumulate) {
    if (a.q2) packed_gemm_t<WT, true>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    else packed_gemm_t<WT, false>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
}
