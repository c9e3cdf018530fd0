// A STREAM-like read of memory: the XOR of every 64-bit word of a buffer, in the widest vectors of
// the kernel set that includes it (dot_avx512.cpp: 512-bit loads; dot_avx2.cpp: 256-bit). It is
// the ceiling a bandwidth-bound decode is measured against (tp_stream_read, read_bw.h): numpy's
// sum over float32 (pairwise float adds) is compute-bound on some hosts and reported under half
// of what the engine's own GEMVs read. XOR keeps the loads (the result is used) at one cheap op
// per load, with four independent accumulators so no dependency chain limits the loop.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace TP_NS {

// XOR of the 64-bit words of p[0, n); n a multiple of 256 (kStreamUnit).
uint64_t stream_xor(const uint8_t* p, size_t n) {
#if TP_VNNI
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
    }
    const __m512i x = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512(lanes, x);
    uint64_t r = 0;
    for (uint64_t v : lanes) r ^= v;
    return r;
#else
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 256) {
        const __m256i* v = reinterpret_cast<const __m256i*>(p + i);
        a0 = _mm256_xor_si256(a0, _mm256_xor_si256(_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)));
        a1 = _mm256_xor_si256(a1, _mm256_xor_si256(_mm256_loadu_si256(v + 2), _mm256_loadu_si256(v + 3)));
        a2 = _mm256_xor_si256(a2, _mm256_xor_si256(_mm256_loadu_si256(v + 4), _mm256_loadu_si256(v + 5)));
        a3 = _mm256_xor_si256(a3, _mm256_xor_si256(_mm256_loadu_si256(v + 6), _mm256_loadu_si256(v + 7)));
    }
    const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
    return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
#endif
}

}  // namespace TP_NS
