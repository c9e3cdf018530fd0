// AVX2 prompt GEMM on unpacked groups (Q5X16, Q4KX16, Q6KX16): steps of more than kFewRows rows
// of the formats and precisions kUnpackMR names (packed_impl.h). Included by packed_impl.h (AVX2
// only), after kquant_impl.h's kq_weights and kq_span, store_tile and next_tile_rows.
//
// Why: kq_tile unpacks a group's weights (nibbles, 5th / 6th bits: 5-9 vector ops
// per 64-byte chunk) and rebuild its per-block scale vectors (fp16 and u8 conversions) for every
// tile of activation rows: at 512 rows and 3-6 rows per tile that is ~100 unpackings of the same
// bytes, and on AVX2 (no VNNI; maddubs + add per chunk and row) the unpacking was about half the
// vector ops of a tile. Here a group is unpacked once, into a buffer per 8-lane half (the tiles
// run one half at a time) of 32-blocks: 256 bytes of unsigned weights (chunk c lane i at 32 c +
// 4 i), then the block's two scale vectors as floats. Every tile reads plain bytes, one load per
// chunk, and a half's buffer (320 bytes per block: 20 KiB at K = 2048) stays in L1.
// Gemma 3 270M's Q5_0 matrices (q, k, gate, up) were half of its 512-token prefill's CPU time.
//
// Bits: the buffer holds the very vectors kq_weights returns and the scale products kq_block
// computes (the same vmul of the same operands), and every lane sees the same integer sums
// (exact; the int16 bound of kq_span holds) and the same float operations in the same order as
// kq_block's; a row's operations do not depend on its tile. So the outputs equal kq_tile's (and
// the VNNI kernels') bit for bit. Fine rows take ku_isum16's int16 dots on QAct::q16: the same
// integers, so the same bits too.

// Bytes per unpacked 32-block and lane half: 256 of weights, then 16 floats (Q5X16, Q4KX16:
// dsc[8], mw[8]; Q6KX16: dsc of the block's first 16 weights [8], of its second [8]).
constexpr size_t kUnpackedBlock = 256 + 16 * sizeof(float);

// Block k of a super-block (0 for Q5X16) at g into the halves' buffers: dst + h * half_bytes.
template <int WT, int k>
static inline void ku_unpack_block(const uint8_t* g, uint8_t* dst, size_t half_bytes) {
    for (int h = 0; h < 2; ++h) {
        uint8_t* d = dst + h * half_bytes;
        for (int c = 0; c < 8; ++c)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 32 * c), kq_weights<WT, k>(g, 4 * L * h, c));
        float* s = reinterpret_cast<float*>(d + 256);
        const VF dw = vhalf(g + 2 * L * h);
        if constexpr (WT == W_Q5X16) {
            vfstore(s, dw);
            vfstore(s + L, vhalf(g + 32 + 2 * L * h));
        } else if constexpr (WT == W_Q6KX16) {
            for (int half = 0; half < 2; ++half)
                vfstore(s + L * half, vmul(dw, vcvt(vi8(g + 64 + 16 * (2 * k + half) + L * h))));
        } else {
            const VF dm = vhalf(g + 32 + 2 * L * h);
            vfstore(s, vmul(dw, vcvt(vu8(g + 64 + 16 * k + L * h))));
            vfstore(s + L, vmul(dm, vcvt(vsub32(vzero(), vu8(g + 192 + 16 * k + L * h)))));
        }
    }
}

template <int WT, int... K>
static inline void ku_unpack_super(const uint8_t* g, uint8_t* dst, size_t half_bytes, std::integer_sequence<int, K...>) {
    (ku_unpack_block<WT, K>(g, dst + K * kUnpackedBlock, half_bytes), ...);
}

// One group's nb 32-blocks into buf: half h's blocks at h * nb * kUnpackedBlock.
template <int WT>
static inline void ku_unpack(const uint8_t* wg, int nb, uint8_t* buf) {
    const size_t half_bytes = size_t(nb) * kUnpackedBlock;
    if constexpr (WT == W_Q5X16) {
        for (int b = 0; b < nb; ++b) ku_unpack_block<WT, 0>(wg + size_t(b) * 384, buf + size_t(b) * kUnpackedBlock, half_bytes);
    } else {
        const size_t GB = group_block_bytes(WT) * kSuper;
        for (int sb = 0; sb < nb / kSuper; ++sb)
            ku_unpack_super<WT>(wg + sb * GB, buf + size_t(sb) * kSuper * kUnpackedBlock, half_bytes,
                                std::make_integer_sequence<int, kSuper>{});
    }
}

