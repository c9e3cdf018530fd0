// Quantized weights as AMX-BF16 B tiles, for prompt rows (issue 42). Included by dot_impl.h inside
// the AVX-512 namespace, after kquant_impl.h (kq_weights, the lanes' unsigned weight bytes).
//
// Prefill is bound by the GEMMs' multiply-adds: the VNNI kernels run ~54 per cycle per core, one
// AMX-BF16 tile op 16 x 16 x 32 in ~16 cycles. A prompt row's matmuls can take the tiles where
// the CPU has them: each 16-row group's weights are dequantized once per GEMM call into bf16 tiles
// (the file's d * q + m, rounded to nearest even: 2^-9 of each weight, far under its 4-6 bit
// step), and every 16-row tile of the prompt's bf16 activations multiplies them (amx_bf16.cpp).
// The dequantization costs ~0.3 vector ops per weight whatever the number of rows, so it pays
// for long prompts and costs short ones; which rows take it is the row's own kind (a prompt
// row), never the batch (forward.cpp gemm_runs).
//
// A B tile (1 KiB): row r holds weights (2r, 2r + 1) of the 32-block for each of the 16 lanes.
// One chunk of 4 weights per lane (one 512-bit register of the repacked layouts) gives two rows.
#if TP_VNNI
#define TP_TILE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))

// Chunk q (4 weights of each lane as bytes, signed or unsigned) as w = q * s + o, into dst's two rows.
template <bool SIGNED>
TP_TILE_TARGET static inline void tile_chunk(VI q, VF s, VF o, uint16_t* dst) {
    const __m512i idx = _mm512_load_si512(amx::kPairInterleave);
    VF w[4];
    for (int j = 0; j < 4; ++j) {
        const VI qj = SIGNED ? _mm512_srai_epi32(_mm512_slli_epi32(q, 24 - 8 * j), 24)
                             : _mm512_and_si512(_mm512_srli_epi32(q, 8 * j), _mm512_set1_epi32(0xFF));
        w[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qj), s, o);
    }
    for (int p = 0; p < 2; ++p) {  // (even, odd) weights of each lane side by side
        const __m512i b = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[2 * p + 1], w[2 * p]));
        _mm512_store_si512(dst + 32 * p, _mm512_permutexvar_epi16(idx, b));
    }
}

// Sub-block k of one K-quant super-block g: its 32-block's tile.
template <int WT, int k>
TP_TILE_TARGET static inline void tile_kq(const uint8_t* g, VF dw, VF dm, uint16_t* dst) {
    if constexpr (WT == W_Q6KX16) {  // w = d sc (q - 32), a scale per 16 weights
        for (int half = 0; half < 2; ++half) {
            const VF s = vmul(dw, vcvt(vi8(g + 64 + 16 * (2 * k + half))));
            for (int c = 4 * half; c < 4 * half + 4; ++c)
                tile_chunk<false>(kq_weights<WT, k>(g, 0, c), s, vmul(s, vfset(-32.f)), dst + 64 * c);
        }
    } else {  // Q4_K, Q5_K: w = d sc q - dmin mn
        const VF s = vmul(dw, vcvt(vu8(g + 64 + 16 * k)));
        const VF o = vmul(dm, vcvt(vsub32(vzero(), vu8(g + 192 + 16 * k))));
        for (int c = 0; c < 8; ++c) tile_chunk<false>(kq_weights<WT, k>(g, 0, c), s, o, dst + 64 * c);
    }
}

template <int WT, int... K>
TP_TILE_TARGET static inline void tile_super(const uint8_t* g, uint16_t* dst, std::integer_sequence<int, K...>) {
    const VF dw = vhalf(g), dm = WT == W_Q6KX16 ? dw : vhalf(g + 32);
    (tile_kq<WT, K>(g, dw, dm, dst + 512 * K), ...);
}

// One 16-row group (wg, nb 32-blocks) -> nb B tiles at dst (64-byte aligned).
template <int WT>
TP_TILE_TARGET static void tile_pack(const uint8_t* wg, int nb, uint16_t* dst) {
    if constexpr (WT == W_Q4KX16 || WT == W_Q5KX16 || WT == W_Q6KX16) {
        constexpr size_t GB = WT == W_Q4KX16 ? 2368 : WT == W_Q5KX16 ? 2880 : 3392;
        for (int sb = 0; sb < nb / kSuper; ++sb)
            tile_super<WT>(wg + sb * GB, dst + size_t(sb) * kSuper * 512, std::make_integer_sequence<int, kSuper>{});
    } else if constexpr (WT == W_Q5X16) {  // w = d q + m (Q5_0: m = -16 d)
        for (int b = 0; b < nb; ++b, wg += 384, dst += 512)
            for (int c = 0; c < 8; ++c) tile_chunk<false>(kq_weights<WT, 0>(wg, 0, c), vhalf(wg), vhalf(wg + 32), dst + 64 * c);
    } else if constexpr (WT == W_Q4X16) {  // w = d q + m; chunk c's high nibbles are weights 16 + 4c..
        for (int b = 0; b < nb; ++b, wg += 320, dst += 512)
            for (int c = 0; c < 4; ++c) {
                const VI raw = vload(wg + 64 + 64 * c);
                tile_chunk<false>(vand(raw, vbyte(0x0F)), vhalf(wg), vhalf(wg + 32), dst + 64 * c);
                tile_chunk<false>(vand(vsrl4(raw), vbyte(0x0F)), vhalf(wg), vhalf(wg + 32), dst + 64 * (4 + c));
            }
    } else {  // Q8X16: w = d q, q signed
        for (int b = 0; b < nb; ++b, wg += 576, dst += 512)
            for (int c = 0; c < 8; ++c) tile_chunk<true>(vload(wg + 64 + 64 * c), vhalf(wg), vfzero(), dst + 64 * c);
    }
}

// The packer of a repacked quantized type, or nullptr (F16X16, F32X16 and the GGUF row layouts:
// their prompt rows stay on the int8 kernels).
static inline amx::PackFn tile_packer(int wtype) {
    switch (wtype) {
        case W_Q4X16: return tile_pack<W_Q4X16>;
        case W_Q8X16: return tile_pack<W_Q8X16>;
        case W_Q5X16: return tile_pack<W_Q5X16>;
        case W_Q4KX16: return tile_pack<W_Q4KX16>;
        case W_Q5KX16: return tile_pack<W_Q5KX16>;
        case W_Q6KX16: return tile_pack<W_Q6KX16>;
        default: return nullptr;
    }
}
#endif
