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

// ggml's GGMLQuantizationType numbers, and tokenpath's own 16-row interleaved repacks of them
// (packed_impl.h): Q4X16 holds Q4_0 or Q4_1 rows, Q8X16 Q8_0 rows.
enum WType : int { W_Q4_0 = 2, W_Q4_1 = 3, W_Q8_0 = 8, W_Q4X16 = 100, W_Q8X16 = 108 };

inline size_t block_bytes(int t) { return t == W_Q4_0 ? 18 : t == W_Q4_1 ? 20 : 34; }
inline bool is_packed(int t) { return t == W_Q4X16 || t == W_Q8X16; }
constexpr int kGroupRows = 16;  // rows per repacked group
// Bytes of one group-block: 16 rows x 32 weights with their scales (and Q4's minimums), a
// multiple of 64 so that every 512-bit load of weights stays within one cache line.
inline size_t group_block_bytes(int t) { return t == W_Q4X16 ? 320 : 576; }

// Quantized activations for M rows of K values (nb = ceil(K / 32) blocks per row).
struct QAct {
    int8_t* q;  // [M][nb * 32], zero-padded past K
    float* d;   // [M][nb] block scale
    float* s;   // [M][nb] d * sum(q): the term that Q4_1's minimum and Q4_0's -8 offset multiply
    int nb;
    int32_t* qsum;        // [M][nb] sum(q): the VNNI Q8X16 kernel's offset correction, in integers
    float* f = nullptr;   // optional [M][nb * 32] the float activations, zero-padded (exact path)
    float* fs = nullptr;  // optional [M][nb] their block sums
    // Optional [M][nb * 32] residual bytes: with them the block's values are d * (254 q + q2), q2
    // the rounding error of q re-quantized at 1/254 of its step (|error| <= step / 2 keeps q2 in
    // int8). About 15 bits per activation for two integer passes; d, s and qsum then describe
    // the combined 254 q + q2.
    int8_t* q2 = nullptr;
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

// Row n (of a matrix with nb blocks per row) of a repacked matrix -> K floats.
void dequantize_packed_row(int wtype, const uint8_t* w, int nb, int n, int K, float* dst);

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);

}  // namespace tp
