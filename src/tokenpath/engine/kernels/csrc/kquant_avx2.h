// AVX2 prompt GEMM on the 5-bit and K-quant repacks (Q5X16, Q4KX16, Q5KX16, Q6KX16): steps of
// more than kFewRows rows. Included by kquant_impl.h (AVX2 only), after kq_weights and kq_span.
//
// Why: kq_tile runs a 16-row group as two 8-lane halves, each a pass of every tile of activation
// rows, so each activation broadcast fed one maddubs and each row's block scales (da, s_a) were
// broadcast twice per group. Here a tile runs both halves at once: each broadcast feeds two
// maddubs, the weights of both halves are unpacked once per tile of MR rows, and the per-row
// scale broadcasts are halved. MR: what 16 ymm registers hold with 2 * MR int16 sums (4 * MR with
// residual bytes) and two weight vectors. Figures: benchmarks/results/avx2_prompt_gemm-loaded.md.
//
// Bits: every lane sees the same integer sums (exact; the int16 bound of kq_span holds per half)
// and the same float operations in the same order as kq_tile's (and so as the VNNI kernels'), and
// a row's operations do not depend on its tile: AVX2 == AVX-512 and batch invariance still hold.

template <int WT, int MR, bool RES, int k>
static inline void kq_isum2(const uint8_t* g, int c0, int c1, const int8_t* const* qa, const int8_t* const* qb,
                            VI (*isum)[MR]) {
    constexpr int SPAN = kq_span<WT>();
    const VI one16 = _mm256_set1_epi16(1), w254 = _mm256_set1_epi16(254);
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < MR; ++r) isum[h][r] = vzero();
    for (int c = c0; c < c1; c += SPAN) {
        VI coarse[2][MR], fine[2][MR];
        for (int h = 0; h < 2; ++h)
            for (int r = 0; r < MR; ++r) coarse[h][r] = fine[h][r] = vzero();
        for (int j = c; j < c + SPAN; ++j) {
            const VI w0 = kq_weights<WT, k>(g, 0, j), w1 = kq_weights<WT, k>(g, 4 * L, j);
            for (int r = 0; r < MR; ++r) {
                const VI x = bcast4(qa[r] + 4 * j);
                coarse[0][r] = _mm256_add_epi16(coarse[0][r], _mm256_maddubs_epi16(w0, x));
                coarse[1][r] = _mm256_add_epi16(coarse[1][r], _mm256_maddubs_epi16(w1, x));
                if constexpr (RES) {
                    const VI x2 = bcast4(qb[r] + 4 * j);
                    fine[0][r] = _mm256_add_epi16(fine[0][r], _mm256_maddubs_epi16(w0, x2));
                    fine[1][r] = _mm256_add_epi16(fine[1][r], _mm256_maddubs_epi16(w1, x2));
                }
            }
        }
        for (int h = 0; h < 2; ++h)
            for (int r = 0; r < MR; ++r) {
                VI part = _mm256_madd_epi16(coarse[h][r], RES ? w254 : one16);
                if constexpr (RES) part = vadd32(part, _mm256_madd_epi16(fine[h][r], one16));
                isum[h][r] = vadd32(isum[h][r], part);
            }
    }
}

// kq_block for both lane halves: acc[h][r] as kq_block's acc[r] for half h.
template <int WT, int MR, bool RES, int k>
static inline void kq_block2(const uint8_t* g, const QAct& a, const int* rows, int b, const VF* dw, const VF* dm,
                             VF (*acc)[MR]) {
    const int nb = a.nb;
    const int8_t* qa[MR];
    const int8_t* qb[MR];
    VI isum[2][MR];
    for (int r = 0; r < MR; ++r) {
        qa[r] = a.q + (size_t(rows[r]) * nb + b) * QK;
        qb[r] = RES ? a.q2 + (size_t(rows[r]) * nb + b) * QK : nullptr;
    }
    if constexpr (WT == W_Q6KX16) {
        for (int half = 0; half < 2; ++half) {
            kq_isum2<WT, MR, RES, k>(g, 4 * half, 4 * half + 4, qa, qb, isum);
            VF dsc[2];
            for (int h = 0; h < 2; ++h) dsc[h] = vmul(dw[h], vcvt(vi8(g + 64 + 16 * (2 * k + half) + L * h)));
            for (int r = 0; r < MR; ++r) {
                const size_t ab = size_t(rows[r]) * nb + b;
                const VI off = vset32(32 * a.qsum16[2 * ab + half]);
                const VF da = vfset(a.d[ab]);
                for (int h = 0; h < 2; ++h) acc[h][r] = vfma(vcvt(vsub32(isum[h][r], off)), vmul(dsc[h], da), acc[h][r]);
            }
        }
    } else {
        kq_isum2<WT, MR, RES, k>(g, 0, 8, qa, qb, isum);
        VF dsc[2], mw[2];
        for (int h = 0; h < 2; ++h) {
            if constexpr (WT == W_Q5X16) {
                dsc[h] = dw[h];
                mw[h] = vhalf(g + 32 + 2 * L * h);
            } else {
                dsc[h] = vmul(dw[h], vcvt(vu8(g + 64 + 16 * k + L * h)));
                mw[h] = vmul(dm[h], vcvt(vsub32(vzero(), vu8(g + 192 + 16 * k + L * h))));
            }
        }
        for (int r = 0; r < MR; ++r) {
            const size_t ab = size_t(rows[r]) * nb + b;
            const VF da = vfset(a.d[ab]), sa = vfset(a.s[ab]);
            for (int h = 0; h < 2; ++h) {
                acc[h][r] = vfma(vcvt(isum[h][r]), vmul(dsc[h], da), acc[h][r]);
                acc[h][r] = vfma(mw[h], sa, acc[h][r]);
            }
        }
    }
}

