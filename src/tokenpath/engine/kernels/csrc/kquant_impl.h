// GEMM/GEMV on the 5-bit and K-quant repacks (Q5X16, Q4KX16, Q5KX16, Q6KX16; tp_repack in
// quant.cpp writes them). Included by packed_impl.h inside the ISA namespace, after its vector
// helpers, so it is compiled once per ISA like the Q4X16/Q8X16 kernels.
//
// The GGUF file's own numbers, not a re-quantization: the weight bytes are moved (16 rows
// interleaved, 4 weights of a row per 32-bit lane as in Q4X16), the fp16 super-block scales and
// the 6-bit / 8-bit sub-block scales are kept as stored, and the kernel multiplies the integer
// weights with the activation's int8 (+ residual) blocks exactly, in integers. K-quant
// sub-blocks of 32 (Q4_K, Q5_K) line up with the activation's 32-blocks; Q6_K's scale per 16
// weights takes the block's two halves separately (QAct::qsum16 carries their sums for the -32
// offset).
//
// Per 32-block b of weights (lane i = one output row) and activation row a:
//   Q5X16:   d_i * da * dot(q5, qa) + m_i * s_a                        (Q5_0: m = -16 d)
//   Q4KX16:  (d_i * sc_ik) * da * dot(q4, qa) - (dmin_i * mn_ik) * s_a   (Q5KX16: q5)
//   Q6KX16:  sum over halves h: (d_i * sc_i,2k+h) * da * (dot(q6, qa_h) - 32 sum(qa_h))
// with q unsigned (0..15, 0..31, 0..63) so VNNI's u8 x s8 multiply takes them as they are.
// Every lane sees the same integer sums and the same float operations in the same order on both
// ISAs (AVX2 runs 8 lanes at a time, AVX-512 16), so the results agree bit for bit, and a row's
// result does not depend on the other rows of its tile (batch invariance).
//
// Layouts, per 16-row group (offsets in bytes; "chunk c, lane i" = 4 bytes at 64 c + 4 i):
//   Q5X16, per 32-block (384): d[16] fp16 | m[16] fp16 | hbits: lane i byte j, bit 2c + h = the
//          5th bit of weight 16 h + 4 c + j (c = 0..3) | qs: chunk c = Q4X16's (low nibbles:
//          weights 4c+j, high: 16+4c+j).
//   Q4KX16 / Q5KX16, per super-block of 256 (2368 / 2880): d[16] fp16 | dmin[16] fp16 |
//          sc[8][16] u8 | mn[8][16] u8 (unpacked from the 12 packed bytes) | qs: sub-block pair p
//          at 320 + 512 p, chunk c = bytes 4c..4c+3 of the row's 32 qs bytes of the pair (low
//          nibbles: sub-block 2p, high: 2p+1) | Q5KX16: qh at 2368, chunk c = qh bytes 4c..4c+3
//          (bit k: sub-block k's 5th bit).
//   Q6KX16, per super-block (3392): d[16] fp16 | 32 padding | sc[16][16] i8 | ql at 320: half h,
//          j = 0, 1 at 1024 h + 512 j, chunk c = ql bytes 64h + 32j + 4c.. | qh at 2368: half h at
//          512 h, chunk c = qh bytes 32h + 4c.. (GGUF's Q6_K bit positions kept).

