// BF16X16 blocks as pair rows: 32 bf16 of two k rows (16 columns each) -> (k, k + 1) of each column
// side by side, one vpermw per 64 bytes (kPairInterleave). Both bf16 GEMMs read weights this way:
// AMX's B tiles (amx_bf16.cpp) and VDPBF16PS's operands (bf16_dot.cpp), each of which includes this
// under its own AVX-512 target.
#pragma once
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "tp_kernels.h"

namespace tp::amx {

// nblocks 1 KiB blocks (16 rows x 32 weights) at wg -> the same count of pair-row blocks at dst (64-byte aligned).
static inline void pack_pairs(const uint8_t* wg, size_t nblocks, uint16_t* dst) {
    const __m512i idx = _mm512_load_si512(kPairInterleave);
    for (size_t i = 0; i < nblocks * 16; ++i)
        _mm512_store_si512(dst + 32 * i, _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(wg + 64 * i)));
}

}  // namespace tp::amx
