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
// (lo & 0x0F) | (hi & 0x30) per byte: (A & C) | B is ternlog 0xEC.
static inline VI vsel_lo4_hi2(VI lo, VI hi) {
    return _mm512_ternarylogic_epi32(lo, _mm512_and_si512(hi, vbyte(0x30)), vbyte(0x0F), 0xEC);
}
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
static inline VI vsel_lo4_hi2(VI lo, VI hi) { return vor(vand(lo, vbyte(0x0F)), vand(hi, vbyte(0x30))); }
#endif

// The 32-block's weights of chunk c (weights 4c..4c+3 of each lane's row), unsigned bytes.
// g: the group-block (Q5X16) or super-block (K-quants), o: the lane half's byte offset, k: the
// 32-block within the super-block.
template <int WT, int k>
static inline VI kq_weights(const uint8_t* g, int o, int c) {
    const VI m4 = vbyte(0x0F);
    if constexpr (WT == W_Q5X16) {
        const VI raw = vload(g + 128 + 64 * (c & 3) + o), hb = vload(g + 64 + o);
        const VI q = vand(c < 4 ? raw : vsrl4(raw), m4);
        return vor(q, vsll16(vand(vsrl16(hb, 2 * (c & 3) + (c >> 2)), vbyte(1)), 4));
    } else if constexpr (WT == W_Q4KX16 || WT == W_Q5KX16) {
        const VI raw = vload(g + 320 + 512 * (k >> 1) + 64 * c + o);
        VI q = vand((k & 1) ? vsrl4(raw) : raw, m4);
        if constexpr (WT == W_Q5KX16) q = vor(q, vsll16(vand(vsrl16(vload(g + 2368 + 64 * c + o), k), vbyte(1)), 4));
        return q;
    } else {  // Q6KX16
        // Sub-block j's 2 high bits (bits 2j, 2j + 1 of the qh byte) go straight to bits 4-5 with
        // one 16-bit shift (none for j = 2): (lo & 0x0F) | (hi' & 0x30), one ternlog on AVX-512.
        constexpr int h = k >> 2, j = k & 3;
        VI lo = vload(g + 320 + 1024 * h + 512 * (j & 1) + 64 * c + o);
        VI hi = vload(g + 2368 + 512 * h + 64 * c + o);
        if constexpr (j >= 2) lo = vsrl4(lo);
        if constexpr (j == 0) hi = vsll16(hi, 4);
        else if constexpr (j == 1) hi = vsll16(hi, 2);
        else if constexpr (j == 3) hi = vsrl16(hi, 2);
        return vsel_lo4_hi2(lo, hi);
    }
}

// Integer dots of MR activation rows with chunks [c0, c1) of one 32-block (the whole block, or a
// half for Q6_K): isum[r] = dot (254 * dot + residual dot with RES).
#if TP_VNNI
template <int WT, int MR, bool RES, int k, int NH = 1>
static inline void kq_isum(const uint8_t* g, int o, int c0, int c1, const int8_t* const* qa,
                           const int8_t* const* qb, VI* isum) {
    // With few rows (decode) each sum runs as S interleaved chains, so that one chain of 8
    // dependent vpdpbusd does not wait on its latency (not measured apart from the other
    // changes). Integer sums: the same bits either way.
    constexpr int S = MR <= 2 ? 2 : 1;
    VI coarse[S][MR], fine[S][MR];
    for (int i = 0; i < S; ++i)
        for (int r = 0; r < MR; ++r) coarse[i][r] = fine[i][r] = vzero();
    for (int c = c0; c < c1; ++c) {
        const VI w = kq_weights<WT, k>(g, o, c);
        const int i = (c - c0) % S;
        for (int r = 0; r < MR; ++r) {
            coarse[i][r] = kq_dot(coarse[i][r], w, bcast4(qa[r] + 4 * c));
            if constexpr (RES) fine[i][r] = kq_dot(fine[i][r], w, bcast4(qb[r] + 4 * c));
        }
    }
    for (int i = 1; i < S; ++i)
        for (int r = 0; r < MR; ++r) coarse[0][r] = vadd32(coarse[0][r], coarse[i][r]), fine[0][r] = vadd32(fine[0][r], fine[i][r]);
    for (int r = 0; r < MR; ++r) isum[r] = RES ? combine(coarse[0][r], fine[0][r]) : coarse[0][r];
}
#else
// AVX2 has no u8 x s8 -> int32 multiply-add: maddubs gives int16 pair sums, and widening each
// chunk's with madd (the old kq_dot) cost a second multiply per chunk. Both multiplies issue on
// one port on Zen 2, so the kernel was bound by them. Here the pair sums of SPAN chunks add up in
// int16 first and one madd per SPAN chunks widens them; with the residual bytes that madd
// multiplies by 254 at the same time (combine() without its shifts). The bound that keeps the int16
// sums exact: |activation| <= 127 (quantize_row clamps both bytes), so a pair is at most
// 2 * 127 * qmax: Q4_K 3810 (8 chunks: 30480), 5-bit 7874 (4: 31496), Q6_K 16002 (2: 32004).
// The int32 results are the same integers as VNNI's, so the ISAs still agree bit for bit.
// AVX2 prompt steps of the default formats run kquant_unpacked.h's tiles instead (each group unpacked once).
template <int WT>
constexpr int kq_span() { return WT == W_Q4KX16 ? 8 : WT == W_Q6KX16 ? 2 : 4; }

