// Scalar block (de)quantizers and CPU feature detection: load-time work, not in the hot loop.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "tp_kernels.h"

namespace tp {

float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float f;
    if (exp == 0) {
        f = std::ldexp(float(man), -24);
    } else if (exp == 31) {
        f = man ? NAN : INFINITY;
    } else {
        f = std::ldexp(float(man | 0x400), int(exp) - 25);
    }
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t fp32_to_fp16(float f) {  // round to nearest even; values here are small scales
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    x &= 0x7FFFFFFF;
    if (x >= 0x47800000) return uint16_t(sign | 0x7C00);  // overflow -> inf
    if (x < 0x38800000) {                                // subnormal half
        const float a = std::fabs(f) * 16777216.f;       // 2^24
        return uint16_t(sign | uint32_t(std::nearbyint(a)));
    }
    const uint32_t mant = x & 0x1FFF, base = ((x - 0x38000000) >> 13);
    uint32_t h = base + (mant > 0x1000 || (mant == 0x1000 && (base & 1)));
    return uint16_t(sign | h);
}

}  // namespace tp

using namespace tp;

extern "C" {

// Bit 0: AVX2+FMA (the native path's minimum); bit 1: AVX-512 F/BW/VL/VNNI; bit 2: F16C, the
// half <-> float conversions a float16 KV cache needs (without it the KV cache stays float32).
int tp_cpu_features() {
    __builtin_cpu_init();
    int f = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= 1;
    if ((f & 1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        f |= 2;
    if ((f & 1) && __builtin_cpu_supports("f16c")) f |= 4;
    return f;
}

// Quantizes N rows of K floats into GGUF blocks (rows padded with zeros to a multiple of 32):
// the q8_0 option for safetensors checkpoints, and random weights for the kernel tests.
void tp_quantize(int wtype, const float* src, int N, int K, uint8_t* dst) {
    const int nb = (K + QK - 1) / QK;
    const size_t bb = block_bytes(wtype);
    for (int n = 0; n < N; ++n) {
        for (int b = 0; b < nb; ++b) {
            float v[QK];
            for (int i = 0; i < QK; ++i) {
                const int k = b * QK + i;
                v[i] = k < K ? src[size_t(n) * K + k] : 0.f;
            }
            uint8_t* blk = dst + (size_t(n) * nb + b) * bb;
            if (wtype == W_Q8_0) {
                float amax = 0.f;
                for (float x : v) amax = std::fmax(amax, std::fabs(x));
                const float d = amax / 127.f, id = d ? 1.f / d : 0.f;
                const uint16_t dh = fp32_to_fp16(d);
                std::memcpy(blk, &dh, 2);
                for (int i = 0; i < QK; ++i) blk[2 + i] = uint8_t(int8_t(std::lround(v[i] * id)));
            } else if (wtype == W_Q4_1) {
                float lo = v[0], hi = v[0];
                for (float x : v) lo = std::fmin(lo, x), hi = std::fmax(hi, x);
                const float d = (hi - lo) / 15.f, id = d ? 1.f / d : 0.f;
                const uint16_t dh = fp32_to_fp16(d), mh = fp32_to_fp16(lo);
                std::memcpy(blk, &dh, 2);
                std::memcpy(blk + 2, &mh, 2);
                for (int i = 0; i < QK / 2; ++i) {
                    const int a = std::min(15, int((v[i] - lo) * id + 0.5f));
                    const int c = std::min(15, int((v[i + 16] - lo) * id + 0.5f));
                    blk[4 + i] = uint8_t(a | (c << 4));
                }
            } else {  // Q4_0: d = max / -8 keeps the largest magnitude exact (ggml's choice)
                float amax = 0.f, mx = 0.f;
                for (float x : v)
                    if (std::fabs(x) > amax) amax = std::fabs(x), mx = x;
                const float d = mx / -8.f, id = d ? 1.f / d : 0.f;
                const uint16_t dh = fp32_to_fp16(d);
                std::memcpy(blk, &dh, 2);
                for (int i = 0; i < QK / 2; ++i) {
                    const int a = std::min(15, int(v[i] * id + 8.5f));
                    const int c = std::min(15, int(v[i + 16] * id + 8.5f));
                    blk[2 + i] = uint8_t(a | (c << 4));
                }
            }
        }
    }
}

// One row of blocks -> K floats (embedding lookups and the tests' reference).
void tp_dequantize_row(int wtype, const uint8_t* src, int K, float* dst) {
    const size_t bb = block_bytes(wtype);
    for (int k0 = 0, b = 0; k0 < K; k0 += QK, ++b) {
        const uint8_t* blk = src + b * bb;
        uint16_t dh;
        std::memcpy(&dh, blk, 2);
        const float d = fp16_to_fp32(dh);
        float v[QK];
        if (wtype == W_Q8_0) {
            for (int i = 0; i < QK; ++i) v[i] = d * float(int8_t(blk[2 + i]));
        } else {
            float m = -8.f * d;
            const uint8_t* qs = blk + 2;
            if (wtype == W_Q4_1) {
                uint16_t mh;
                std::memcpy(&mh, blk + 2, 2);
                m = fp16_to_fp32(mh);
                qs = blk + 4;
            }
            for (int i = 0; i < QK / 2; ++i) {
                v[i] = d * float(qs[i] & 0xF) + m;
                v[i + 16] = d * float(qs[i] >> 4) + m;
            }
        }
        for (int i = 0; i < QK && k0 + i < K; ++i) dst[k0 + i] = v[i];
    }
}

}  // extern "C"

namespace tp {

void dequantize_packed_row(int wtype, const uint8_t* w, int nb, int n, int K, float* dst) {
    const size_t gb = group_block_bytes(wtype);
    const uint8_t* g = w + size_t(n / kGroupRows) * nb * gb;
    const int i = n % kGroupRows;
    for (int b = 0; b < nb; ++b, g += gb) {
        uint16_t dh;
        std::memcpy(&dh, g + 2 * i, 2);
        const float d = fp16_to_fp32(dh);
        float v[QK];
        if (wtype == W_Q8X16) {
            for (int c = 0; c < 8; ++c)
                for (int j = 0; j < 4; ++j) v[4 * c + j] = d * float(int8_t(g[64 + 64 * c + 4 * i + j]));
        } else {
            uint16_t mh;
            std::memcpy(&mh, g + 32 + 2 * i, 2);
            const float m = fp16_to_fp32(mh);
            for (int c = 0; c < 4; ++c)
                for (int j = 0; j < 4; ++j) {
                    const uint8_t byte = g[64 + 64 * c + 4 * i + j];
                    v[4 * c + j] = d * float(byte & 0xF) + m;
                    v[16 + 4 * c + j] = d * float(byte >> 4) + m;
                }
        }
        for (int k = 0; k < QK && b * QK + k < K; ++k) dst[b * QK + k] = v[k];
    }
}

}  // namespace tp

extern "C" {

// GGUF rows (N of them, nb blocks each) -> the 16-row interleaved layout packed_impl.h describes.
// Returns the packed type (W_Q4X16 for Q4_0 and Q4_1, W_Q8X16 for Q8_0), or -1 when N is not a
// multiple of 16 or the type has no packed form (the caller keeps the GGUF layout then). dst
// holds N * nb * group_block_bytes / 16 bytes. Load-time work: a few milliseconds for this model.
int tp_repack(int wtype, const uint8_t* src, int N, int nb, uint8_t* dst) {
    if (N % kGroupRows || (wtype != W_Q4_0 && wtype != W_Q4_1 && wtype != W_Q8_0)) return -1;
    const int pt = wtype == W_Q8_0 ? W_Q8X16 : W_Q4X16;
    const size_t bb = block_bytes(wtype), gb = group_block_bytes(pt), row = size_t(nb) * bb;
    for (int g = 0; g < N / kGroupRows; ++g) {
        for (int b = 0; b < nb; ++b) {
            uint8_t* out = dst + (size_t(g) * nb + b) * gb;
            std::memset(out, 0, gb);  // Q8X16's padding
            for (int i = 0; i < kGroupRows; ++i) {
                const uint8_t* blk = src + size_t(kGroupRows * g + i) * row + b * bb;
                std::memcpy(out + 2 * i, blk, 2);  // d
                if (wtype == W_Q8_0) {
                    for (int c = 0; c < 8; ++c) std::memcpy(out + 64 + 64 * c + 4 * i, blk + 2 + 4 * c, 4);
                    continue;
                }
                uint16_t mh;
                if (wtype == W_Q4_1) {
                    std::memcpy(&mh, blk + 2, 2);
                } else {  // Q4_0: weight = d * (q - 8), so m = -8 d (exact in fp16: a power of two)
                    uint16_t dh;
                    std::memcpy(&dh, blk, 2);
                    mh = fp32_to_fp16(-8.f * fp16_to_fp32(dh));
                }
                std::memcpy(out + 32 + 2 * i, &mh, 2);
                const uint8_t* qs = blk + (wtype == W_Q4_1 ? 4 : 2);
                for (int c = 0; c < 4; ++c) std::memcpy(out + 64 + 64 * c + 4 * i, qs + 4 * c, 4);
            }
        }
    }
    return pt;
}

// Row n of a repacked matrix (nb blocks per row) -> K floats: the tests' reference.
void tp_dequantize_packed_row(int wtype, const uint8_t* w, int nb, int n, int K, float* dst) {
    dequantize_packed_row(wtype, w, nb, n, K, dst);
}

}  // extern "C"
