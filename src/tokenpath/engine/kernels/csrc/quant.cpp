// Scalar block (de)quantizers and CPU feature detection: load-time work, not in the hot loop.
#include <algorithm>
#include <cmath>
#include <cstring>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "tp_api.h"
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

bool amx_permitted() {
    // Linux's arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): the permission is the process's,
    // so it is asked once (a C++ static's one-time initialisation); CPUID leaf 7 EDX bits 24 and 22
    // are AMX-TILE and AMX-BF16.
    static const bool ok = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 22 & 1)) return false;
        return syscall(SYS_arch_prctl, 0x1023L, 18L) == 0;
    }();
    return ok;
}

}  // namespace tp

using namespace tp;

extern "C" {

// Bit 0: AVX2+FMA (the native path's minimum); bit 1: AVX-512 F/BW/VL/VNNI; bit 2: F16C, the
// half <-> float conversions a float16 KV cache needs (without it the KV cache stays float32);
// bit 3: AMX-BF16 tiles, usable by this process (tp::amx_permitted); bit 4: AVX512_BF16 (VDPBF16PS,
// bf16_dot.cpp's GEMM where there is no AMX).
int tp_cpu_features() {
    __builtin_cpu_init();
    int f = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= 1;
    if ((f & 1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        f |= 2;
    if ((f & 1) && __builtin_cpu_supports("f16c")) f |= 4;
    if ((f & 2) && tp::amx_permitted()) f |= 8;
    if ((f & 2) && __builtin_cpu_supports("avx512bf16")) f |= 16;
    return f;
}

// Quantizes N rows of K floats into GGUF blocks (rows padded with zeros to a multiple of 32):
// the q8_0 option for safetensors checkpoints, and random weights for the kernel tests. Q4_K and
// Q5_0 (`--quantization q4_k`) go to quantize_more.cpp, whose rows are whole blocks (the caller's check).
void tp_quantize(int wtype, const float* src, int N, int K, uint8_t* dst) {
    if (quantize_rows_more(wtype, src, N, K, dst)) return;
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

static float h2f(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return fp16_to_fp32(h);
}

// One 16-row group's super-block (K-quant repacks) -> the 256 weights of lane i, as gguf-py computes
// them: (d * sc) * q - dmin * m (Q4_K, Q5_K), (d * sc) * (q - 32) (Q6_K), all in float32.
static void dequantize_kquant_lane(int wtype, const uint8_t* g, int i, float* v) {
    const float d = h2f(g + 2 * i);
    for (int k = 0; k < kSuper; ++k) {
        for (int e = 0; e < QK; ++e) {
            const int c = e / 4, j = e % 4, at = 64 * c + 4 * i + j;
            if (wtype == W_Q6KX16) {
                const int h = k >> 2, jj = k & 3;
                const int lo = (g[320 + 1024 * h + 512 * (jj & 1) + at] >> (4 * (jj >> 1))) & 0xF;
                const int hi = (g[2368 + 512 * h + at] >> (2 * jj)) & 3;
                const float dsc = d * float(int8_t(g[64 + 16 * (2 * k + e / 16) + i]));
                v[QK * k + e] = dsc * float((lo | hi << 4) - 32);
            } else {
                int q = (g[320 + 512 * (k >> 1) + at] >> (4 * (k & 1))) & 0xF;
                if (wtype == W_Q5KX16) q |= ((g[2368 + at] >> k) & 1) << 4;
                const float dsc = d * float(g[64 + 16 * k + i]), dm = h2f(g + 32 + 2 * i) * float(g[192 + 16 * k + i]);
                v[QK * k + e] = dsc * float(q) - dm;
            }
        }
    }
}

void dequantize_packed_row(int wtype, const uint8_t* w, int nb, int n, int K, float* dst) {
    const size_t gb = group_block_bytes(wtype);
    const uint8_t* g = w + size_t(n / kGroupRows) * nb * gb;
    const int i = n % kGroupRows;
    if (is_float_packed(wtype)) {
        const int es = wtype == W_F32X16 ? 4 : 2;  // bytes per weight
        for (int k = 0; k < K; ++k) {
            const uint8_t* p = g + size_t(k / QK) * gb + 16 * es * (k % QK) + es * i;
            if (wtype == W_F32X16) {
                std::memcpy(dst + k, p, 4);
            } else if (wtype == W_F16X16) {
                dst[k] = h2f(p);
            } else {
                const uint32_t bits = uint32_t(p[0] | p[1] << 8) << 16;
                std::memcpy(dst + k, &bits, 4);
            }
        }
        return;
    }
    if (is_kquant_packed(wtype)) {
        float v[QK * kSuper];
        for (int sb = 0; sb < nb / kSuper; ++sb, g += gb * kSuper) {
            dequantize_kquant_lane(wtype, g, i, v);
            for (int k = 0; k < QK * kSuper && sb * QK * kSuper + k < K; ++k) dst[sb * QK * kSuper + k] = v[k];
        }
        return;
    }
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
            const uint8_t* qs = g + (wtype == W_Q5X16 ? 128 : 64);
            for (int c = 0; c < 4; ++c)
                for (int j = 0; j < 4; ++j) {
                    const uint8_t byte = qs[64 * c + 4 * i + j];
                    int lo = byte & 0xF, hi = byte >> 4;
                    if (wtype == W_Q5X16) {
                        const uint8_t hb = g[64 + 4 * i + j];
                        lo |= ((hb >> (2 * c)) & 1) << 4, hi |= ((hb >> (2 * c + 1)) & 1) << 4;
                    }
                    v[4 * c + j] = d * float(lo) + m;
                    v[16 + 4 * c + j] = d * float(hi) + m;
                }
        }
        for (int k = 0; k < QK && b * QK + k < K; ++k) dst[b * QK + k] = v[k];
    }
}

// Q4_K / Q5_K's 12 bytes of packed 6-bit scales and minimums -> sc[8], mn[8] (ggml's get_scale_min_k4).
static void kquant_scales(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            sc[j] = q[j] & 63, mn[j] = q[j + 4] & 63;
        } else {
            sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
            mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
}

// One super-block of row i (GGUF bytes `blk`) into group super-block `out` (layouts: kquant_impl.h).
static void repack_kquant(int wtype, const uint8_t* blk, int i, uint8_t* out) {
    auto chunks = [&](const uint8_t* src, uint8_t* dst, int nchunks) {
        for (int c = 0; c < nchunks; ++c) std::memcpy(dst + 64 * c + 4 * i, src + 4 * c, 4);
    };
    if (wtype == W_Q6_K) {  // ql[128] qh[64] sc[16] d
        std::memcpy(out + 2 * i, blk + 208, 2);
        for (int s = 0; s < 16; ++s) out[64 + 16 * s + i] = blk[192 + s];
        for (int h = 0; h < 2; ++h) {
            for (int j = 0; j < 2; ++j) chunks(blk + 64 * h + 32 * j, out + 320 + 1024 * h + 512 * j, 8);
            chunks(blk + 128 + 32 * h, out + 2368 + 512 * h, 8);
        }
        return;
    }
    // Q4_K: d dmin sc[12] qs[128]; Q5_K: d dmin sc[12] qh[32] qs[128]
    std::memcpy(out + 2 * i, blk, 2);
    std::memcpy(out + 32 + 2 * i, blk + 2, 2);
    uint8_t sc[8], mn[8];
    kquant_scales(blk + 4, sc, mn);
    for (int k = 0; k < 8; ++k) out[64 + 16 * k + i] = sc[k], out[192 + 16 * k + i] = mn[k];
    const uint8_t* qs = blk + (wtype == W_Q5_K ? 48 : 16);
    for (int p = 0; p < 4; ++p) chunks(qs + 32 * p, out + 320 + 512 * p, 8);
    if (wtype == W_Q5_K) chunks(blk + 16, out + 2368, 8);
}

// One Q5_0 / Q5_1 block of row i into a Q5X16 group-block.
static void repack_q5(int wtype, const uint8_t* blk, int i, uint8_t* out) {
    std::memcpy(out + 2 * i, blk, 2);
    uint16_t mh;
    if (wtype == W_Q5_1) {
        std::memcpy(&mh, blk + 2, 2);
    } else {  // Q5_0: weight = d * (q - 16), so m = -16 d (exact in fp16: a power of two)
        mh = fp32_to_fp16(-16.f * h2f(blk));
    }
    std::memcpy(out + 32 + 2 * i, &mh, 2);
    const int hoff = wtype == W_Q5_1 ? 4 : 2;
    uint32_t qh;
    std::memcpy(&qh, blk + hoff, 4);
    for (int j = 0; j < 4; ++j) {
        uint8_t bits = 0;
        for (int c = 0; c < 4; ++c)
            bits |= uint8_t(((qh >> (4 * c + j)) & 1) << (2 * c) | ((qh >> (16 + 4 * c + j)) & 1) << (2 * c + 1));
        out[64 + 4 * i + j] = bits;
    }
    const uint8_t* qs = blk + hoff + 4;
    for (int c = 0; c < 4; ++c) std::memcpy(out + 128 + 64 * c + 4 * i, qs + 4 * c, 4);
}

}  // namespace tp

extern "C" {

// GGUF rows (N of them, nb blocks each) -> the 16-row interleaved layout packed_impl.h describes.
// Returns the packed type (W_Q4X16 for Q4_0 and Q4_1, W_Q5X16 for Q5_0 and Q5_1, W_Q8X16 for
// Q8_0, W_Q4KX16 / W_Q5KX16 / W_Q6KX16 for the K-quants, W_F16X16 / W_BF16X16 / W_F32X16 for
// F16 / BF16 / F32 rows), or -1 when N is not a multiple of 16 or
// the type has no packed form (the caller keeps the GGUF layout then). nb: GGUF blocks per row. Load-time work: a few milliseconds for this model.
int tp_repack(int wtype, const uint8_t* src, int N, int nb, uint8_t* dst) {
    int pt;
    switch (wtype) {
        case W_Q4_0: case W_Q4_1: pt = W_Q4X16; break;
        case W_Q5_0: case W_Q5_1: pt = W_Q5X16; break;
        case W_Q8_0: pt = W_Q8X16; break;
        case W_Q4_K: pt = W_Q4KX16; break;
        case W_Q5_K: pt = W_Q5KX16; break;
        case W_Q6_K: pt = W_Q6KX16; break;
        case W_F16: pt = W_F16X16; break;
        case W_BF16: pt = W_BF16X16; break;
        case W_F32: pt = W_F32X16; break;
        default: return -1;
    }
    if (N % kGroupRows) return -1;
    // nb counts GGUF blocks (of 256 weights for the K-quants); a group-block holds 16 of them.
    const size_t bb = block_bytes(wtype), gb = group_block_bytes(pt) * (is_kquant_packed(pt) ? kSuper : 1);
    const size_t row = size_t(nb) * bb;
    for (int g = 0; g < N / kGroupRows; ++g) {
        for (int b = 0; b < nb; ++b) {
            uint8_t* out = dst + (size_t(g) * nb + b) * gb;
            std::memset(out, 0, gb);  // Q8X16's and Q6KX16's padding
            for (int i = 0; i < kGroupRows; ++i) {
                const uint8_t* blk = src + size_t(kGroupRows * g + i) * row + b * bb;
                if (is_float_packed(pt)) {  // 32 weights of es bytes: weight e at 16 es e + es i
                    const int es = pt == W_F32X16 ? 4 : 2;
                    for (int e = 0; e < QK; ++e) std::memcpy(out + 16 * es * e + es * i, blk + es * e, es);
                    continue;
                }
                if (pt == W_Q5X16) {
                    repack_q5(wtype, blk, i, out);
                    continue;
                }
                if (is_kquant_packed(pt)) {
                    repack_kquant(wtype, blk, i, out);
                    continue;
                }
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
