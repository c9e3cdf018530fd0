// Load-time quantizers beyond quant.cpp's 32-weight ones: Q4_K (`--quantization q4_k` of a
// safetensors checkpoint) and Q5_0 (its fallback for rows whose length is not a multiple of 256).
// They write GGUF's block layouts, so the repacks, the kernels and gguf-py's decoders read them as
// they read a llama.cpp file. Scalar: this runs once per weight at load.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "tp_kernels.h"

namespace tp {

namespace {

constexpr int kSub = 32;         // weights per Q4_K sub-block
constexpr int kSubs = 8;         // sub-blocks per super-block
constexpr int kLevels = 15;      // 4-bit codes
constexpr int kScaleLevels = 63; // 6-bit sub-block scales and mins

int nearest(float x) { return int(std::nearbyint(x)); }

// One sub-block's affine fit x ~ scale * q - offset, q in [0, 15], offset >= 0: the weighted least
// squares over a sweep of candidate step sizes around (max - min) / 15, weights |x| + rms(x) (the
// larger values matter more to a dot product, and no weight is zero). This is the search llama.cpp
// runs for its K-quants (rmin -1, step 0.1, 20 candidates): a plain min/max fit wastes the codes on
// outliers. Returns the scale; `offset` gets the offset.
float fit_sub_block(const float* x, float& offset) {
    float lo = x[0], hi = x[0], sq = 0.f;
    for (int i = 0; i < kSub; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]), sq += x[i] * x[i];
    lo = std::min(lo, 0.f);  // the offset only ever subtracts
    if (hi == lo) {
        offset = -lo;
        return 0.f;
    }
    const float rms = std::sqrt(sq / kSub);
    float w[kSub], sw = 0.f, swx = 0.f;
    for (int i = 0; i < kSub; ++i) w[i] = rms + std::fabs(x[i]), sw += w[i], swx += w[i] * x[i];
    auto error = [&](float scale, float mn, const int* q) {
        float e = 0.f;
        for (int i = 0; i < kSub; ++i) {
            const float d = scale * float(q[i]) + mn - x[i];
            e += w[i] * d * d;
        }
        return e;
    };
    int q[kSub], trial[kSub];
    float inv = float(kLevels) / (hi - lo), scale = 1.f / inv, mn = lo;
    for (int i = 0; i < kSub; ++i) q[i] = std::clamp(nearest(inv * (x[i] - lo)), 0, kLevels);
    float best = error(scale, mn, q);
    for (int step = 0; step <= 20; ++step) {
        const float try_inv = (-1.f + 0.1f * float(step) + float(kLevels)) / (hi - lo);
        float sl = 0.f, sl2 = 0.f, sxl = 0.f;
        for (int i = 0; i < kSub; ++i) {
            trial[i] = std::clamp(nearest(try_inv * (x[i] - lo)), 0, kLevels);
            sl += w[i] * float(trial[i]);
            sl2 += w[i] * float(trial[i]) * float(trial[i]);
            sxl += w[i] * float(trial[i]) * x[i];
        }
        const float det = sw * sl2 - sl * sl;
        if (det <= 0.f) continue;
        float s = (sw * sxl - swx * sl) / det, m = (sl2 * swx - sl * sxl) / det;
        if (m > 0.f) m = 0.f, s = sxl / sl2;
        const float e = error(s, m, trial);
        if (e < best) best = e, scale = s, mn = m, std::memcpy(q, trial, sizeof q);
    }
    offset = -mn;
    return scale;
}

// 256 weights -> one 144-byte Q4_K block: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128
// bytes of codes (sub-blocks 2c and 2c+1 in the low and high nibbles of bytes 32c..32c+31).
void quantize_q4_k_block(const float* x, uint8_t* blk) {
    float scales[kSubs], offsets[kSubs], max_scale = 0.f, max_offset = 0.f;
    for (int j = 0; j < kSubs; ++j) {
        scales[j] = fit_sub_block(x + kSub * j, offsets[j]);
        max_scale = std::max(max_scale, scales[j]);
        max_offset = std::max(max_offset, offsets[j]);
    }
    const float inv_scale = max_scale > 0.f ? float(kScaleLevels) / max_scale : 0.f;
    const float inv_offset = max_offset > 0.f ? float(kScaleLevels) / max_offset : 0.f;
    int ls[kSubs], lm[kSubs];
    for (int j = 0; j < kSubs; ++j) {
        ls[j] = std::min(kScaleLevels, nearest(inv_scale * scales[j]));
        lm[j] = std::min(kScaleLevels, nearest(inv_offset * offsets[j]));
    }
    const uint16_t dh = fp32_to_fp16(max_scale / kScaleLevels), mh = fp32_to_fp16(max_offset / kScaleLevels);
    std::memcpy(blk, &dh, 2);
    std::memcpy(blk + 2, &mh, 2);
    uint8_t* sc = blk + 4;
    for (int j = 0; j < 4; ++j) {
        sc[j] = uint8_t(ls[j] | (ls[j + 4] >> 4) << 6);
        sc[j + 4] = uint8_t(lm[j] | (lm[j + 4] >> 4) << 6);
        sc[j + 8] = uint8_t((ls[j + 4] & 0xF) | (lm[j + 4] & 0xF) << 4);
    }
    // The codes against the scales as stored (rounded to 6 bits and fp16), not the fitted ones.
    const float d = fp16_to_fp32(dh), dmin = fp16_to_fp32(mh);
    uint8_t* qs = blk + 16;
    std::memset(qs, 0, 128);
    for (int j = 0; j < kSubs; ++j) {
        const float step = d * float(ls[j]), off = dmin * float(lm[j]);
        for (int i = 0; i < kSub; ++i) {
            const int q = step > 0.f ? std::clamp(nearest((x[kSub * j + i] + off) / step), 0, kLevels) : 0;
            qs[kSub * (j / 2) + i] |= uint8_t(q << (4 * (j & 1)));
        }
    }
}

// 32 weights -> one 22-byte Q5_0 block: d (fp16), 4 bytes of fifth bits, 16 bytes of low nibbles
// (weight i and i + 16 in byte i's low and high nibble), x ~ d * (q - 16), d = -max / 16 for the
// weight of largest magnitude (which is then exact), as Q4_0 does with 8.
void quantize_q5_0_block(const float* x, uint8_t* blk) {
    float amax = 0.f, mx = 0.f;
    for (int i = 0; i < QK; ++i)
        if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), mx = x[i];
    const float d = mx / -16.f, id = d != 0.f ? 1.f / d : 0.f;
    const uint16_t dh = fp32_to_fp16(d);
    std::memcpy(blk, &dh, 2);
    uint32_t high = 0;
    for (int i = 0; i < QK / 2; ++i) {
        const int a = std::min(31, int(x[i] * id + 16.5f)), b = std::min(31, int(x[i + 16] * id + 16.5f));
        blk[6 + i] = uint8_t((a & 0xF) | (b & 0xF) << 4);
        high |= uint32_t(a >> 4) << i | uint32_t(b >> 4) << (i + 16);
    }
    std::memcpy(blk + 2, &high, 4);
}

}  // namespace

// Rows of K floats (K a multiple of 256 for Q4_K, of 32 for Q5_0, checked by the caller) -> blocks.
bool quantize_rows_more(int wtype, const float* src, int N, int K, uint8_t* dst) {
    if (wtype != W_Q4_K && wtype != W_Q5_0) return false;
    const int per = wtype == W_Q4_K ? kSub * kSubs : QK;
    const size_t bytes = block_bytes(wtype);
    for (size_t n = 0; n < size_t(N); ++n)
        for (int b = 0; b < K / per; ++b) {
            const float* x = src + n * K + size_t(b) * per;
            uint8_t* blk = dst + (n * (K / per) + b) * bytes;
            if (wtype == W_Q4_K)
                quantize_q4_k_block(x, blk);
            else
                quantize_q5_0_block(x, blk);
        }
    return true;
}

}  // namespace tp
