// Shared declarations of tokenpath's native CPU kernels.
//
// Weights keep GGUF's own numbers (ggml's Q4_0, Q4_1, Q8_0: 32 weights per block, one fp16
// scale, Q4_1 also an fp16 minimum; Q5_0/Q5_1, the K-quants Q4_K/Q5_K/Q6_K and F16/BF16/F32 run
// repacked only, kquant_impl.h). Activations are quantized per 32-block to int8 on the
// fly ("QAct": int8 values, the block's scale d and d * sum(q)), so a block's dot product is one
// integer multiply-add instruction sequence plus one float FMA, as in llama.cpp's
// vec_dot_q4_1_q8_1. The ISA-specific parts (dot_avx2.cpp, dot_avx512.cpp) are compiled with
// GCC target pragmas so one library carries both and picks at run time (tp_cpu_features in
// quant.cpp says what the CPU has; NativeLibrary.isa in kernels/library.py chooses).
// setup.py builds two objects: _native_avx512 with both kernel sets, and _native_avx2 without
// dot_avx512.cpp and with forward_avx2.cpp (forward.cpp with TP_NO_AVX512 defined), so a compiler
// that cannot build the AVX-512 file still leaves the AVX2 kernels. With TP_NO_AVX512 the avx512
// namespace is not even declared: a call into it is a compile error, not a link error at load.
#pragma once
#include <cstddef>
#include <cstdint>

#include "attn_tile.h"

namespace tp {

constexpr int QK = 32;  // weights per block, all formats

// ggml's GGMLQuantizationType numbers, and tokenpath's own 16-row interleaved repacks of them
// (packed_impl.h, kquant_impl.h): Q4X16 holds Q4_0 or Q4_1 rows, Q8X16 Q8_0 rows, Q5X16 Q5_0 or
// Q5_1 rows, Q4KX16 / Q5KX16 / Q6KX16 the K-quants' rows (256-weight super-blocks). F32X16 holds
// float32 rows (a float32 safetensors checkpoint's); its number is tokenpath's own, as 100 + F32's
// 0 is Q4X16's.
enum WType : int {
    W_F32 = 0, W_F16 = 1, W_Q4_0 = 2, W_Q4_1 = 3, W_Q5_0 = 6, W_Q5_1 = 7, W_Q8_0 = 8, W_Q4_K = 12, W_Q5_K = 13,
    W_Q6_K = 14, W_BF16 = 30,
    W_Q4X16 = 100, W_F16X16 = 101, W_Q5X16 = 106, W_Q8X16 = 108, W_Q4KX16 = 112, W_Q5KX16 = 113, W_Q6KX16 = 114,
    W_BF16X16 = 130, W_F32X16 = 131
};

// Bytes of one GGUF block (32 weights, or 256 for the K-quants).
inline size_t block_bytes(int t) {
    switch (t) {
        case W_Q4_0: return 18;
        case W_Q4_1: return 20;
        case W_Q5_0: return 22;
        case W_Q5_1: return 24;
        case W_Q4_K: return 144;
        case W_Q5_K: return 176;
        case W_Q6_K: return 210;
        case W_F16: case W_BF16: return 64;  // 32 weights, as the repack counts them
        case W_F32: return 128;
        default: return 34;
    }
}
inline bool is_packed(int t) { return t >= W_Q4X16; }
inline bool is_kquant_packed(int t) { return t >= W_Q4KX16 && t <= W_Q6KX16; }
// Float weights (F16, BF16, F32) multiply float activations (QAct::f), not int8 ones.
inline bool is_float_packed(int t) { return t == W_F16X16 || t == W_BF16X16 || t == W_F32X16; }
constexpr int kGroupRows = 16;  // rows per repacked group
constexpr int kSuper = 8;       // 32-blocks per K-quant super-block
// Bytes of one group-block, per 32 weights of each of the 16 rows (the K-quant layouts are
// 8 times this per super-block). Group-blocks (super-blocks) are multiples of 64 bytes so that
// every 512-bit load of weights stays within one cache line.
inline size_t group_block_bytes(int t) {
    switch (t) {
        case W_Q4X16: return 320;
        case W_Q5X16: return 384;
        case W_Q4KX16: return 2368 / 8;
        case W_Q5KX16: return 2880 / 8;
        case W_Q6KX16: return 3392 / 8;
        case W_F16X16: case W_BF16X16: return 1024;
        case W_F32X16: return 2048;
        default: return 576;
    }
}

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
    // Optional [M][nb * 2] sums of each half block's 16 values (of 254 q + q2 with residual
    // bytes): Q6_K has a scale per 16 weights, and its -32 offset multiplies these.
    int32_t* qsum16 = nullptr;
    // Optional [M][nb * 32] with residual bytes: 254 q + q2 as int16 (|v| <= 32385), written by
    // quantize_row beside q and q2. The AVX2 Q4X16/Q8X16 kernels multiply them with vpmaddwd
    // against weights widened once per tile of rows (packed_impl.h says why).
    int16_t* q16 = nullptr;
    // Optional [M][nb * 32] the activations as bfloat16 (round to nearest even), zero-padded past K:
    // with them, BF16X16 weights multiply on AMX tiles (amx_bf16.cpp), which read up to the next
    // multiple of 16 rows (the buffer's owner allocates those rows too).
    uint16_t* bf = nullptr;
};