// NH = 2 (AVX2 decode, any_tile2 in packed_impl.h): both 8-lane halves of each 64-byte chunk,
// isum[hh * MR + r]; each activation broadcast feeds NH maddubs.
template <int WT, int MR, bool RES, int k, int NH = 1>
static inline void kq_isum(const uint8_t* g, int o, int c0, int c1, const int8_t* const* qa,
                           const int8_t* const* qb, VI* isum) {
    constexpr int SPAN = kq_span<WT>(), R = NH * MR;
    const VI one16 = _mm256_set1_epi16(1), w254 = _mm256_set1_epi16(254);
    for (int r = 0; r < R; ++r) isum[r] = vzero();  // folded away: the first add is to zero
    // Q6_K (SPAN 2) takes each half's c loop as a runtime loop without this; unrolled, its offsets
    // are constants (decode Q6_K fine, one thread hot: 1.44 -> 1.32 ns a 32-block row). It unrolls
    // the 5-bit formats' 2 spans too (not measured: no default decode matrix is Q5_K; Q5_0's
    // prompt steps run kquant_unpacked.h).
#pragma GCC unroll 8
    for (int c = c0; c < c1; c += SPAN) {
        VI coarse[R], fine[R];
        for (int r = 0; r < R; ++r) coarse[r] = fine[r] = vzero();
        for (int j = c; j < c + SPAN; ++j) {
            VI w[NH];
            for (int hh = 0; hh < NH; ++hh) w[hh] = kq_weights<WT, k>(g, o + 4 * L * hh, j);
            for (int r0 = 0; r0 < MR; ++r0) {
                const VI x = bcast4(qa[r0] + 4 * j);
                for (int hh = 0; hh < NH; ++hh) {
                    coarse[hh * MR + r0] = _mm256_add_epi16(coarse[hh * MR + r0], _mm256_maddubs_epi16(w[hh], x));
                    if constexpr (NH > 1) pin_sum(coarse[hh * MR + r0]);  // see pin_sum
                }
                if constexpr (RES) {
                    const VI x2 = bcast4(qb[r0] + 4 * j);
                    for (int hh = 0; hh < NH; ++hh) {
                        fine[hh * MR + r0] = _mm256_add_epi16(fine[hh * MR + r0], _mm256_maddubs_epi16(w[hh], x2));
                        if constexpr (NH > 1) pin_sum(fine[hh * MR + r0]);
                    }
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            VI part = _mm256_madd_epi16(coarse[r], RES ? w254 : one16);
            if constexpr (RES) part = vadd32(part, _mm256_madd_epi16(fine[r], one16));
            isum[r] = vadd32(isum[r], part);
        }
    }
}
#endif

// Super-blocks ahead (see kq_block). The AVX-512 build reaches further: on the 2-core Zen 4 (AVX-512
// VNNI, ~35 GB/s) the ~1B Q4_K_M's decode step ran 0.83-0.97x the time with 8 ahead as with 2 (four
// interleaved A/B runs, one process, bit-identical logits), and 16 measured as 8; the AVX2 hosts
// (Zen 3) keep the 2 they were measured with (4 about as 2 there).
constexpr size_t kPrefetchAhead = TP_VNNI ? 8 : 2;

// One 32-block b (sub-block k of its super-block, or k = 0 for Q5X16) of MR activation rows against
// lanes [h * L, h * L + NH * L) of one 16-row group, added into acc[hh * MR + r] (see the formulas
// above). k is a template argument so that every shift and offset of the weight unpacking is a
// constant.
template <int WT, int MR, bool RES, int k, int NH>
static inline void kq_block(const uint8_t* g, int h, const QAct& a, const int* rows, int b, const VF* dw, const VF* dm, VF* acc) {
    const int nb = a.nb, o = 4 * L * h;
    if constexpr (NH > 1) asm volatile("" ::: "memory");  // see kOnePass (packed_impl.h)
    if constexpr (WT != W_Q5X16 && MR <= 2) {
        // Decode streams the weights from memory once. Q6_K's super-block is read out of address
        // order (low nibbles, high bits, then the next sub-block's planes), and the hardware
        // prefetchers then fetched it at about a third of the bandwidth Q4_K got: each sub-block
        // prefetches its eighth of the super-block kPrefetchAhead ahead (the next group's first
        // ones at a group's end: a thread's groups are consecutive in memory). Measured on a Q6_K
        // LM head, one thread: 6.5 -> 17-19 GB/s with residual bytes (into L1). Into L2 instead
        // (T1), and for int8 activations too (the int8-only kernel once got slower with the L1
        // prefetch, 7.5 -> 6 GB/s), every K-quant decode matrix of the ~4B Q4_K_M reads faster:
        // benchmarks/results/kquant_prefetch_l2-loaded.md (all matrices, one thread's CPU time:
        // fine 224 -> 192 ms per token, int8 202 -> 176 ms). L1 is then left to the lines being
        // unpacked; 4 super-blocks ahead measured about as 2, 1 ahead lost most of the gain.
        constexpr size_t GB = WT == W_Q4KX16 ? 2368 : WT == W_Q5KX16 ? 2880 : 3392, LINES = (GB / 64 + 7) / 8;
        const uint8_t* pf = g + kPrefetchAhead * GB + k * LINES * 64;
        for (size_t i = 0; i < LINES; ++i) _mm_prefetch(reinterpret_cast<const char*>(pf + 64 * i), _MM_HINT_T1);
    }
    const int8_t* qa[MR];
    const int8_t* qb[MR];
    VI isum[NH * MR];
    for (int r = 0; r < MR; ++r) {
        qa[r] = a.q + (size_t(rows[r]) * nb + b) * QK;
        qb[r] = RES ? a.q2 + (size_t(rows[r]) * nb + b) * QK : nullptr;
    }
    if constexpr (WT == W_Q6KX16) {
        for (int half = 0; half < 2; ++half) {
            kq_isum<WT, MR, RES, k, NH>(g, o, 4 * half, 4 * half + 4, qa, qb, isum);
            VF dsc[NH];
            for (int hh = 0; hh < NH; ++hh) dsc[hh] = vmul(dw[hh], vcvt(vi8(g + 64 + 16 * (2 * k + half) + L * (h + hh))));
            for (int r = 0; r < MR; ++r) {  // a row's scales broadcast once for the NH halves
                const size_t ab = size_t(rows[r]) * nb + b;
                const VI off = vset32(32 * a.qsum16[2 * ab + half]);
                const VF da = vfset(a.d[ab]);
                for (int hh = 0; hh < NH; ++hh)
                    acc[hh * MR + r] = vfma(vcvt(vsub32(isum[hh * MR + r], off)), vmul(dsc[hh], da), acc[hh * MR + r]);
            }
        }
    } else {
        kq_isum<WT, MR, RES, k, NH>(g, o, 0, 8, qa, qb, isum);
        VF dsc[NH], mw[NH];
        for (int hh = 0; hh < NH; ++hh) {
            if constexpr (WT == W_Q5X16) {
                dsc[hh] = dw[hh];
                mw[hh] = vhalf(g + 32 + 2 * L * (h + hh));
            } else {
                dsc[hh] = vmul(dw[hh], vcvt(vu8(g + 64 + 16 * k + L * (h + hh))));
                mw[hh] = vmul(dm[hh], vcvt(vsub32(vzero(), vu8(g + 192 + 16 * k + L * (h + hh)))));
            }
        }
        for (int r = 0; r < MR; ++r) {
            const size_t ab = size_t(rows[r]) * nb + b;
            const VF da = vfset(a.d[ab]), sa = vfset(a.s[ab]);
            for (int hh = 0; hh < NH; ++hh) {
                acc[hh * MR + r] = vfma(vcvt(isum[hh * MR + r]), vmul(dsc[hh], da), acc[hh * MR + r]);
                acc[hh * MR + r] = vfma(mw[hh], sa, acc[hh * MR + r]);
            }
        }
    }
}

// The 8 sub-blocks of super-block sb, in order.
template <int WT, int MR, bool RES, int NH, int... K>
static inline void kq_super(const uint8_t* g, int h, const QAct& a, const int* rows, int sb, VF* acc,
                            std::integer_sequence<int, K...>) {
    VF dw[NH], dm[NH];
    for (int hh = 0; hh < NH; ++hh) {
        dw[hh] = vhalf(g + 2 * L * (h + hh));
        dm[hh] = WT == W_Q6KX16 ? dw[hh] : vhalf(g + 32 + 2 * L * (h + hh));
    }
    (kq_block<WT, MR, RES, K, NH>(g, h, a, rows, kSuper * sb + K, dw, dm, acc), ...);
}

// Block dot products of MR activation rows against lanes [h * L, h * L + NH * L) of one 16-row
// group, over all nb 32-blocks (a K-quant row is whole super-blocks: nb a multiple of 8);
// out[hh * MR + r].
template <int WT, int MR, bool RES, int NH = 1>
static inline void kq_tile(const uint8_t* wg, int h, const QAct& a, const int* rows, VF* out) {
    constexpr int R = NH * MR;
    VF acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vfzero();
    if constexpr (WT == W_Q5X16) {
        for (int b = 0; b < a.nb; ++b, wg += 384) {
            VF dw[NH];
            for (int hh = 0; hh < NH; ++hh) dw[hh] = vhalf(wg + 2 * L * (h + hh));
            kq_block<WT, MR, RES, 0, NH>(wg, h, a, rows, b, dw, dw, acc);
        }
    } else {
        constexpr size_t GB = WT == W_Q4KX16 ? 2368 : WT == W_Q5KX16 ? 2880 : 3392;
        for (int sb = 0; sb < a.nb / kSuper; ++sb, wg += GB)
            kq_super<WT, MR, RES, NH>(wg, h, a, rows, sb, acc, std::make_integer_sequence<int, kSuper>{});
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// F16X16 / BF16X16 (1024 bytes per 16 rows x 32 weights: weight e of lane i at 32 e + 2 i) and
// F32X16 (2048 bytes: weight e of lane i at 64 e + 4 i): the float activations (QAct::f) times the
// weights (16-bit ones widened in registers), one FMA per weight and row, in K order on both ISAs.
template <int WT, int MR>
static inline void float_tile(const uint8_t* wg, int h, const QAct& a, const int* rows, VF* out) {
    constexpr int ES = WT == W_F32X16 ? 4 : 2;  // bytes per weight
    const int nb = a.nb;
    VF acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = vfzero();
    for (int b = 0; b < nb; ++b, wg += 16 * QK * ES) {
        const float* x[MR];
        for (int r = 0; r < MR; ++r) x[r] = a.f + (size_t(rows[r]) * nb + b) * QK;
        for (int e = 0; e < QK; ++e) {
            const uint8_t* p = wg + 16 * ES * e + ES * L * h;
            VF w;
            if constexpr (WT == W_F32X16) w = vfload(reinterpret_cast<const float*>(p));
            else if constexpr (WT == W_F16X16) w = vf16(p);
            else w = vbf16(p);
            for (int r = 0; r < MR; ++r) acc[r] = vfma(w, vfset(x[r][e]), acc[r]);
        }
    }
    for (int r = 0; r < MR; ++r) out[r] = acc[r];
}

