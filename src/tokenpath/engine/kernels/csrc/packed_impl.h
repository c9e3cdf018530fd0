// GEMM/GEMV on weights repacked 16 rows at a time (Q4X16, Q8X16; see tp_repack in quant.cpp).
// Included by dot_impl.h inside its namespace, so it is compiled once per ISA (TP_VNNI).
//
// Why repack: with GGUF's row-major blocks, one 256-bit integer dot covers one weight row, so
// every (activation row, weight row, block) pays its own float conversion, scale multiply and FMA,
// and every output a horizontal sum. That bookkeeping, not the integer multiplies, bounded the
// old kernel at ~140 GFLOP/s for prefill on 2 cores. Interleaved, one register holds 4 weights of
// each of L rows, the activation's 4 bytes are broadcast, and the L lanes are L outputs: a
// block's integer dot for L rows is 8 multiply-adds, its scales are one vector FMA, and the
// outputs leave as one store. The same loop serves decode (M = 1), where it also reads each
// weight byte once, in order.
//
// Lanes: AVX-512 VNNI runs a 16-row group in one 512-bit register (L = 16); AVX2 runs it as two
// 256-bit halves of 8 rows (decode: both in one pass, see kOnePass). One layout serves both, and each output sees the same exact integer
// sums and the same float operations, so the two ISAs agree bit for bit. 512-bit vpdpbusd moved
// 1.29x the multiply-adds of 256-bit in the fine-activation kernel at M = 32 on this Zen 4
// (microbenchmarked; 8-row groups were the first layout).
//
// Layout of one group-block (16 rows x 32 weights), the group's blocks in K order:
//   Q4X16: d[16] fp16, m[16] fp16 (Q4_0's m = -8 d), then 256 bytes: byte c*64 + i*4 + j holds
//          row i's weights 4c+j (low nibble) and 16+4c+j (high nibble), c = 0..3: each GGUF qs
//          byte of row i moved, not changed.
//   Q8X16: d[16] fp16, 32 bytes of padding (the block stays a multiple of 64 bytes), then 512
//          bytes: byte c*64 + i*4 + j = row i's weight 4c+j, c = 0..7.
// Weights are read in 64-byte chunks from 64-byte aligned offsets (repack() aligns the array).