template <int WT, int MR, bool RES, int... K>
static inline void kq_super2(const uint8_t* g, const QAct& a, const int* rows, int sb, VF (*acc)[MR],
                             std::integer_sequence<int, K...>) {
    const VF dw[2] = {vhalf(g), vhalf(g + 2 * L)};
    const VF dm[2] = {WT == W_Q6KX16 ? dw[0] : vhalf(g + 32), WT == W_Q6KX16 ? dw[1] : vhalf(g + 32 + 2 * L)};
    (kq_block2<WT, MR, RES, K>(g, a, rows, kSuper * sb + K, dw, dm, acc), ...);
}

// MR rows from m0 against all 16 lanes of one group; out[h][r]: lanes 8 h .. 8 h + 7 of row m0 + r.
template <int WT, int MR, bool RES>
static inline void kq_tile2(const uint8_t* wg, const QAct& a, int m0, VF (*out)[8]) {
    int rows[MR];
    for (int r = 0; r < MR; ++r) rows[r] = m0 + r;
    VF acc[2][MR];
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < MR; ++r) acc[h][r] = vfzero();
    if constexpr (WT == W_Q5X16) {
        for (int b = 0; b < a.nb; ++b, wg += 384) {
            const VF dw[2] = {vhalf(wg), vhalf(wg + 2 * L)};
            kq_block2<WT, MR, RES, 0>(wg, a, rows, b, dw, dw, acc);
        }
    } else {
        constexpr size_t GB = WT == W_Q4KX16 ? 2368 : WT == W_Q5KX16 ? 2880 : 3392;
        for (int sb = 0; sb < a.nb / kSuper; ++sb, wg += GB)
            kq_super2<WT, MR, RES>(wg, a, rows, sb, acc, std::make_integer_sequence<int, kSuper>{});
    }
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < MR; ++r) out[h][r] = acc[h][r];
}

// Rows per tile of the prompt kernel, by format and precision (RES: int8 with residual bytes); 0:
// the format keeps kq_tile's two passes. Measured (one thread's CPU time, interleaved A/B against
// kq_tile on this 2-core Zen 3, loaded): Q4_K int8 MR 6 ran at 0.84-0.90x kq_tile's time (MR 3 and
// 4 lost), Q6_K fine MR 2 at 0.83-0.85x (3: 0.9, 4: 0.87-1.07), Q5_0 fine MR 3 at 0.85-0.95x.
// Q4_K fine lost at every MR (2: 1.14-1.32x, 3: 1.07-1.14x, 4: 1.16-1.26x) and Q5_0 int8 at MR
// 3-6 (1.03-1.16x): both keep kq_tile. Q5_K and Q6_K int8 (no default prompt matrix) were not
// measured and keep it too.
template <int WT, bool RES>
constexpr int kPromptMR = WT == W_Q4KX16 ? (RES ? 0 : 6) : WT == W_Q6KX16 ? (RES ? 2 : 0) : WT == W_Q5X16 ? (RES ? 3 : 0) : 0;

template <int WT, bool RES>
static inline void kq_tile2_of(int mr, const uint8_t* wg, const QAct& a, int m0, VF (*out)[8]) {
    constexpr int MR = kPromptMR<WT, RES>;
    static_assert(MR <= 6, "the tails below go to 5 rows");
    switch (mr) {
        case 1: return kq_tile2<WT, 1, RES>(wg, a, m0, out);
        case 2: if constexpr (MR > 2) return kq_tile2<WT, 2, RES>(wg, a, m0, out); break;
        case 3: if constexpr (MR > 3) return kq_tile2<WT, 3, RES>(wg, a, m0, out); break;
        case 4: if constexpr (MR > 4) return kq_tile2<WT, 4, RES>(wg, a, m0, out); break;
        case 5: if constexpr (MR > 5) return kq_tile2<WT, 5, RES>(wg, a, m0, out); break;
        default: break;
    }
}

// y[m, n0..n1) for M > kFewRows rows (formats with kPromptMR > 0); groups outermost, as
// packed_gemm_t: a group's weights stay in L1/L2 while every tile of rows passes over them.
template <int WT, bool RES>
static void kq_gemm2(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                     const float* bias, bool accumulate) {
    const size_t GB = group_block_bytes(WT);
    VF out[2][8];
    constexpr int MR = kPromptMR<WT, RES>;
    for (int g = n0 / 16; g < n1 / 16; ++g) {
        const uint8_t* wg = w + size_t(g) * nb * GB;
        const int n = 16 * g;
        const VF vb[2] = {bias ? vfload(bias + n) : vfzero(), bias ? vfload(bias + n + L) : vfzero()};
        for (int m0 = 0; m0 < M;) {
            const int mr = M - m0 < MR ? M - m0 : MR;  // MR, then what is left
            if (mr == MR) kq_tile2<WT, MR, RES>(wg, a, m0, out);
            else kq_tile2_of<WT, RES>(mr, wg, a, m0, out);
            for (int r = 0; r < mr; ++r)
                for (int h = 0; h < 2; ++h) {
                    float* dst = y + size_t(m0 + r) * ldy + n + L * h;
                    VF v = vfadd(out[h][r], vb[h]);
                    if (accumulate) v = vfadd(v, vfload(dst));
                    vfstore(dst, v);
                }
            m0 += mr;
        }
    }
}