// y[m * ldy + n] = sum_k W[n, k] * x[m, k] (+ bias[n]) (+ y if accumulate), for n in [n0, n1).
// With exact = true the float activations (a.f) multiply weights dequantized in registers instead.
using GemmRowsFn = void (*)(int wtype, const uint8_t* w, int nb, const QAct& a, int M, float* y, int ldy,
                            int n0, int n1, const float* bias, bool accumulate, bool exact);
// Quantizes row x[0..K) into row r of a.
using QuantRowFn = void (*)(const float* x, int K, QAct& a, int r);

namespace avx2 {
void gemm_rows(int, const uint8_t*, int, const QAct&, int, float*, int, int, int, const float*, bool, bool);
int gemm_tiles(int wtype, bool fine, int M, int32_t* sizes);  // packed_impl.h (tp_gemm_tiles)
void quantize_row(const float*, int, QAct&, int);
uint64_t stream_xor(const uint8_t* p, size_t n);  // stream_read.h
}  // namespace avx2
#ifndef TP_NO_AVX512
namespace avx512 {
void gemm_rows(int, const uint8_t*, int, const QAct&, int, float*, int, int, int, const float*, bool, bool);
int gemm_tiles(int wtype, bool fine, int M, int32_t* sizes);  // packed_impl.h (tp_gemm_tiles)
void quantize_row(const float*, int, QAct&, int);
uint64_t stream_xor(const uint8_t* p, size_t n);  // stream_read.h
}  // namespace avx512
// amx_bf16.cpp (the AVX-512 object only): y (+)= W x for bf16 rows x on AMX tiles, where
// amx_permitted(). W: BF16X16 (pack nullptr), or a quantized repack whose 16-row groups `pack`
// dequantizes into bf16 tiles (tile_pack.h); group_bytes: one group's bytes (nb group-blocks).
namespace amx {
// A B tile's k-pair layout from 32 bf16 of two k rows (16 columns each): vpermw's index puts
// (row 0 column n, row 1 column n) side by side (pair_pack.h, tile_pack.h).
alignas(64) inline constexpr uint16_t kPairInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
using PackFn = void (*)(const uint8_t* wg, int nb, uint16_t* dst);
void gemm_tiles(PackFn pack, size_t group_bytes, const uint8_t* w, int nb, const uint16_t* x, int M, float* y,
                int ldy, int n0, int n1, const float* bias, bool accumulate);
// attn_amx.cpp: a tile of prompt rows' attention (attention.h's attend_tile arguments, up to
// paged::kPromptTileRows rows) in bf16 on tiles, float32 sums, where attend_prompt_runs(head_dim,
// kv_kind) and amx_permitted(); scratch: attend_prompt_scratch_floats(head_dim, rows * rep) floats.
bool attend_prompt_runs(int head_dim, int kv_kind);
size_t attend_prompt_scratch_floats(int head_dim, int queries);
void attend_prompt_tile(int kv_kind, const void* k_cache, const void* v_cache, const paged::Tile& tile, int bs,
                        int kv_width, int g0, int g1, int D, int rep, float scale, float* scratch);
}  // namespace amx
// bf16_dot.cpp (the AVX-512 object only): y (+)= W x for BF16X16 weights W and bf16 rows x on
// VDPBF16PS, where runs() (AVX512_BF16) and there is no AMX (amx_permitted() takes the tiles).
// Rows past M are not read (x: M rows of nb * 32 bf16).
namespace bf16dot {
bool runs();
void gemm(const uint8_t* w, int nb, const uint16_t* x, int M, float* y, int ldy, int n0, int n1, const float* bias,
          bool accumulate);
}  // namespace bf16dot
// attn_avx512.cpp: attention.h's attend_tile in 512-bit vectors, for any KvKind, where
// attend_runs(head_dim) (a multiple of 8). attention.h's attn512_for chooses it per model.
namespace avx512 {
bool attend_runs(int head_dim);
void attend_tile(int kv_kind, const void* k_cache, const void* v_cache, const paged::Tile& tile, int bs, int kv_width,
                 int g0, int g1, int D, int rep, float scale, float* scratch);
}  // namespace avx512
#endif

// The kernels of `isa` (2: AVX-512 VNNI, else AVX2). An object built without them
// (TP_NO_AVX512) answers AVX2 for either: tp_kernel_isas tells Python not to ask.
inline GemmRowsFn gemm_rows_for(int isa) {
#ifdef TP_NO_AVX512
    (void)isa;
    return avx2::gemm_rows;
#else
    return isa == 2 ? avx512::gemm_rows : avx2::gemm_rows;
#endif
}
inline QuantRowFn quantize_row_for(int isa) {
#ifdef TP_NO_AVX512
    (void)isa;
    return avx2::quantize_row;
#else
    return isa == 2 ? avx512::quantize_row : avx2::quantize_row;
#endif
}

// Row n (of a matrix with nb blocks per row) of a repacked matrix -> K floats.
void dequantize_packed_row(int wtype, const uint8_t* w, int nb, int n, int K, float* dst);

// quant.cpp: whether this process may run AMX-BF16 tiles: the CPU has AMX-TILE and AMX-BF16 and
// Linux granted the tile state (arch_prctl, asked once per process; Linux >= 5.16).
bool amx_permitted();

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
// Rows of K floats -> Q4_K or Q5_0 blocks (quantize_more.cpp); false for any other type.
bool quantize_rows_more(int wtype, const float* src, int N, int K, uint8_t* dst);

}  // namespace tp
