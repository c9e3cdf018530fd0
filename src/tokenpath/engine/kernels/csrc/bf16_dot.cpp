// AVX512_BF16 GEMM for BF16X16 weights (issue 42): a bf16 checkpoint's linears on CPUs that have
// VDPBF16PS but no AMX (AMD Zen 4 and later, Intel Cooper Lake), computed as vLLM CPU and
// transformers compute that checkpoint: bf16 activations, bf16 weights, float32 sums.
//
// Why: without AMX, BF16X16 rows ran kquant_impl.h's float_tile: each weight widened to float32
// in registers, then one FMA per weight and row (16 multiply-adds an instruction). VDPBF16PS does
// 32 (two k a lane), and reads the weights as stored: a bf16 prefill is bound by these
// multiply-adds, not by reading the weights: bf16 prefill 1.8x, a 32-row decode step 1.4x
// (benchmarks/results/bf16_dot_zen4.md).
//
// Layout: BF16X16 keeps, per 16-row group and 32-weight block, weight e of row i at byte
// 32 e + 2 i. VDPBF16PS wants lane i to hold (k = 2p, k = 2p + 1) of row i side by side: one
// vpermw per 64 bytes (amx::kPairInterleave, as AMX's B tiles) turns two k rows into one pair
// row. With many rows of activations a panel of groups is turned once per call into a per-thread
// scratch and reused by every tile of rows; with few (decode) each 64 bytes is turned as it
// streams from memory.
//
// Rows: every row of a matmul that takes bf16 activations runs here, whatever M is, and each
// output's sum runs over K in the same order, in one accumulator, whatever tile its row lands
// in: a row's result does not depend on what shares its step (batching, chunked prefill and
// speculation give the same tokens). Callers check runs() first (forward.cpp, tp_gemm): without
// AVX512_BF16 the instruction is a SIGILL.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "pair_pack.h"  // amx::pack_pairs: a panel's groups as pair rows
#include "tp_kernels.h"

namespace tp::bf16dot {
namespace {

constexpr int kMR = 6;         // activation rows per register tile
constexpr int kNG = 4;         // 16-row groups per register tile: kMR x kNG = 24 accumulators
constexpr int kPackRows = 12;  // rows from which a panel of groups is turned once, not per tile

inline int32_t pair_at(const uint16_t* p) {  // two bf16 as one 32-bit broadcast
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Rows x[0, MR) (ldx bf16 a row) times NG groups (w[j]: group-blocks, pair rows when PACKED,
// else BF16X16 as stored), into y's columns n.. (16 per group).
template <int MR, int NG, bool PACKED>
void tile(const uint16_t* x, size_t ldx, const uint8_t* const* w, int nb, float* y, int ldy, int n,
          const float* bias, bool accumulate) {
    __m512 acc[MR][NG];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NG; ++j) acc[r][j] = _mm512_setzero_ps();
    const __m512i idx = _mm512_load_si512(amx::kPairInterleave);
    for (int b = 0; b < nb; ++b) {
        const uint16_t* xb = x + 32 * size_t(b);
        for (int p = 0; p < 16; ++p) {
            __m512i wv[NG];
            for (int j = 0; j < NG; ++j) {
                const uint8_t* src = w[j] + 1024 * size_t(b) + 64 * p;
                if constexpr (PACKED) wv[j] = _mm512_load_si512(src);
                else wv[j] = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(src));
            }
            for (int r = 0; r < MR; ++r) {
                const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair_at(xb + r * ldx + 2 * p)));
                for (int j = 0; j < NG; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], reinterpret_cast<__m512bh>(wv[j]), xv);
            }
        }
    }
    for (int j = 0; j < NG; ++j) {
        const __m512 vb = bias ? _mm512_loadu_ps(bias + n + 16 * j) : _mm512_setzero_ps();
        for (int r = 0; r < MR; ++r) {
            float* dst = y + size_t(r) * ldy + n + 16 * j;
            __m512 v = bias ? _mm512_add_ps(acc[r][j], vb) : acc[r][j];
            if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(dst));
            _mm512_storeu_ps(dst, v);
        }
    }
}

