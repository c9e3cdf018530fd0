// K-quant GEMM on AMX-INT8 tiles for steps of several int8 rows (batched decode), issue 42.
// Included by dot_impl.h inside the AVX-512 namespace, after kquant_impl.h (kq_weights) and
// tile_pack.h.
//
// Why: a generated row takes fine activations (int8 + residual bytes, QAct::q2): two vpdpbusd per
// 4 weights x 16 outputs, so a K-quant step of M rows costs M times one row's multiply-adds on the
// one 512-bit VNNI port: at 32 rows a ~4B Qwen3 step took 8-10x a 1-row step, compute-bound at
// ~24 weights per cycle per row. Wider VNNI tiles spill (8 rows measured slower than 4). One
// TDPBSUD does 16 rows x 16 outputs x 32 weights; what is left is the per-row float epilogue of
// each 32-block: 10-25% off a batched step's matmuls (benchmarks/results/kquant_amx_int8.md).
//
// The same numbers, bit for bit: a 32-block's integer sums (coarse and residual) are the same
// integers as kq_isum's whatever unit adds them, and each row's float operations after them are
// kq_block's, in the same order (scale, then minimum; Q6_K's halves in order). So a row's result
// does not depend on the path or the batch, and greedy outputs do not change.
//
// Per 16-row weight group and tile of up to 16 activation rows, per 32-block: the 8 chunks of
// unsigned weights (kq_weights: chunk c = weights 4c..4c+3 of each of the 16 outputs, which is
// a B tile's row c) go to a 512-byte buffer; A tiles are the rows' 32 int8 (and residual) bytes,
// read in place (stride: the row's nb * 32 bytes); the C tiles (int32) go to a buffer, and the
// AVX-512 epilogue scales them into 16 float accumulators. Q6_K's scale per 16 weights: two B
// tiles that hold one half each (the other half's rows stay zero) and two pairs of C tiles.
#if TP_VNNI
#define TP_AMX8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

// Rows from which a K-quant step runs on AMX-INT8 tiles (benchmarks/results/kquant_amx_int8.md).
constexpr int kAmxInt8Rows = 8;

// The CPU has AMX-INT8 (CPUID.(7,0):EDX[25]) and the process may use tiles (amx_permitted).
inline bool amx_int8_usable() {
    static const bool ok = [] {
        unsigned a = 7, b = 0, c = 0, d = 0;
        __asm__("cpuid" : "+a"(a), "=b"(b), "+c"(c), "=d"(d));  // leaf 7 is there: amx_permitted asks it first
        return amx_permitted() && ((d >> 25) & 1);
    }();
    return ok;
}

template <int WT>
constexpr bool amx_int8_type() { return WT == W_Q4KX16 || WT == W_Q5KX16 || WT == W_Q6KX16; }

// Rows of each activation tile for M rows: ceil(M / 16) tiles of nearly equal rows.
inline int amx_int8_tile_rows(int rest, int M) {
    const int tiles = (M + 15) / 16, size = (M + tiles - 1) / tiles;
    return rest < size ? rest : size;
}

