// AVX2 prompt GEMM on the 5-bit and K-quant repacks (Q5X16, Q4KX16, Q5KX16, Q6KX16): steps of
// more than kFewRows rows of the formats with kPromptMR > 0 (packed_impl.h). Included by
// packed_impl.h (AVX2 only), after kq_tile, store_tile and next_tile_rows.
//
// Why: kq_tile with NH = 1 runs a 16-row group as two 8-lane halves, each a pass of every tile
// of activation rows, so each activation broadcast fed one maddubs and each row's block scales
// (da, s_a) were broadcast twice per group. Here a tile runs both halves at once (kq_tile's
// NH = 2, as AVX2 decode does): the weights of both halves are unpacked once per tile of MR rows
// and the per-row scale broadcasts are halved. MR (kPromptMR): what 16 ymm registers hold with
// 2 * MR int16 sums (4 * MR with residual bytes) and two weight vectors. Figures:
// benchmarks/results/avx2_prompt_gemm-loaded.md, benchmarks/results/kquant_tile_dedupe-loaded.md.
//
// Bits: every lane sees the same integer sums (exact; the int16 bound of kq_span holds per half)
// and the same float operations in the same order whatever NH and MR are (and so as the VNNI
// kernels'), and a row's operations do not depend on its tile: AVX2 == AVX-512 and batch
// invariance still hold.

// The tails: a tile of mr < kPromptMR rows (next_tile_rows: kPromptMR rows, then what is left).
template <int WT, bool RES>
static inline void kq_prompt_tail(int mr, const uint8_t* wg, const QAct& a, const int* rows, VF* out) {
    constexpr int MR = kPromptMR<WT, RES>;
    static_assert(MR <= 6, "the tails below go to 5 rows");
    switch (mr) {
        case 1: return kq_tile<WT, 1, RES, 2, false>(wg, 0, a, rows, out);
        case 2: if constexpr (MR > 2) return kq_tile<WT, 2, RES, 2, false>(wg, 0, a, rows, out); break;
        case 3: if constexpr (MR > 3) return kq_tile<WT, 3, RES, 2, false>(wg, 0, a, rows, out); break;
        case 4: if constexpr (MR > 4) return kq_tile<WT, 4, RES, 2, false>(wg, 0, a, rows, out); break;
        case 5: if constexpr (MR > 5) return kq_tile<WT, 5, RES, 2, false>(wg, 0, a, rows, out); break;
        default: break;
    }
}

// y[m, n0..n1) for M > kFewRows rows; groups outermost, as packed_gemm_t: a group's weights stay
// in L1/L2 while every tile of rows passes over them.
template <int WT, bool RES>
static void kq_gemm2(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                     const float* bias, bool accumulate) {
    const size_t GB = group_block_bytes(WT);
    constexpr int MR = kPromptMR<WT, RES>;
    int rows[MR];
    VF out[2 * MR];
    for (int g = n0 / 16; g < n1 / 16; ++g) {
        const uint8_t* wg = w + size_t(g) * nb * GB;
        for (int m0 = 0, mr; m0 < M; m0 += mr) {
            mr = next_tile_rows<WT, RES>(M, M - m0);
            for (int r = 0; r < mr; ++r) rows[r] = m0 + r;
            if (mr == MR) kq_tile<WT, MR, RES, 2, false>(wg, 0, a, rows, out);
            else kq_prompt_tail<WT, RES>(mr, wg, a, rows, out);
            store_tile(y + size_t(m0) * ldy, ldy, 16 * g, out, mr, 2, bias, accumulate);
        }
    }
}