#if TP_VNNI
// L halfs (F16) or bfloat16s (BF16) -> L floats.
static inline VF vf16(const uint8_t* p) { return vhalf(p); }
static inline VF vbf16(const uint8_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
static inline VI vor(VI a, VI b) { return _mm512_or_si512(a, b); }
static inline VI vsrl16(VI a, int n) { return _mm512_srli_epi16(a, n); }
static inline VI vsll16(VI a, int n) { return _mm512_slli_epi16(a, n); }
static inline VI vu8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline VI vi8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline VI kq_dot(VI acc, VI u, VI s) { return vdot(acc, u, s); }
#else
static inline VF vf16(const uint8_t* p) { return vhalf(p); }
static inline VF vbf16(const uint8_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
static inline VI vor(VI a, VI b) { return _mm256_or_si256(a, b); }
static inline VI vsrl16(VI a, int n) { return _mm256_srli_epi16(a, n); }
static inline VI vsll16(VI a, int n) { return _mm256_slli_epi16(a, n); }
static inline VI vu8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
static inline VI vi8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
// |u| <= 63, so a maddubs pair is at most 2 * 63 * 127: no int16 saturation.
static inline VI kq_dot(VI acc, VI u, VI s) { return vadd32(acc, dot_us(u, s)); }
#endif

// The 32-block's weights of chunk c (weights 4c..4c+3 of each lane's row), unsigned bytes.
// g: the group-block (Q5X16) or super-block (K-quants), o: the lane half's byte offset, k: the
// 32-block within the super-block.
template <int WT>
static inline VI kq_weights(const uint8_t* g, int o, int k, int c) {
    const VI m4 = vbyte(0x0F);
    if constexpr (WT == W_Q5X16) {
        const VI raw = vload(g + 128 + 64 * (c & 3) + o), hb = vload(g + 64 + o);
        const VI q = vand(c < 4 ? raw : vsrl4(raw), m4);
        return vor(q, vsll16(vand(vsrl16(hb, 2 * (c & 3) + (c >> 2)), vbyte(1)), 4));
    } else if constexpr (WT == W_Q4KX16 || WT == W_Q5KX16) {
        const VI raw = vload(g + 320 + 512 * (k >> 1) + 64 * c + o);
        VI q = vand(k & 1 ? vsrl4(raw) : raw, m4);
        if constexpr (WT == W_Q5KX16) q = vor(q, vsll16(vand(vsrl16(vload(g + 2368 + 64 * c + o), k), vbyte(1)), 4));
        return q;
    } else {  // Q6KX16
        const int h = k >> 2, j = k & 3;
        const VI lo = vload(g + 320 + 1024 * h + 512 * (j & 1) + 64 * c + o);
        const VI hi = vload(g + 2368 + 512 * h + 64 * c + o);
        return vor(vand(vsrl16(lo, 4 * (j >> 1)), m4), vsll16(vand(vsrl16(hi, 2 * j), vbyte(3)), 4));
    }
}

// Integer dots of MR activation rows with chunks [c0, c1) of one 32-block (the whole block, or a
// half for Q6_K): isum[r] = dot (254 * dot + residual dot with RES).
template <int WT, int MR, bool RES>
static inline void kq_isum(const uint8_t* g, int o, int k, int c0, int c1, const int8_t* const* qa,
                           const int8_t* const* qb, VI* isum) {
    VI coarse[MR], fine[MR];
    for (int r = 0; r < MR; ++r) coarse[r] = fine[r] = vzero();
    for (int c = c0; c < c1; ++c) {
        const VI w = kq_weights<WT>(g, o, k, c);
        for (int r = 0; r < MR; ++r) {
            coarse[r] = kq_dot(coarse[r], w, bcast4(qa[r] + 4 * c));
            if constexpr (RES) fine[r] = kq_dot(fine[r], w, bcast4(qb[r] + 4 * c));
        }
    }
    for (int r = 0; r < MR; ++r) isum[r] = RES ? combine(coarse[r], fine[r]) : coarse[r];
}

// Block dot products of MR activation rows against lanes [h * L, h * L + L) of one 16-row group,
// over all nb 32-blocks (see the formulas above).
template <int WT, int MR, bool RES>
static inline void kq_tile(const uint8_t* wg, int h, const QAct& a, const int* rows, VF* out) {
    constexpr bool SUPER = WT != W_Q5X16;
    constexpr size_t GB = WT == W_Q5X16 ? 384 : WT == W_Q4KX16 ? 2368 : WT == W_Q5KX16 ? 2880 : 3392;
    const int nb = a.nb, o = 4 * L * h;
    VF acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = vfzero();
    const int8_t* qa[MR];
    const int8_t* qb[MR];
    VI isum[MR];
    for (int b = 0; b < nb; ++b) {
        const int k = SUPER ? b % kSuper : 0;
        const uint8_t* g = wg + (SUPER ? size_t(b / kSuper) : size_t(b)) * GB;
        for (int r = 0; r < MR; ++r) {
            qa[r] = a.q + (size_t(rows[r]) * nb + b) * QK;
            qb[r] = RES ? a.q2 + (size_t(rows[r]) * nb + b) * QK : nullptr;
        }
        const VF dw = vhalf(g + 2 * L * h);
        if constexpr (WT == W_Q6KX16) {
            for (int half = 0; half < 2; ++half) {
                kq_isum<WT, MR, RES>(g, o, k, 4 * half, 4 * half + 4, qa, qb, isum);
                const VF dsc = vmul(dw, vcvt(vi8(g + 64 + 16 * (2 * k + half) + L * h)));
                for (int r = 0; r < MR; ++r) {
                    const size_t ab = size_t(rows[r]) * nb + b;
                    const VI off = vset32(32 * a.qsum16[2 * ab + half]);
                    acc[r] = vfma(vcvt(vsub32(isum[r], off)), vmul(dsc, vfset(a.d[ab])), acc[r]);
                }
            }
        } else {
            kq_isum<WT, MR, RES>(g, o, k, 0, 8, qa, qb, isum);
            VF dsc = dw, mw;
            if constexpr (WT == W_Q5X16) {
                mw = vhalf(g + 32 + 2 * L * h);
            } else {
                dsc = vmul(dw, vcvt(vu8(g + 64 + 16 * k + L * h)));
                mw = vmul(vhalf(g + 32 + 2 * L * h), vcvt(vsub32(vzero(), vu8(g + 192 + 16 * k + L * h))));
            }
            for (int r = 0; r < MR; ++r) {
                const size_t ab = size_t(rows[r]) * nb + b;
                acc[r] = vfma(vcvt(isum[r]), vmul(dsc, vfset(a.d[ab])), acc[r]);
                acc[r] = vfma(mw, vfset(a.s[ab]), acc[r]);
            }
        }
    }
    for (int r = 0; r < MR; ++r) out[r] = acc[r];
}

// F16X16 / BF16X16 (1024 bytes per 16 rows x 32 weights: weight e of lane i at 32 e + 2 i): the
// float activations (QAct::f) times the weights widened in registers, one FMA per weight and row,
// in K order on both ISAs.
template <int WT, int MR>
static inline void float_tile(const uint8_t* wg, int h, const QAct& a, const int* rows, VF* out) {
    const int nb = a.nb;
    VF acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = vfzero();
    for (int b = 0; b < nb; ++b, wg += 1024) {
        const float* x[MR];
        for (int r = 0; r < MR; ++r) x[r] = a.f + (size_t(rows[r]) * nb + b) * QK;
        for (int e = 0; e < QK; ++e) {
            const VF w = WT == W_F16X16 ? vf16(wg + 32 * e + 2 * L * h) : vbf16(wg + 32 * e + 2 * L * h);
            for (int r = 0; r < MR; ++r) acc[r] = vfma(w, vfset(x[r][e]), acc[r]);
        }
    }
    for (int r = 0; r < MR; ++r) out[r] = acc[r];
}