#if TP_VNNI
using VI = __m512i;
using VF = __m512;
constexpr int L = 16;  // rows per register
static inline VI vload(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline VI vzero() { return _mm512_setzero_si512(); }
static inline VI vand(VI a, VI b) { return _mm512_and_si512(a, b); }
static inline VI vsrl4(VI a) { return _mm512_srli_epi16(a, 4); }
static inline VI vbyte(char b) { return _mm512_set1_epi8(b); }
static inline VI vset32(int32_t v) { return _mm512_set1_epi32(v); }
static inline VI vadd32(VI a, VI b) { return _mm512_add_epi32(a, b); }
static inline VI vsub32(VI a, VI b) { return _mm512_sub_epi32(a, b); }
static inline VI vsll32(VI a, int n) { return _mm512_slli_epi32(a, n); }
static inline VI vxor(VI a, VI b) { return _mm512_xor_si512(a, b); }
static inline VI vdot(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline VF vhalf(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
static inline VF vfzero() { return _mm512_setzero_ps(); }
static inline VF vfset(float f) { return _mm512_set1_ps(f); }
static inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF vfadd(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF vcvt(VI a) { return _mm512_cvtepi32_ps(a); }
static inline VF vfload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vfstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
#else
using VI = __m256i;
using VF = __m256;
constexpr int L = 8;
static inline VI vload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline VI vzero() { return _mm256_setzero_si256(); }
static inline VI vand(VI a, VI b) { return _mm256_and_si256(a, b); }
static inline VI vsrl4(VI a) { return _mm256_srli_epi16(a, 4); }
static inline VI vbyte(char b) { return _mm256_set1_epi8(b); }
static inline VI vset32(int32_t v) { return _mm256_set1_epi32(v); }
static inline VI vadd32(VI a, VI b) { return _mm256_add_epi32(a, b); }
static inline VI vsub32(VI a, VI b) { return _mm256_sub_epi32(a, b); }
static inline VI vsll32(VI a, int n) { return _mm256_slli_epi32(a, n); }
static inline VF vhalf(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline VF vfzero() { return _mm256_setzero_ps(); }
static inline VF vfset(float f) { return _mm256_set1_ps(f); }
static inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VF vfadd(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF vcvt(VI a) { return _mm256_cvtepi32_ps(a); }
static inline VF vfload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vfstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
#endif

static inline VI bcast4(const int8_t* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return vset32(v);
}

#if !TP_VNNI
// AVX2 decode (NH = 2): an integer running sum is pinned to a register after each add. Integer adds
// reassociate freely, and GCC turned each chain of maddubs adds into all of a block's products
// first, summed at its end: 32 live products, spilled to the stack and reloaded (416 stack
// references in the Q4_K fine 1-row tile, 41 with the pins). The empty volatile asm moves no
// arithmetic and the sums are integers, so the bits do not change. Not in q8_isum16: pinned, its
// fine Q8X16 tile ran slower in cache (1.55 -> 1.95 ns a 32-block row). Measured:
// benchmarks/results/avx2_decode_gemv-loaded.md.
static inline void pin_sum(VI& v) { asm volatile("" : "+x"(v)); }
#endif

#if TP_VNNI
// combine() (dot_impl.h) for 512-bit sums.
static inline VI combine(VI coarse, VI fine) { return vadd32(vsub32(vsll32(coarse, 8), vsll32(coarse, 1)), fine); }
#endif

// Integer block dots of MR activation rows (qa[r], and with RES qb[r] the residual bytes: a
// block's 32 int8 values) against NH * L rows of one group-block: isum[hh * MR + r] lane i =
// dot(row hh * L + i, q_a) (254 * dot(.., qa) + dot(.., qb) with RES). qs points at the lanes'
// first bytes; the chunks of 4 weights per lane are 64 bytes apart, the next L lanes 4 L bytes on.
// For Q8X16 on VNNI the weights enter as w + 128, so the caller takes 128 * sum(q_a) off.
// NH = 2 (AVX2 decode, see kOnePass): both halves of each 64-byte chunk in turn, one broadcast each.
template <int WT, int MR, bool RES, int NH = 1>
static inline void packed_isum(const uint8_t* qs, const int8_t* const* qa, const int8_t* const* qb, VI* isum) {
    static_assert(!TP_VNNI || NH == 1, "VNNI: one 16-lane register per group");
#if TP_VNNI
    // With 1-2 rows each sum runs as S = 2 interleaved chains (Q4X16: the low and the high nibbles;
    // Q8X16: even and odd chunks), so that one chain of 8 dependent vpdpbusd does not wait on its
    // latency: a 1-row tile that reads its weights from cache (a verification step's tail) was
    // latency-bound (kquant_impl.h's kq_isum does the same). Integer sums: the same bits either way.
    constexpr int S = MR <= 2 ? 2 : 1;
#else
    constexpr int S = 1;
#endif
    constexpr int R = NH * MR;
    VI coarse[S][R], fine[S][R];
    for (int i = 0; i < S; ++i)
        for (int r = 0; r < R; ++r) coarse[i][r] = fine[i][r] = vzero();
    if constexpr (WT == W_Q4X16) {
        const VI m4 = vbyte(0x0F);
        for (int c = 0; c < 4; ++c) {
            for (int hh = 0; hh < NH; ++hh) {
                const VI raw = vload(qs + 64 * c + 4 * L * hh);
                const VI lo = vand(raw, m4), hi = vand(vsrl4(raw), m4);
                for (int r0 = 0; r0 < MR; ++r0) {
                    const int r = hh * MR + r0;
#if TP_VNNI
                    coarse[0][r] = vdot(coarse[0][r], lo, bcast4(qa[r0] + 4 * c));
                    coarse[S - 1][r] = vdot(coarse[S - 1][r], hi, bcast4(qa[r0] + 16 + 4 * c));
                    if constexpr (RES) {
                        fine[0][r] = vdot(fine[0][r], lo, bcast4(qb[r0] + 4 * c));
                        fine[S - 1][r] = vdot(fine[S - 1][r], hi, bcast4(qb[r0] + 16 + 4 * c));
                    }
#else
                    // u4 * s8 pairs: |maddubs lane| <= 2*15*127, so the 8 of a block still fit int16.
                    coarse[0][r] = _mm256_add_epi16(coarse[0][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(qa[r0] + 4 * c)),
                                                                                   _mm256_maddubs_epi16(hi, bcast4(qa[r0] + 16 + 4 * c))));
                    if constexpr (NH > 1) pin_sum(coarse[0][r]);
                    if constexpr (RES) {
                        fine[0][r] = _mm256_add_epi16(fine[0][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(qb[r0] + 4 * c)),
                                                                                   _mm256_maddubs_epi16(hi, bcast4(qb[r0] + 16 + 4 * c))));
                        if constexpr (NH > 1) pin_sum(fine[0][r]);
                    }
#endif
                }
            }
        }
#if !TP_VNNI
        for (int r = 0; r < R; ++r) {
            coarse[0][r] = _mm256_madd_epi16(coarse[0][r], _mm256_set1_epi16(1));
            if constexpr (RES) fine[0][r] = _mm256_madd_epi16(fine[0][r], _mm256_set1_epi16(1));
        }
#endif
    } else {  // Q8X16: signed weights
        for (int c = 0; c < 8; ++c) {
            const int i = c % S;
#if TP_VNNI
            // One register is the whole group (L = 16): no second half, NH is 1.
            // w ^ 0x80 = w + 128 as unsigned bytes; the int32 sums cannot overflow.
            const VI wu = vxor(vload(qs + 64 * c), vbyte(char(0x80)));
            for (int r = 0; r < MR; ++r) {
                coarse[i][r] = vdot(coarse[i][r], wu, bcast4(qa[r] + 4 * c));
                if constexpr (RES) fine[i][r] = vdot(fine[i][r], wu, bcast4(qb[r] + 4 * c));
            }
#else
            for (int hh = 0; hh < NH; ++hh) {
                const VI w = vload(qs + 64 * c + 4 * L * hh);
                // maddubs would saturate on (w + 128) * q_a pairs: the sign trick keeps |w| unsigned.
                const VI wa = _mm256_sign_epi8(w, w);
                for (int r0 = 0; r0 < MR; ++r0) {
                    const int r = hh * MR + r0;
                    coarse[i][r] = vadd32(coarse[i][r], dot_us(wa, _mm256_sign_epi8(bcast4(qa[r0] + 4 * c), w)));
                    if constexpr (RES) fine[i][r] = vadd32(fine[i][r], dot_us(wa, _mm256_sign_epi8(bcast4(qb[r0] + 4 * c), w)));
                }
            }
#endif
        }
    }
    for (int i = 1; i < S; ++i)
        for (int r = 0; r < R; ++r) coarse[0][r] = vadd32(coarse[0][r], coarse[i][r]), fine[0][r] = vadd32(fine[0][r], fine[i][r]);
    for (int r = 0; r < R; ++r) isum[r] = RES ? combine(coarse[0][r], fine[0][r]) : coarse[0][r];
}

#if !TP_VNNI
// AVX2, Q8X16 with residual bytes (QAct::q16): the same integer sums, 254 dot(w, qa) + dot(w, qb),
// as one dot of the weights widened to int16 with the int16 activations 254 qa + qb. Why: the 2
// AVX2 cores this was tuned on (Zen 1) have one pipe for vector integer multiplies, and that pipe
// bounds each row of a small-M step (a 5-row verification step costs ~3.5x a 1-row step: the
// multiplies scale with the rows, the weight reads do not). Q8X16's maddubs int16 sums hold one
// pair only, so with residual bytes each row, block and 8 lanes took 16 maddubs and 16 vpmaddwd
// to widen them; vpmaddwd on int16 weights takes 16 in all, and the weights are widened once per
// tile of MR rows. The tied LM head of SmolLM2 is Q8X16: 0.72-0.85x its GEMM time at M = 1..8
// (benchmarks/step_rows.py). Q4X16 keeps maddubs: its u4 x s8 sums widen once per block (18
// multiplies to 16), and the int16 form measured no faster there.
// Lanes: cvt of a 128-bit half gives 4 rows x 2 pairs of weights; a row's two pair sums are added
// by hadd at the end of the block, whose lane order a permute restores. Overflow: |w| <= 128 and
// |254 qa + qb| <= 32385, so a lane's 8 pairs stay below 2^27.
static inline __m256i bcast8(const int16_t* p) {
    long long v;
    __builtin_memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
}

template <int MR, int NH = 1>
static inline void q8_isum16(const uint8_t* qs, const int16_t* const* qa, VI* isum) {
    constexpr int R = NH * MR;
    __m256i lo[R], hi[R];  // rows 0-3 and 4-7 of the lanes, two pair sums per row
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = vzero();
    for (int c = 0; c < 8; ++c) {
        for (int hh = 0; hh < NH; ++hh) {
            const VI raw = vload(qs + 64 * c + 4 * L * hh);
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
            for (int r0 = 0; r0 < MR; ++r0) {
                const int r = hh * MR + r0;
                const __m256i av = bcast8(qa[r0] + 4 * c);
                lo[r] = vadd32(lo[r], _mm256_madd_epi16(w0, av));
                hi[r] = vadd32(hi[r], _mm256_madd_epi16(w1, av));
            }
        }
    }
    // hadd: (r0 r1 r4 r5 | r2 r3 r6 r7); 64-bit units 0 2 1 3 put the rows back in order.
    for (int r = 0; r < R; ++r) isum[r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo[r], hi[r]), 0xD8);
}
#endif

// Decode (tiles of 1-2 rows) streams each weight byte once, in address order; in perf annotate the
// weight loads took most of the GEMV's cycles, at 6-10 GB/s a core. Each block prefetches its own
// size kPackedPrefetch bytes ahead (past a group's end into the next group: a thread's groups are
// consecutive in memory), as the K-quant decode does (kquant_impl.h). Measured on SmolLM2's own
// matrices, one thread by its CPU time, interleaved A/B on a loaded machine (benchmarks/kquant_gemv.py
// --lib): the Q4X16 layers 10.1-10.6 -> 7.5-8.9 ms a pass, the Q8X16 LM head 1.3-2.8 -> 1.3-2.6 ms,
// faster for int8 and fine activations and on AVX2 alike. SmolLM2's tg128 through the engine,
// one pinned thread, the process's CPU time per decode step, the same Python with either build,
// interleaved: 12.2-16.3 -> 9.0-11.2 ms (benchmarks/results/step_cost.md). No arithmetic changes:
// the logits are bit-identical.
// Tiles of 4 rows prefetch too: speculation's 1 + K verification rows (M = 5: a 4-row tile reads
// the group first, then a 1-row tile from cache) streamed unprefetched, so once plain decode
// prefetched, a verification step's cost rose against a plain one's, and n-gram speculation on
// SmolLM2 fell from faster than off to 0.74-0.89x on the `quote` and `free` workloads.
// On the 2-core Zen 3 (AVX2, loaded), 2048-16384 bytes ahead and T0 or T1 measured alike within
// its +-20% noise; no prefetch was slower than 4096/T0 in both rounds.
constexpr size_t kPackedPrefetch = 4096;  // bytes; 2048-8192 measured alike

// Block dot products of MR activation rows against lanes [h * L, h * L + NH * L) of one 16-row
// group, over all nb blocks: out[hh * MR + r] (L floats) = sum_b d_w*d_a*dot(q_w, q_a) + m_w*s_a
// (Q4) or d_w*d_a*dot (Q8). RES: with the residual bytes (QAct::q2). Every row's operations are
// the same whatever MR and NH are, so results do not depend on the batch.
// few: a step of a few rows (kFewRows), whose first tile streams the weights from memory.
template <int WT, int MR, bool RES, int NH = 1>
static inline void packed_tile(const uint8_t* wg, int h, const QAct& a, const int* rows, VF* out, bool few) {
    constexpr size_t GB = WT == W_Q4X16 ? 320 : 576;
    constexpr size_t QS = 64;  // d[16] and m[16] (Q8: padding) come first
    constexpr int R = NH * MR;
    const int nb = a.nb;
    VF acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vfzero();
    for (int b = 0; b < nb; ++b, wg += GB) {
        if constexpr (NH > 1) asm volatile("" ::: "memory");  // see kOnePass
        if (MR <= 4 || few)  // decode and verification rows: see kPackedPrefetch
            for (size_t i = 0; i < GB; i += 64) _mm_prefetch(reinterpret_cast<const char*>(wg + kPackedPrefetch + i), _MM_HINT_T0);
        const int8_t* qa[MR];
        const int8_t* qb[MR];
        VI isum[R];
        for (int r = 0; r < MR; ++r) {
            qa[r] = a.q + (size_t(rows[r]) * nb + b) * QK;
            qb[r] = RES ? a.q2 + (size_t(rows[r]) * nb + b) * QK : nullptr;
        }
#if TP_VNNI
        packed_isum<WT, MR, RES>(wg + QS + 4 * L * h, qa, qb, isum);
#else
        if (WT == W_Q8X16 && RES && a.q16) {
            const int16_t* qa16[MR];
            for (int r = 0; r < MR; ++r) qa16[r] = a.q16 + (size_t(rows[r]) * nb + b) * QK;
            q8_isum16<MR, NH>(wg + QS + 4 * L * h, qa16, isum);
        } else {
            packed_isum<WT, MR, RES, NH>(wg + QS + 4 * L * h, qa, qb, isum);
        }
#endif
#if TP_VNNI
        if constexpr (WT == W_Q8X16)
            for (int r = 0; r < MR; ++r) isum[r] = vsub32(isum[r], vset32(128 * a.qsum[size_t(rows[r]) * nb + b]));
#endif
        for (int hh = 0; hh < NH; ++hh) {
            const VF dw = vhalf(wg + 2 * L * (h + hh));
            for (int r = 0; r < MR; ++r) {
                const size_t ab = size_t(rows[r]) * nb + b;
                acc[hh * MR + r] = vfma(vcvt(isum[hh * MR + r]), vmul(dw, vfset(a.d[ab])), acc[hh * MR + r]);
            }
            if constexpr (WT == W_Q4X16) {
                const VF mw = vhalf(wg + 32 + 2 * L * (h + hh));
                for (int r = 0; r < MR; ++r) acc[hh * MR + r] = vfma(mw, vfset(a.s[size_t(rows[r]) * nb + b]), acc[hh * MR + r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#include "kquant_impl.h"

template <int WT, int MR, bool RES>
static inline void any_tile(const uint8_t* wg, int h, const QAct& a, const int* rows, VF* out, bool few) {
    if constexpr (WT == W_Q4X16 || WT == W_Q8X16) packed_tile<WT, MR, RES>(wg, h, a, rows, out, few);
    else if constexpr (WT == W_F16X16 || WT == W_BF16X16 || WT == W_F32X16) float_tile<WT, MR>(wg, h, a, rows, out);
    else kq_tile<WT, MR, RES>(wg, h, a, rows, out);
}

#if !TP_VNNI
// AVX2 decode (steps of at most kOnePass rows: tiles of 1-2 rows): both 8-lane halves of a group
// in one pass over its blocks, out[hh * MR + r] for lanes 8 hh... The two-pass loop read each
// 64-byte line twice (the second pass from L1), redid the activation broadcasts, the scale loads
// and the prefetches per half, and its memory stream paused during every second pass. Each
// block (K-quants: each sub-block, kq_block) starts with a compiler barrier: without it GCC
// hoisted and kept the loads of several blocks (16 weight vectors a Q4_K sub-block pair shares)
// and spilled them, and the one-pass kernel was no faster than two passes on the ~1B Q4_K_M
// (ffn_up + attn_q 22-26 vs 21-25 ms a pass; 16-17 ms with the barrier). The barrier moves no
// arithmetic. One thread's CPU time, loaded 2-core Zen 3, interleaved A/B against two passes:
// benchmarks/results/avx2_decode_gemv-loaded.md. Each lane's arithmetic is unchanged (the same
// integer sums, the same float operations in the same order), so the bits equal the two-pass
// loop's and AVX-512's.
// Tiles of 1-2 rows always prefetch (packed_tile: MR <= 4; kq_block: MR <= 2), whatever the
// step's size, so any_tile2 takes no `few`.
constexpr int kOnePass = 2;
template <int WT, int MR, bool RES>
static inline void any_tile2(const uint8_t* wg, const QAct& a, const int* rows, VF* out) {
    static_assert(MR <= kOnePass, "decode tiles");
    if constexpr (WT == W_Q4X16 || WT == W_Q8X16) packed_tile<WT, MR, RES, 2>(wg, 0, a, rows, out, true);
    else kq_tile<WT, MR, RES, 2>(wg, 0, a, rows, out);
}
#endif

// Rows per tile (packed_gemm_t). MR: what the vector registers hold (32 with AVX-512, 16 with
// AVX2) with the residual pass's doubled integer sums; measured best at 4 for fine activations on
// VNNI at prefill sizes. kFewCap: the most rows one tile takes in a step of a few rows: 8 for the
// 8-bit and 4-bit formats on VNNI (8 float sums, 16 integer ones and the unpacked weights fit the
// 32 registers), MR elsewhere. On AVX2, prompt steps (more than kFewRows rows) of Q5_0 and Q4_K
// rows and Q6_K fine rows run kquant_unpacked.h's tiles (each group unpacked once) instead.
template <int WT, bool RES>
constexpr int kTileMR = TP_VNNI && (!RES || WT == W_Q5X16 || WT == W_Q6KX16) ? 8 : 4;
template <int WT, bool RES>
constexpr int kFewCap = TP_VNNI && (WT == W_Q4X16 || WT == W_Q8X16) ? 8 : kTileMR<WT, RES>;
constexpr int kFewRows = 16;  // a step of at most this many rows is a few rows (decode, verification)

// AVX2, rows per tile on unpacked groups (kquant_unpacked.h's ku_gemm: steps of more than
// kFewRows rows), by format and precision (RES: int8 with residual bytes); 0: the format keeps
// packed_gemm_t's tiles of each half (kq_tile). Measured on Gemma 3 270M's layers 0 and 2 at 512
// rows (one thread's CPU time, interleaved, loaded 2-core Zen 3): int8 6 rows over 4 and 5; fine 3
// over 2 and 4 (at 4 the 16 sums spill). Against the kernels before (kq_tile per half, or both
// halves per tile): Q5_0 int8 0.60-0.65x the time, Q4_K int8 0.67-0.74x, Q5_0 fine 0.69-0.76x,
// Q4_K fine 0.70-0.75x, Q6_K fine 0.68-0.94x (benchmarks/results/avx2_prefill_unpacked-loaded.md).
// Q6_K int8 (ffn_down in half a Q4_K_M file's layers, a prompt matrix since --kernels-prompt-fine's
// default is qkv only): 4 rows, 0.73-0.78x kq_tile's time (the ~1B's 2048x6144 at 64 and 256 rows;
// 6 rows the same). Q5_K int8 (no default prompt matrix in a Q4_K_M file) was not measured and
// keeps kq_tile. 0 on VNNI (one 16-lane register is the whole group already).
template <int WT, bool RES>
constexpr int kUnpackMR = TP_VNNI ? 0 : WT == W_Q5X16 || WT == W_Q4KX16 ? (RES ? 3 : 6) : WT == W_Q6KX16 ? (RES ? 3 : 4) : 0;

// Rows of the tile that starts with `rest` rows of the step left: tiles of MR while more than
// 2 cap rows are left, then ceil(rest / cap) tiles of nearly equal size (at most cap each). Why:
// a speculative verification step has 2-17 rows, and tiles of 4, 2 and 1 (the old tail) ran a
// 5-row step as a 4-row tile that read the weights from memory and a 1-row tile that read them
// again from cache, latency-bound on its lone chains: 5 rows cost 1.58x one row where 4 cost
// 1.21x (benchmarks/results/step_rows_quiet.md). One 5-row tile unpacks each weight block once.
// Each row's arithmetic does not depend on its tile, so the bits do not change.
inline int tile_rows(int rest, int MR, int cap) {
    if (rest > 2 * cap) return MR;
    const int tiles = (rest + cap - 1) / cap;
    return (rest + tiles - 1) / tiles;
}

// Rows of the next tile of an M-row step with `rest` rows left, as the kernels run them:
// kUnpackMR rows, then what is left, in a prompt step that ku_gemm runs; tile_rows otherwise
// (a step of at most kOnePass rows, AVX2's one pass, is one tile by it too). tp_gemm_tiles
// reports these, so the tests see the kernels' own rule.
template <int WT, bool RES>
inline int next_tile_rows(int M, int rest) {
    constexpr int PMR = kUnpackMR<WT, RES>;
    if (PMR > 0 && M > kFewRows) return rest < PMR ? rest : PMR;
    return tile_rows(rest, kTileMR<WT, RES>, kFewCap<WT, RES>);
}

// A tile's sums into y (the tile's first row; ldy floats a row): out[hh * rows + r] is lanes
// n + L hh .. n + L hh + L - 1 of row r, nh lane halves of L outputs. Adds the bias and, with
// accumulate, y's own values, in that order (the same float operations for every kernel).
static inline void store_tile(float* y, int ldy, int n, const VF* out, int rows, int nh, const float* bias,
                              bool accumulate) {
    for (int hh = 0; hh < nh; ++hh) {
        const VF vb = bias ? vfload(bias + n + L * hh) : vfzero();
        for (int r = 0; r < rows; ++r) {
            float* dst = y + size_t(r) * ldy + n + L * hh;
            VF v = vfadd(out[hh * rows + r], vb);
            if (accumulate) v = vfadd(v, vfload(dst));
            vfstore(dst, v);
        }
    }
}

#if !TP_VNNI
#include "kquant_unpacked.h"
#endif

template <int WT, bool RES, int CAP>
static inline void tile_of(int mr, const uint8_t* wg, int h, const QAct& a, const int* rows, VF* out, bool few) {
    switch (mr) {
        case 1: return any_tile<WT, 1, RES>(wg, h, a, rows, out, few);
        case 2: return any_tile<WT, 2, RES>(wg, h, a, rows, out, few);
        case 3: return any_tile<WT, 3, RES>(wg, h, a, rows, out, few);
        default: break;
    }
    if constexpr (CAP <= 4) {
        return any_tile<WT, 4, RES>(wg, h, a, rows, out, few);
    } else {
        switch (mr) {
            case 4: return any_tile<WT, 4, RES>(wg, h, a, rows, out, few);
            case 5: return any_tile<WT, 5, RES>(wg, h, a, rows, out, few);
            case 6: return any_tile<WT, 6, RES>(wg, h, a, rows, out, few);
            case 7: return any_tile<WT, 7, RES>(wg, h, a, rows, out, few);
            default: return any_tile<WT, 8, RES>(wg, h, a, rows, out, few);
        }
    }
}

// y[m, n0..n1) for all M rows; n0 and n1 multiples of 16 (gemm_team hands out multiples of 16).
// Groups outermost: a group's weights (nb * group_block_bytes) stay in L1/L2 while every tile of
// activation rows passes over them.
template <int WT, bool RES>
static void packed_gemm_t(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                          const float* bias, bool accumulate) {
    const size_t GB = group_block_bytes(WT);
    constexpr int MR = kTileMR<WT, RES>, CAP = kFewCap<WT, RES>;
    const bool few = M <= kFewRows;
#if !TP_VNNI
    if constexpr (kUnpackMR<WT, RES> > 0)  // prompt steps of these formats: kquant_unpacked.h
        if (!few) return ku_gemm<WT, RES>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
#endif
    int rows[CAP];
    VF out[CAP];
#if !TP_VNNI
    if constexpr (WT != W_F16X16 && WT != W_BF16X16 && WT != W_F32X16) {
        if (M >= 1 && M <= kOnePass) {  // see any_tile2
            VF out2[2 * kOnePass];
            for (int r = 0; r < M; ++r) rows[r] = r;  // one tile (next_tile_rows)
            for (int g = n0 / 16; g < n1 / 16; ++g) {
                const uint8_t* wg = w + size_t(g) * nb * GB;
                if (M == 2) any_tile2<WT, 2, RES>(wg, a, rows, out2);
                else any_tile2<WT, 1, RES>(wg, a, rows, out2);
                store_tile(y, ldy, 16 * g, out2, M, 2, bias, accumulate);
            }
            return;
        }
    }
#endif
    for (int g = n0 / 16; g < n1 / 16; ++g) {
        const uint8_t* wg = w + size_t(g) * nb * GB;
        for (int h = 0; h < 16 / L; ++h) {
            for (int m0 = 0, mr; m0 < M; m0 += mr) {
                mr = next_tile_rows<WT, RES>(M, M - m0);
                for (int r = 0; r < mr; ++r) rows[r] = m0 + r;
                if (mr == MR) any_tile<WT, MR, RES>(wg, h, a, rows, out, few);
                else tile_of<WT, RES, CAP>(mr, wg, h, a, rows, out, few);
                store_tile(y + size_t(m0) * ldy, ldy, 16 * g + L * h, out, mr, 1, bias, accumulate);
            }
        }
    }
}

#if !TP_VNNI
// AVX2, BF16X16 and F32X16: all 16 rows of a group in one pass. BF16: one 32-byte load holds
// weight e of the 16 rows (bf16, row i at 2 i); a shift and a mask widen its even and odd rows to
// float on the ALU ports (the widening load, vpmovzxwd, takes the shuffle port per 8 rows). F32:
// two 32-byte loads, rows 0-7 and 8-15. Either way each activation broadcast feeds 2 MR FMAs where
// the 8-lane float_tile fed MR: 1.3x the GEMM rate at M >= 4 for BF16 (measured in
// benchmarks/kquant_gemv.py's style on this 2-core AVX2 host). F32, 3072 x 576 on that host, A/B
// against float_tile: 11 -> 19, 43 -> 68, 47 -> 84 GFLOP/s at M = 1, 4, 32 (its 8-lane tile spent
// 5 loads per 4 FMAs). Each output is still one FMA chain in K order, so the bits equal
// float_tile's (the AVX-512 kernels'; checked A/B for F32).
template <int WT, int MR>
static inline void float_tile16(const uint8_t* wg, const QAct& a, int m0, __m256* ev, __m256* od) {
    constexpr int ES = WT == W_F32X16 ? 4 : 2;  // bytes per weight
    const __m256i odd_mask = _mm256_set1_epi32(int(0xFFFF0000u));
    const int nb = a.nb;
    for (int r = 0; r < MR; ++r) ev[r] = od[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b, wg += 16 * QK * ES) {
        const float* x[MR];
        for (int r = 0; r < MR; ++r) x[r] = a.f + (size_t(m0 + r) * nb + b) * QK;
        for (int e = 0; e < QK; ++e) {
            __m256 we, wo;  // BF16: even and odd rows; F32: rows 0-7 and 8-15
            if constexpr (WT == W_F32X16) {
                we = _mm256_loadu_ps(reinterpret_cast<const float*>(wg + 64 * e));
                wo = _mm256_loadu_ps(reinterpret_cast<const float*>(wg + 64 * e + 32));
            } else {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * e));
                we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                wo = _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask));
            }
            for (int r = 0; r < MR; ++r) {
                const __m256 xr = _mm256_broadcast_ss(x[r] + e);
                ev[r] = _mm256_fmadd_ps(we, xr, ev[r]);
                od[r] = _mm256_fmadd_ps(wo, xr, od[r]);
            }
        }
    }
}

template <int WT>
static void float_gemm16(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                         const float* bias, bool accumulate) {
    constexpr int MR = 4;  // 8 accumulators, 2 weight vectors, a broadcast and the mask: 12 of 16 registers
    const size_t GB = group_block_bytes(WT);
    __m256 ev[MR], od[MR];
    for (int g = n0 / 16; g < n1 / 16; ++g) {
        const uint8_t* wg = w + size_t(g) * nb * GB;
        const int n = 16 * g;
        const __m256 b0 = bias ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
        const __m256 b1 = bias ? _mm256_loadu_ps(bias + n + 8) : _mm256_setzero_ps();
        auto store = [&](int m, __m256 e, __m256 o) {  // -> rows 0..7, 8..15
            __m256 r0 = e, r1 = o;
            if constexpr (WT != W_F32X16) {  // lanes (even rows, odd rows)
                const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);  // rows 0-3|8-11, 4-7|12-15
                r0 = _mm256_permute2f128_ps(lo, hi, 0x20), r1 = _mm256_permute2f128_ps(lo, hi, 0x31);
            }
            float* dst = y + size_t(m) * ldy + n;
            r0 = _mm256_add_ps(r0, b0), r1 = _mm256_add_ps(r1, b1);
            if (accumulate) {
                r0 = _mm256_add_ps(r0, _mm256_loadu_ps(dst));
                r1 = _mm256_add_ps(r1, _mm256_loadu_ps(dst + 8));
            }
            _mm256_storeu_ps(dst, r0);
            _mm256_storeu_ps(dst + 8, r1);
        };
        int m0 = 0;
        for (; m0 + MR <= M; m0 += MR) {
            float_tile16<WT, MR>(wg, a, m0, ev, od);
            for (int r = 0; r < MR; ++r) store(m0 + r, ev[r], od[r]);
        }
        for (int rest; (rest = M - m0) > 0;) {
            const int mr = rest >= 2 ? 2 : 1;
            if (mr == 2) float_tile16<WT, 2>(wg, a, m0, ev, od);
            else float_tile16<WT, 1>(wg, a, m0, ev, od);
            for (int r = 0; r < mr; ++r) store(m0 + r, ev[r], od[r]);
            m0 += mr;
        }
    }
}
#endif

// The tiles packed_gemm_t runs for M rows (tp_gemm_tiles, for the tests).
template <int WT>
static int tiles_of(bool fine, int M, int32_t* sizes) {
    int n = 0;
    for (int m0 = 0; m0 < M; m0 += sizes[n++])
        sizes[n] = fine ? next_tile_rows<WT, true>(M, M - m0) : next_tile_rows<WT, false>(M, M - m0);
    return n;
}

static int packed_tiles(int wtype, bool fine, int M, int32_t* sizes) {
    switch (wtype) {
        case W_Q4X16: return tiles_of<W_Q4X16>(fine, M, sizes);
        case W_Q8X16: return tiles_of<W_Q8X16>(fine, M, sizes);
        case W_Q5X16: return tiles_of<W_Q5X16>(fine, M, sizes);
        case W_Q4KX16: return tiles_of<W_Q4KX16>(fine, M, sizes);
        case W_Q5KX16: return tiles_of<W_Q5KX16>(fine, M, sizes);
        case W_Q6KX16: return tiles_of<W_Q6KX16>(fine, M, sizes);
        default: return 0;
    }
}

template <int WT>
static void packed_gemm(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                        const float* bias, bool accumulate) {
    if (a.q2 && !is_float_packed(WT)) packed_gemm_t<WT, true>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
    else packed_gemm_t<WT, false>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
}