// kq_isum over unpacked chunks [C0, C1) of one lane half's block wb, int8 rows (fine rows take
// ku_isum16). The bounds are template arguments so that the loops unroll into constant offsets:
// with Q6_K's halves passed at run time GCC kept a loop with per-chunk index arithmetic, and the
// tile's float sums spilled (Q6_K fine ran at half Q4_K fine's MAC rate). The same integer sums
// either way.
template <int WT, int MR, int C0, int C1>
static inline void ku_isum(const uint8_t* wb, const int8_t* const* qa, VI* isum) {
    constexpr int SPAN = kq_span<WT>();
    const VI one16 = _mm256_set1_epi16(1);
    for (int r = 0; r < MR; ++r) isum[r] = vzero();
#pragma GCC unroll 8
    for (int c = C0; c < C1; c += SPAN) {
        VI coarse[MR];
        for (int r = 0; r < MR; ++r) coarse[r] = vzero();
#pragma GCC unroll 8
        for (int j = c; j < c + SPAN; ++j) {
            const VI w = vload(wb + 32 * j);
            for (int r = 0; r < MR; ++r)
                coarse[r] = _mm256_add_epi16(coarse[r], _mm256_maddubs_epi16(w, bcast4(qa[r] + 4 * j)));
        }
        for (int r = 0; r < MR; ++r) isum[r] = vadd32(isum[r], _mm256_madd_epi16(coarse[r], one16));
    }
}

// Fine rows with QAct::q16 (254 qa + qb as int16, quantize_row's): the same integer sums as
// ku_isum's, 254 dot(w, qa) + dot(w, qb), as one vpmaddwd dot of the weights widened to int16
// with them. Why: with residual bytes a block and row took 16 maddubs plus the vpmaddwd that
// widen their int16 sums (2 for Q4_K, whose sums hold 8 chunks; 4 for 5-bit; 8 for Q6_K, whose
// hold 2), 18-24 multiplies on Zen's one vector integer multiply pipe; here 16, and no int16
// sums. The widening is two vpshufb of each unpacked chunk per tile: chunk c's lane i holds
// weights 4c..4c+3 of row i as bytes 4i..4i+3, and w0 / w1 take bytes 4i, 4i+1 / 4i+2, 4i+3 of
// each lane zero-extended, so int32 slot i is row i's pair and vpmaddwd with the broadcast
// activation pair gives the row's lanes in place. Measured against ku_isum's form (~1B, 256 rows,
// loaded): Q6_K fine 0.93-1.0x, Q4_K fine 0.95-1.0x. Overflow: a lane adds 4 products of at most
// 63 * 32385 per chunk, 65 M over a block's 8, far below 2^31.
template <int MR, int C0, int C1>
static inline void ku_isum16(const uint8_t* wb, const int16_t* const* qc, VI* isum) {
    const VI lo = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1,
                                   0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
    const VI hi = _mm256_setr_epi8(2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1,
                                   2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1);
    for (int r = 0; r < MR; ++r) isum[r] = vzero();
#pragma GCC unroll 8
    for (int c = C0; c < C1; ++c) {
        const VI w = vload(wb + 32 * c);
        const VI w0 = _mm256_shuffle_epi8(w, lo), w1 = _mm256_shuffle_epi8(w, hi);
        for (int r = 0; r < MR; ++r) {
            const int8_t* x = reinterpret_cast<const int8_t*>(qc[r] + 4 * c);
            isum[r] = vadd32(isum[r], _mm256_madd_epi16(w0, bcast4(x)));
            isum[r] = vadd32(isum[r], _mm256_madd_epi16(w1, bcast4(x + 4)));
        }
    }
}

// isum over chunks [C0, C1): fine rows (RES) by int16 dots with QAct::q16, which quantize_row
// writes wherever it writes residual bytes on AVX2 (make_act, tp_gemm); int8 rows by ku_isum.
template <int WT, int MR, bool RES, int C0, int C1>
static inline void ku_isum_of(const uint8_t* wb, const int8_t* const* qa, const int16_t* const* qc, VI* isum) {
    if constexpr (RES) ku_isum16<MR, C0, C1>(wb, qc, isum);
    else ku_isum<WT, MR, C0, C1>(wb, qa, isum);
}

// Q6_K: the block's 16-weight half HALF (chunks 4 HALF .. 4 HALF + 3) and its scale vector.
template <int MR, bool RES, int HALF>
static inline void ku_q6_half(const uint8_t* wb, const QAct& a, const size_t* ab, const int8_t* const* qa,
                              const int16_t* const* qc, VF* acc) {
    VI isum[MR];
    ku_isum_of<W_Q6KX16, MR, RES, 4 * HALF, 4 * HALF + 4>(wb, qa, qc, isum);
    const VF dsc = vfload(reinterpret_cast<const float*>(wb + 256) + L * HALF);
    for (int r = 0; r < MR; ++r) {
        const VI off = vset32(32 * a.qsum16[2 * ab[r] + HALF]);
        acc[r] = vfma(vcvt(vsub32(isum[r], off)), vmul(dsc, vfset(a.d[ab[r]])), acc[r]);
    }
}