// Tiles: 0, 1 C (coarse, residual) of the 32-block or Q6_K's first half, 6, 7 Q6_K's second half;
// 2, 3 A (q, q2); 4 B (5: Q6_K's second half).
TP_AMX8_TARGET inline void amx_int8_config(int mr) {
    amx::TileConfig cfg;
    for (int t : {0, 1, 6, 7}) cfg.rows[t] = uint8_t(mr), cfg.colsb[t] = 64;
    for (int t : {2, 3}) cfg.rows[t] = uint8_t(mr), cfg.colsb[t] = 32;
    for (int t : {4, 5}) cfg.rows[t] = 8, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// The Q4_K / Q5_K float work of sub-block k for a tile's rows, from their integer sums in c (and
// the residual bytes' at c + 256): each row's sum times the block's scale and the row's activation
// scale, plus the block's min times the row's sum of activations; the VNNI kernel's order.
template <bool RES, int k>
TP_AMX8_TARGET static inline void amx8_scale_min(const uint8_t* g, VF dw, VF dm, const int32_t* c, const QAct& a,
                                                 int m0, int mr, int b, VF* acc) {
    const VF dsc = vmul(dw, vcvt(vu8(g + 64 + 16 * k)));
    const VF mw = vmul(dm, vcvt(vsub32(vzero(), vu8(g + 192 + 16 * k))));
    for (int r = 0; r < mr; ++r) {
        const size_t ab = size_t(m0 + r) * a.nb + b;
        const VI co = _mm512_load_si512(c + 16 * r);
        const VI isum = RES ? combine(co, _mm512_load_si512(c + 256 + 16 * r)) : co;
        acc[r] = vfma(vcvt(isum), vmul(dsc, vfset(a.d[ab])), acc[r]);
        acc[r] = vfma(mw, vfset(a.s[ab]), acc[r]);
    }
}

// Sub-block k of super-block g (b = its 32-block index) for rows m0..m0+mr, added into acc.
template <int WT, bool RES, int k>
TP_AMX8_TARGET static inline void amx8_block(const uint8_t* g, const QAct& a, int m0, int mr, int b, VF dw, VF dm,
                                             uint8_t* bt, int32_t* cbuf, VF* acc) {
    const size_t lda = size_t(a.nb) * QK;
    const int8_t* qa = a.q + size_t(m0) * lda + size_t(b) * QK;
    if constexpr (WT == W_Q6KX16) {
        for (int c = 0; c < 8; ++c) _mm512_store_si512(bt + 512 * (c >> 2) + 64 * c, kq_weights<WT, k>(g, 0, c));
        _tile_loadd(4, bt, 64);
        _tile_loadd(5, bt + 512, 64);
    } else {
        for (int c = 0; c < 8; ++c) _mm512_store_si512(bt + 64 * c, kq_weights<WT, k>(g, 0, c));
        _tile_loadd(4, bt, 64);
    }
    _tile_loadd(2, qa, lda);
    _tile_zero(0);
    _tile_dpbsud(0, 2, 4);
    if constexpr (WT == W_Q6KX16) {
        _tile_zero(6);
        _tile_dpbsud(6, 2, 5);
    }
    if constexpr (RES) {
        _tile_loadd(3, a.q2 + size_t(m0) * lda + size_t(b) * QK, lda);
        _tile_zero(1);
        _tile_dpbsud(1, 3, 4);
        if constexpr (WT == W_Q6KX16) {
            _tile_zero(7);
            _tile_dpbsud(7, 3, 5);
        }
    }
    _tile_stored(0, cbuf, 64);
    if constexpr (RES) _tile_stored(1, cbuf + 256, 64);
    if constexpr (WT == W_Q6KX16) {
        _tile_stored(6, cbuf + 512, 64);
        if constexpr (RES) _tile_stored(7, cbuf + 768, 64);
        for (int half = 0; half < 2; ++half) {
            const VF dsc = vmul(dw, vcvt(vi8(g + 64 + 16 * (2 * k + half))));
            const int32_t* c = cbuf + 512 * half;
            for (int r = 0; r < mr; ++r) {
                const size_t ab = size_t(m0 + r) * a.nb + b;
                const VI co = _mm512_load_si512(c + 16 * r);
                const VI isum = RES ? combine(co, _mm512_load_si512(c + 256 + 16 * r)) : co;
                const VI off = vset32(32 * a.qsum16[2 * ab + half]);
                acc[r] = vfma(vcvt(vsub32(isum, off)), vmul(dsc, vfset(a.d[ab])), acc[r]);
            }
        }
    } else {
        amx8_scale_min<RES, k>(g, dw, dm, cbuf, a, m0, mr, b, acc);
    }
}

template <int WT, bool RES, int... K>
TP_AMX8_TARGET static inline void amx8_super(const uint8_t* g, const QAct& a, int m0, int mr, int sb, uint8_t* bt,
                                             int32_t* cbuf, VF* acc, std::integer_sequence<int, K...>) {
    const VF dw = vhalf(g), dm = WT == W_Q6KX16 ? dw : vhalf(g + 32);
    (amx8_block<WT, RES, K>(g, a, m0, mr, kSuper * sb + K, dw, dm, bt, cbuf, acc), ...);
}

// Q4_K / Q5_K, two groups (32 outputs) at once: one A tile load feeds both groups' multiplies,
// and the two groups' C tiles (0, 1 and 6, 7) are independent chains (tiles are not renamed).
template <int WT, bool RES, int k>
TP_AMX8_TARGET static inline void amx8_pair_block(const uint8_t* g0, const uint8_t* g1, const QAct& a, int m0, int mr,
                                                  int b, const VF* dwm, uint8_t* bt, int32_t* cbuf, VF* acc0, VF* acc1) {
    const size_t lda = size_t(a.nb) * QK;
    for (int c = 0; c < 8; ++c) {
        _mm512_store_si512(bt + 64 * c, kq_weights<WT, k>(g0, 0, c));
        _mm512_store_si512(bt + 512 + 64 * c, kq_weights<WT, k>(g1, 0, c));
    }
    _tile_loadd(4, bt, 64);
    _tile_loadd(5, bt + 512, 64);
    _tile_loadd(2, a.q + size_t(m0) * lda + size_t(b) * QK, lda);
    _tile_zero(0);
    _tile_zero(6);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbsud(6, 2, 5);
    if constexpr (RES) {
        _tile_loadd(3, a.q2 + size_t(m0) * lda + size_t(b) * QK, lda);
        _tile_zero(1);
        _tile_zero(7);
        _tile_dpbsud(1, 3, 4);
        _tile_dpbsud(7, 3, 5);
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(6, cbuf + 512, 64);
    if constexpr (RES) {
        _tile_stored(1, cbuf + 256, 64);
        _tile_stored(7, cbuf + 768, 64);
    }
    amx8_scale_min<RES, k>(g0, dwm[0], dwm[1], cbuf, a, m0, mr, b, acc0);
    amx8_scale_min<RES, k>(g1, dwm[2], dwm[3], cbuf + 512, a, m0, mr, b, acc1);
}

template <int WT, bool RES, int... K>
TP_AMX8_TARGET static inline void amx8_pair_super(const uint8_t* g0, const uint8_t* g1, const QAct& a, int m0, int mr,
                                                  int sb, uint8_t* bt, int32_t* cbuf, VF* acc0, VF* acc1,
                                                  std::integer_sequence<int, K...>) {
    const VF dwm[4] = {vhalf(g0), vhalf(g0 + 32), vhalf(g1), vhalf(g1 + 32)};
    (amx8_pair_block<WT, RES, K>(g0, g1, a, m0, mr, kSuper * sb + K, dwm, bt, cbuf, acc0, acc1), ...);
}

// y[m, n0..n1) for all M rows (as packed_gemm_t, whose store it repeats: + bias, + y).
template <int WT, bool RES>
TP_AMX8_TARGET static void amx_int8_gemm_t(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0,
                                           int n1, const float* bias, bool accumulate) {
    constexpr size_t GB = WT == W_Q4KX16 ? 2368 : WT == W_Q5KX16 ? 2880 : 3392;
    alignas(64) uint8_t bt[1024] = {};  // Q6_K: each half's other rows stay zero
    alignas(64) int32_t cbuf[1024];
    VF acc[32];  // [0, 16): group g's rows, [16, 32): group g + 1's (pairs)
    int loaded = 0;
    const int g1 = n1 / 16;
    for (int g = n0 / 16; g < g1;) {
        const int ng = WT != W_Q6KX16 && g + 1 < g1 ? 2 : 1;
        const uint8_t* wg = w + size_t(g) * (nb / kSuper) * GB;
        for (int m0 = 0; m0 < M;) {
            const int mr = amx_int8_tile_rows(M - m0, M);
            if (mr != loaded) amx_int8_config(mr), loaded = mr;
            for (int r = 0; r < 32; ++r) acc[r] = vfzero();
            for (int sb = 0; sb < nb / kSuper; ++sb) {
                if (ng == 2)
                    amx8_pair_super<WT, RES>(wg + sb * GB, wg + (nb / kSuper) * GB + sb * GB, a, m0, mr, sb, bt, cbuf,
                                             acc, acc + 16, std::make_integer_sequence<int, kSuper>{});
                else
                    amx8_super<WT, RES>(wg + sb * GB, a, m0, mr, sb, bt, cbuf, acc, std::make_integer_sequence<int, kSuper>{});
            }
            for (int j = 0; j < ng; ++j) {
                const VF vb = bias ? vfload(bias + 16 * (g + j)) : vfzero();
                for (int r = 0; r < mr; ++r) {
                    float* dst = y + size_t(m0 + r) * ldy + 16 * (g + j);
                    VF v = vfadd(acc[16 * j + r], vb);
                    if (accumulate) v = vfadd(v, vfload(dst));
                    vfstore(dst, v);
                }
            }
            m0 += mr;
        }
        g += ng;
    }
    if (loaded) _tile_release();
}

// The row tiles of an M-row GEMM of `wtype` (tp_gemm_tiles): AMX-INT8 ones, or 0 where the VNNI
// kernels run it (packed_tiles says theirs).
inline int amx_int8_tiles(int wtype, int M, int32_t* sizes) {
    if (M < kAmxInt8Rows || (wtype != W_Q4KX16 && wtype != W_Q5KX16 && wtype != W_Q6KX16) || !amx_int8_usable()) return 0;
    int n = 0;
    for (int m0 = 0; m0 < M; m0 += sizes[n++]) sizes[n] = amx_int8_tile_rows(M - m0, M);
    return n;
}

// Runs the GEMM on tiles and returns true, or false (the caller's VNNI kernels run it).
template <int WT>
static bool amx_int8_gemm(const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy, int n0, int n1,
                          const float* bias, bool accumulate) {
    if constexpr (!amx_int8_type<WT>()) {
        return false;
    } else {
        if (M < kAmxInt8Rows || !amx_int8_usable()) return false;
        if (a.q2) amx_int8_gemm_t<WT, true>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
        else amx_int8_gemm_t<WT, false>(w, nb, a, M, y, ldy, n0, n1, bias, accumulate);
        return true;
    }
}
#endif
