// Shared declarations of tokenpath's native CPU kernels.
//
// Weights stay in GGUF's own block layouts (ggml's Q4_0, Q4_1, Q8_0: 32 weights per block, one
// fp16 scale, Q4_1 also an fp16 minimum). Activations are quantized per 32-block to int8 on the
// fly ("QAct": int8 values, the block's scale d and d * sum(q)), so a block's dot product is one
// integer multiply-add instruction sequence plus one float FMA, as in llama.cpp's
// vec_dot_q4_1_q8_1. The ISA-specific parts (dot_avx2.cpp, dot_avx512.cpp) are compiled with
// GCC target pragmas so one library carries both and picks at run time (cpu.cpp).
#pragma once
#include <cstddef>
#include <cstdint>

namespace tp {

constexpr int QK = 32;  // weights per block, all formats

enum WType : int { W_Q4_0 = 2, W_Q4_1 = 3, W_Q8_0 = 8 };  // ggml's GGMLQuantizationType numbers

inline size_t block_bytes(int t) { return t == W_Q4_0 ? 18 : t == W_Q4_1 ? 20 : 34; }

// Quantized activations for M rows of K values (nb = ceil(K / 32) blocks per row).
struct QAct {
    int8_t* q;  // [M][nb * 32], zero-padded past K
    float* d;   // [M][nb] block scale
    float* s;   // [M][nb] d * sum(q): the term that Q4_1's minimum and Q4_0's -8 offset multiply
    int nb;
    float* f = nullptr;   // optional [M][nb * 32] the float activations, zero-padded (exact path)
    float* fs = nullptr;  // optional [M][nb] their block sums
};

// y[m * ldy + n] = sum_k W[n, k] * x[m, k] (+ bias[n]) (+ y if accumulate), for n in [n0, n1).
// With exact = true the float activations (a.f) multiply weights dequantized in registers instead.
using GemmRowsFn = void (*)(int wtype, const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy,
                            int n0, int n1, const float* bias, bool accumulate, bool exact);
// Quantizes row x[0..K) into row r of a.
using QuantRowFn = void (*)(const float* x, int K, QAct& a, int r);

namespace avx2 {
void gemm_rows(int, const uint8_t*, int, const QAct&, int, float*, int, int, int, const float*, bool, bool);
void quantize_row(const float*, int, QAct&, int);
}  // namespace avx2
namespace avx512 {
void gemm_rows(int, const uint8_t*, int, const QAct&, int, float*, int, int, int, const float*, bool, bool);
void quantize_row(const float*, int, QAct&, int);
}  // namespace avx512

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);

}  // namespace tp