// MR rows from m0 against one lane half's unpacked blocks buf (blocks b0 .. b0 + nbs - 1 of the
// row), added into acc[r].
template <int WT, int MR, bool RES>
static inline void ku_tile(const uint8_t* buf, const QAct& a, int m0, int b0, int nbs, VF* acc_io) {
    const int nb = a.nb;
    VF acc[MR];  // the tile's sums in registers over the blocks (acc_io is indexed at run time)
    for (int r = 0; r < MR; ++r) acc[r] = acc_io[r];
    for (int b = b0; b < b0 + nbs; ++b) {
        const uint8_t* wb = buf + size_t(b - b0) * kUnpackedBlock;
        const int8_t* qa[MR];
        const int16_t* qc[MR];
        size_t ab[MR];
        for (int r = 0; r < MR; ++r) {
            ab[r] = size_t(m0 + r) * nb + b;
            qa[r] = a.q + ab[r] * QK;
            qc[r] = RES ? a.q16 + ab[r] * QK : nullptr;
        }
        if constexpr (WT == W_Q6KX16) {
            ku_q6_half<MR, RES, 0>(wb, a, ab, qa, qc, acc);
            ku_q6_half<MR, RES, 1>(wb, a, ab, qa, qc, acc);
        } else {
            VI isum[MR];
            ku_isum_of<WT, MR, RES, 0, 8>(wb, qa, qc, isum);
            const float* s = reinterpret_cast<const float*>(wb + 256);
            const VF dsc = vfload(s), mw = vfload(s + L);
            for (int r = 0; r < MR; ++r) {
                acc[r] = vfma(vcvt(isum[r]), vmul(dsc, vfset(a.d[ab[r]])), acc[r]);
                acc[r] = vfma(mw, vfset(a.s[ab[r]]), acc[r]);
            }
        }
    }
    for (int r = 0; r < MR; ++r) acc_io[r] = acc[r];
}

template <int WT, bool RES>
static inline void ku_tile_of(int mr, const uint8_t* buf, const QAct& a, int m0, int b0, int nbs, VF* acc) {
    constexpr int MR = kUnpackMR<WT, RES>;
    static_assert(MR <= 6, "the tails below go to 5 rows");
    switch (mr) {
        case 1: return ku_tile<WT, 1, RES>(buf, a, m0, b0, nbs, acc);
        case 2: if constexpr (MR > 2) return ku_tile<WT, 2, RES>(buf, a, m0, b0, nbs, acc); break;
        case 3: if constexpr (MR > 3) return ku_tile<WT, 3, RES>(buf, a, m0, b0, nbs, acc); break;
        case 4: if constexpr (MR > 4) return ku_tile<WT, 4, RES>(buf, a, m0, b0, nbs, acc); break;
        case 5: if constexpr (MR > 5) return ku_tile<WT, 5, RES>(buf, a, m0, b0, nbs, acc); break;
        default: break;
    }
}

// Blocks per slice of K: a slice is unpacked, and every tile of rows passes over it, before the
// next. A half's slice (64 * 320 bytes = 20 KiB) stays in L1 at any K (the ~1B's ffn_down, K =
// 6144, was 60 KiB a half unsliced). Between slices a row's sums wait in `part` as floats, which
// holds them exactly: the same operations in the same order, so the same bits.
constexpr int kSliceBlocks = 64;  // a multiple of kSuper

// y[m, n0..n1) for M > kFewRows rows (formats with kUnpackMR > 0); groups outermost, as
// packed_gemm_t, each unpacked once, a slice of K at a time, into a buffer of this call.
template <int WT, bool RES>
static void ku_gemm(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                    const float* bias, bool accumulate) {
    constexpr int MR = kUnpackMR<WT, RES>;
    const size_t GB = group_block_bytes(WT);
    const int S = nb < kSliceBlocks ? nb : kSliceBlocks;
    std::vector<uint8_t> buf(2 * size_t(S) * kUnpackedBlock);
    std::vector<float> part(nb > S ? 2 * size_t(M) * L : 0);
    for (int g = n0 / 16; g < n1 / 16; ++g) {
        const uint8_t* wg = w + size_t(g) * nb * GB;
        for (int b0 = 0; b0 < nb; b0 += S) {
            const int nbs = nb - b0 < S ? nb - b0 : S;
            const bool last = b0 + nbs == nb;
            ku_unpack<WT>(wg + size_t(b0) * GB, nbs, buf.data());
            for (int h = 0; h < 2; ++h) {
                const uint8_t* half = buf.data() + h * size_t(nbs) * kUnpackedBlock;
                const int n = 16 * g + L * h;
                for (int m0 = 0; m0 < M;) {
                    const int mr = next_tile_rows<WT, RES>(M, M - m0);  // MR, then what is left
                    VF acc[MR];
                    for (int r = 0; r < mr; ++r) acc[r] = b0 ? vfload(&part[(size_t(h) * M + m0 + r) * L]) : vfzero();
                    if (mr == MR) ku_tile<WT, MR, RES>(half, a, m0, b0, nbs, acc);
                    else ku_tile_of<WT, RES>(mr, half, a, m0, b0, nbs, acc);
                    if (last) store_tile(y + size_t(m0) * ldy, ldy, n, acc, mr, 1, bias, accumulate);
                    else
                        for (int r = 0; r < mr; ++r) vfstore(&part[(size_t(h) * M + m0 + r) * L], acc[r]);
                    m0 += mr;
                }
            }
        }
    }
}
