// The functions the library exports, declared once. Every .cpp that defines one includes this
// header, so the compiler rejects a definition that differs from its declaration (two C functions
// of one name); kernels/abi.py is the same table for ctypes, and tests/engine/test_kernel_abi.py
// checks the two against each other (argument count and kinds: int, float, pointer).
#pragma once
#include <cstdint>

extern "C" {

// quant.cpp
int tp_cpu_features();  // bits: 1 AVX2+FMA, 2 AVX-512 F/BW/VL/VNNI, 4 F16C, 8 AMX-BF16 granted (what the CPU has)
void tp_quantize(int wtype, const float* src, int N, int K, uint8_t* dst);
void tp_dequantize_row(int wtype, const uint8_t* src, int K, float* dst);
int tp_repack(int wtype, const uint8_t* src, int N, int nb, uint8_t* dst);
void tp_dequantize_packed_row(int wtype, const uint8_t* w, int nb, int n, int K, float* dst);

// forward.cpp
int tp_kernel_isas();  // bits: 1 AVX2 kernels, 2 AVX-512 VNNI kernels, 4 the AMX-BF16 GEMM (what this object carries)
void* tp_model_create(const int32_t* dims, float eps, int isa, const uint64_t* glob, const uint64_t* layer_ptrs,
                      const int32_t* layer_types, const float* fparams);
void tp_model_free(void* handle);
// moe.h: makes a layer's MLP a mixture of experts (after tp_model_create); 0, or 1 for bad arguments.
int tp_model_set_moe(void* handle, int layer, const int32_t* dims, const float* router, const int32_t* types,
                     const uint64_t* ptrs);
// moe.h: the expert counters since the model was made (pairs routed, experts read, the busiest
// expert's rows summed over layer-steps, sparse layer-steps); zeros for a dense model.
void tp_model_moe_counters(void* handle, uint64_t* out);
void tp_model_step_buffers(void* handle, int release, uint64_t* out);
int tp_model_abi();
// Both return a status: 0, or one of the TP_STATUS_* codes below (kernels/abi.py names them).
int tp_model_forward(void* handle, int T, const int32_t* ids, const int32_t* pos, const int64_t* slot_mapping,
                     const int32_t* row_table, const int32_t* tables, int S, const int32_t* logit_rows,
                     float* logits, int nthreads, int slot_stride, int table_stride, const uint8_t* row_kinds);
int tp_model_forward_lora(void* handle, int T, const int32_t* ids, const int32_t* pos, const int64_t* slot_mapping,
                          const int32_t* row_table, const int32_t* tables, int S, const int32_t* logit_rows,
                          float* logits, int nthreads, int slot_stride, int table_stride, const uint8_t* row_kinds,
                          int n_lora_blocks, const int32_t* lora_blocks, const int32_t* lora_rows,
                          const uint64_t* lora_ptrs, const int32_t* lora_ranks, const float* lora_scales);
// Tests only: at most `cap` work phases per step (0: as many as the step needs), to exercise the
// overflow check (TP_STATUS_PHASES) that a miscounted phase would trip.
void tp_model_debug_phase_cap(void* handle, int cap);
// test_api.h, tests only: the KV pool's conversions (floats -> KvKind codes, to_float 0, or back),
// one attention tile over a pool of any KvKind, and a decode GEMM's chunk ends (step_acts.h).
int tp_decode_chunks(const int32_t* types, const int32_t* rows, int parts, int N, int nb, int nthreads,
                     int32_t* ends);
void tp_kv_convert(int kind, int to_float, const void* src, void* dst, int n);
void tp_attend_tile_test(int kind, const void* k_cache, const void* v_cache, const float* q, float* o,
                         const int32_t* table, int nrows, int p0, int bs, int n_kv, int D, int rep, float scale,
                         int window, int isa);
// read_bw.h: buf's first `mib` MiB read by nthreads threads, reps times; the fastest rep's seconds and
// the XOR of the buffer's 64-bit words.
void tp_stream_read(int isa, const uint8_t* buf, int mib, int nthreads, int reps, double* seconds,
                    uint64_t* checksum);
// bpe.cpp: `tokenizers`' BPE merges over n_words words of initial symbols (syms, word i ending at
// word_ends[i]); the merged words are written to the front of syms, word i ending at out_ends[i].
// Returns the symbols written. The merges with left id a: entries starts[a] .. starts[a + 1] - 1 of
// rights (ascending), ranks and results; starts has n_vocab + 1 entries.
int tp_bpe_merge(const int32_t* starts, int n_vocab, const uint32_t* rights, const uint32_t* ranks,
                 const uint32_t* results, int32_t* syms, const int32_t* word_ends, int n_words, int32_t* out_ends);
void tp_gemm(int isa, int wtype, const uint8_t* w, int N, int K, const float* x, int M, float* y, int nthreads,
             int mode);
// Tests only: the rows of each tile a repacked GEMM of M rows runs (packed_impl.h tile_rows), in
// order, into sizes (room for M); returns how many tiles (0: not a repacked integer type).
int tp_gemm_tiles(int isa, int wtype, int fine, int M, int32_t* sizes);

}  // extern "C"

// tp_model_forward's statuses
#define TP_STATUS_OK 0
#define TP_STATUS_PHASES 1  // the step walked more work phases than were allocated (a kernel bug)