template <int NG, bool PACKED>
void tile_rows(int mr, const uint16_t* x, size_t ldx, const uint8_t* const* w, int nb, float* y, int ldy, int n,
               const float* bias, bool accumulate) {
    switch (mr) {
        case 1: return tile<1, NG, PACKED>(x, ldx, w, nb, y, ldy, n, bias, accumulate);
        case 2: return tile<2, NG, PACKED>(x, ldx, w, nb, y, ldy, n, bias, accumulate);
        case 3: return tile<3, NG, PACKED>(x, ldx, w, nb, y, ldy, n, bias, accumulate);
        case 4: return tile<4, NG, PACKED>(x, ldx, w, nb, y, ldy, n, bias, accumulate);
        case 5: return tile<5, NG, PACKED>(x, ldx, w, nb, y, ldy, n, bias, accumulate);
        default: return tile<kMR, NG, PACKED>(x, ldx, w, nb, y, ldy, n, bias, accumulate);
    }
}

template <bool PACKED>
void tile_any(int ng, int mr, const uint16_t* x, size_t ldx, const uint8_t* const* w, int nb, float* y, int ldy,
              int n, const float* bias, bool accumulate) {
    switch (ng) {
        case 1: return tile_rows<1, PACKED>(mr, x, ldx, w, nb, y, ldy, n, bias, accumulate);
        case 2: return tile_rows<2, PACKED>(mr, x, ldx, w, nb, y, ldy, n, bias, accumulate);
        case 3: return tile_rows<3, PACKED>(mr, x, ldx, w, nb, y, ldy, n, bias, accumulate);
        default: return tile_rows<kNG, PACKED>(mr, x, ldx, w, nb, y, ldy, n, bias, accumulate);
    }
}

// Groups per panel (a multiple of kNG, 4 to 16): their pair rows (nb KiB each) take at most
// ~512 KiB of the core's L2 beside the activation rows a tile reads.
inline int panel_groups(int nb) {
    const int fit = int((size_t(512) << 10) / (size_t(nb) << 10));
    return std::max(kNG, std::min(4 * kNG, fit / kNG * kNG));
}

}  // namespace

bool runs() {
    static const bool ok = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    }();
    return ok;
}

void gemm(const uint8_t* w, int nb, const uint16_t* x, int M, float* y, int ldy, int n0, int n1, const float* bias,
          bool accumulate) {
    const size_t group_bytes = size_t(nb) * 1024, ldx = size_t(nb) * 32;
    const int g0 = n0 / 16, g1 = n1 / 16;
    if (M < kPackRows) {  // few rows: each weight byte is read once, turned as it streams
        for (int g = g0; g < g1; g += kNG) {
            const int ng = std::min(kNG, g1 - g);
            const uint8_t* wg[kNG];
            for (int j = 0; j < kNG; ++j) wg[j] = w + size_t(g + std::min(j, ng - 1)) * group_bytes;
            for (int m0 = 0; m0 < M; m0 += kMR) {
                const int mr = std::min(kMR, M - m0);
                tile_any<false>(ng, mr, x + m0 * ldx, ldx, wg, nb, y + size_t(m0) * ldy, ldy, 16 * g, bias, accumulate);
            }
        }
        return;
    }
    // Many rows: a panel's groups turned once into scratch (grown once per thread and kept), then
    // every tile of rows passes over the whole panel before the next rows are read.
    const int panel = panel_groups(nb);
    thread_local std::vector<uint16_t> scratch;
    const size_t per_group = size_t(nb) * 512;  // uint16 a group
    if (scratch.size() < panel * per_group + 32) scratch.resize(panel * per_group + 32);
    uint16_t* base = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
    for (int gp = g0; gp < g1; gp += panel) {
        const int gn = std::min(panel, g1 - gp);
        for (int j = 0; j < gn; ++j)
            amx::pack_pairs(w + size_t(gp + j) * group_bytes, size_t(nb), base + j * per_group);
        // Tiles of nearly equal rows (32: 6, 6, 5, 5, 5, 5), not kMR and a short rest (6 x 5 + 2): a
        // tile's weight loads cost the same whatever its rows.
        const int tiles = (M + kMR - 1) / kMR;
        for (int t = 0, m0 = 0; t < tiles; ++t) {
            const int mr = (M - m0) / (tiles - t) + ((M - m0) % (tiles - t) ? 1 : 0);
            for (int g = gp; g < gp + gn; g += kNG) {
                const int ng = std::min(kNG, gp + gn - g);
                const uint8_t* wg[kNG];
                for (int j = 0; j < kNG; ++j)
                    wg[j] = reinterpret_cast<const uint8_t*>(base + (g - gp + std::min(j, ng - 1)) * per_group);
                tile_any<true>(ng, mr, x + m0 * ldx, ldx, wg, nb, y + size_t(m0) * ldy, ldy, 16 * g, bias, accumulate);
            }
            m0 += mr;
        }
    }
}

}  // namespace tp::bf16dot
