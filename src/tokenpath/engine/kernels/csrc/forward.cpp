// The fused native forward pass of a llama-family decoder, one call per engine step, with the
// switches the other families need (Layer, Model: QK-norm, sandwich norms, GeGLU, embedding and
// attention scales, per-layer sliding windows and rope tables; Gemma's 1 + w norms come ready).
//
// Why one call: after the matmuls are fast, a 30-layer model run op by op from Python costs
// ~20 torch ops per layer (milliseconds per step). Here a step is one OpenMP parallel region
// whose threads walk the same list of phases, claiming work items from an atomic counter (see
// team_for: no OpenMP barriers), with RMSNorm fused into activation quantization,
// residual adds into the GEMM epilogue, SiLU*mul into the down projection's quantization, and
// paged attention reading K/V in place from the engine's block pool (no gather copy). The pool
// holds float32, IEEE float16, one-byte fp8 or llama.cpp's q8_0 K/V (--kv-cache-dtype; kv_fp8.h):
// float16 halves the cache's memory, fp8 and q8_0 nearly quarter it, and all three are widened a
// 32-key block at a time into an L1-sized buffer inside attention (attention.h).
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <omp.h>

#include <pthread.h>  // sched_yield, nanosleep (POSIX: it shows <sched.h> and <time.h>)
#include <sys/mman.h>  // step_alloc.h

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "tp_api.h"
#include "vec_math.h"
#include "tp_kernels.h"

using namespace tp;

namespace {

constexpr int kOwnRowsMax = 4;  // steps of at most this many rows quantize per thread (see tp_model_forward)
constexpr timespec kNap{0, 20000}; constexpr int kNapRows = 64;  // team_for's waits: see Phase
// One work-sharing phase of a step. Items are claimed dynamically and a thread waits only until
// every item is done (a descheduled thread held OpenMP's barriers a time slice each). Past a short
// spin, in a step of at most kNapRows rows (decode), a waiter naps 20 us: its core goes idle and the
// kernel moves the item's owner over from a core another process took (sched_yield kept this core
// busy, the owner stuck behind the other). Prompt steps still yield: napping cost them CPU time.
struct alignas(64) Phase {
    std::atomic<int> next{0};
    alignas(64) std::atomic<int> done{0};
};

// One thread's walk through a step's phases: each claims phase `idx` in turn; `n` is how many were
// allocated (phases_for_step). A walk past them (a phase added to the forward, not counted) skips
// the surplus in every thread alike and flags `overflow`: the forward returns TP_STATUS_PHASES.
struct PhaseCursor {
    Phase* phases; int n;
    std::atomic<int>* overflow;
    int idx = 0; bool nap = false;  // nap: a step of at most kNapRows rows
};

// team_chunks: fn(c) for chunks c in [0, chunks), claimed in order; team_for: chunks of `grain` items.
template <class F>
inline void team_chunks(PhaseCursor& pc, int chunks, F&& fn) {
    if (pc.idx >= pc.n) {
        ++pc.idx;
        pc.overflow->store(1, std::memory_order_relaxed);
        return;
    }
    Phase& p = pc.phases[pc.idx++];
    int mine = 0;  // done counts a thread's items once: a per-item add bounced its line between cores
    for (int c; (c = p.next.fetch_add(1, std::memory_order_relaxed)) < chunks; ++mine) fn(c);
    if (mine) p.done.fetch_add(mine, std::memory_order_acq_rel);
    for (int spins = 0; p.done.load(std::memory_order_acquire) < chunks; ++spins) {
        if (spins < 4000) _mm_pause();
        else if (pc.nap) nanosleep(&kNap, nullptr);  // (see Phase)
        else sched_yield();  // the item's owner may be waiting for this core
    }
}
template <class F> inline void team_for(PhaseCursor& pc, int n, int grain, F&& fn) {
    team_chunks(pc, (n + grain - 1) / grain, [&](int c) { fn(c * grain, (c + 1) * grain < n ? (c + 1) * grain : n); });
}

inline int grain_for(int n, int nthreads, int multiple) {
    int g = n / (nthreads * 4);
    g = (g + multiple - 1) / multiple * multiple;
    return g < multiple ? multiple : g;
}

// A weight matrix: up to kMaxParts row ranges of its own type each (a fused QKV whose V is Q8_0
// and Q and K Q5_0 keeps every part's own blocks). Parts of a repacked matrix have rows that are
// multiples of 16, so the team's 16-row chunks never straddle a part's layout.
constexpr int kMaxParts = 3;
struct Mat {
    int parts = 0;
    int type[kMaxParts], rows[kMaxParts];
    const uint8_t* w[kMaxParts];
};

struct MoeLayer; struct MoeBuf;  // a sparse MLP and its step buffers (moe.h)
struct Layer {
    const float *attn_norm, *ffn_norm, *qkv_bias;
    // Optional (null = absent): per-head RMSNorm of q and k before rope (Qwen3, Gemma 3), and
    // RMSNorm of the attention and MLP outputs before their residual adds (Gemma 3's sandwich).
    const float *q_norm, *k_norm, *attn_out_norm, *ffn_out_norm;
    const float *rope_cos, *rope_sin;  // [max_pos, head_dim]: this layer's rope (base, scaling)
    int window;                        // sliding window (0: full attention)
    int group;                         // KV-cache group: which row of slot_mapping / tables it uses
    Mat qkv, o, gate_up, down;
    const MoeLayer* moe = nullptr;  // set: the MLP is a mixture of experts (gate_up, down unused)
    void *k_cache, *v_cache;  // [slots, n_kv, head_dim] of Model::kv_kind's type
};

// One attention work item: KV heads [g0, g1) of tile `tile` (an index into Model::tiles), and of
// each, query heads [h0, h1) of its rep.
struct AttnItem {
    int tile, g0, g1, h0, h1;
};

#include "step_alloc.h"  // StepVec, grow: step buffers on pages of their own; ActBuf

struct Model {
    int n_layers, hidden, inter, n_heads, n_kv, head_dim, vocab, max_pos, block_size;
    float eps;
    GemmRowsFn gemm;
    QuantRowFn quant;
    std::vector<Layer> layers;
    const uint8_t *embed, *head;
    int embed_t, head_t;
    int exact;  // bit mask over (qkv, o, gate_up, down, head): float activations for those matmuls
    int fine;   // the same bits: int8 activations with residual bytes (QAct::q2), ~15 bits
    // This step's per-row masks over the same bits (tp_model_forward's row_kinds): the matmuls
    // whose row t takes residual bytes, within `fine`; nullptr: every row takes `fine`'s. The
    // engine passes them to run prompt rows at llama.cpp's int8 and generated rows finer
    // (kernels/precision.py says why). head_kinds: the same for the head's rows (logit_rows).
    const uint8_t* kinds = nullptr;
    std::vector<uint8_t> head_kinds;
    int kv_kind;  // KvKind (kv_fp8.h): float32, float16, fp8 e5m2, e4m3 (all but float32 need F16C)
    int gelu;    // the MLP's gate: 0 SiLU (SwiGLU), 1 tanh-approximated GELU (GeGLU)
    int float_w;  // 1: some matrix has F16/BF16/F32 parts, which read float activations; 2: all do (no int8)
    // Bits as `exact`: matmuls whose rows take bf16 activations on AMX tiles (amx_bf16.cpp): every
    // row of BF16 weights, the prompt rows (kPromptTiles) of quantized ones; 0 where amx_permitted()
    // is false (tp_model_create checks).
    int half = 0;
    // Every matmul BF16X16 on tiles (half all five, no exact bit, no experts): no row reads the
    // float32 activation copies (QAct::f), so make_act leaves them out (4 bytes a value written
    // per row and matmul for nothing: half of quantize_row's time in a bf16 prefill).
    bool tiles_only = false;
    bool attn512 = false;  // attention on attn_avx512.cpp's kernels (attn512_for)
    // Prompt rows' attention on AMX tiles (attn_amx.cpp; dims[17], kernels/model.py attn_tiles):
    // tiles of up to kPromptTileRows rows whose rows all carry kPromptTiles.
    bool attn_tiles = false;
    float embed_scale, attn_scale;
    const float* out_norm;
    // Step buffers, grown on demand and reused: no allocation or page faults per step.
    StepVec<float> x, work, logits_in, scores, sub;  // work: qkv, attention, gate/up (step_buffers)
    bool sandwich = false;  // some layer has attn_out_norm or ffn_out_norm: sub is used
    StepVec<float> lin;  // LoRA steps: each row's float matmul input (normed x, or the MLP activation)
    std::vector<int> tiles;  // attention: first row of each tile of rows sharing a sequence, then T
    std::vector<AttnItem> items;
    std::vector<ActBuf> acts;  // [0] the step's shared activation rows, [1 + thread] private ones
    std::vector<QAct> act_views;  // this step's QAct over each of them
    std::vector<std::unique_ptr<MoeLayer>> moes; std::unique_ptr<MoeBuf> moe_buf;  // tp_model_set_moe
    std::unique_ptr<Phase[]> phases;
    size_t n_phases = 0;
    int phase_cap = 0;  // tests only (tp_model_debug_phase_cap): fewer phases than a step needs
};

// The most work phases one step walks: the embedding lookup, the head's norm and GEMM, and per
// layer at most 16: 4 per-row phases (norm + quantize for qkv, quantize attn for o, norm +
// quantize for gate_up, SiLU/GELU + quantize for down; run whole by each thread when rows are
// few), 4 GEMMs, RoPE + cache write, attention, 2 sandwich-norm adds (Gemma 3) and 4 LoRA delta
// phases (qkv, o, gate_up, down); a sparse layer's attention half (at most 9) and MLP (moe.h: 9).
// team_for checks the walk against it.
constexpr int kPhasesPerLayer = 18, kPhasesPerStep = 3;
inline size_t phases_for_step(const Model& m) { return kPhasesPerStep + size_t(m.n_layers) * kPhasesPerLayer; }

#include "step_acts.h"  // make_act, use_fine, act_rows, row_act, gemm_runs, gemm_team, step_buffers
#include "attn_items.h"  // plan_attention, prompt_tile_row, attention_scratch_floats

// RMSNorm(x[0..n)) * w into out (which may be x). The sum of squares stays in double (4 lanes),
// as it was when scalar: the norm is cheap, and its rounding feeds every layer.
void rms_norm(const float* x, const float* w, int n, float eps, float* out) {
    __m256d acc = _mm256_setzero_pd();
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
        acc = _mm256_fmadd_pd(v, v, acc);
    }
    alignas(32) double part[4];
    _mm256_store_pd(part, acc);
    double ss = (part[0] + part[1]) + (part[2] + part[3]);
    for (; i < n; ++i) ss += double(x[i]) * x[i];
    const float inv = 1.f / std::sqrt(float(ss / n) + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _mm256_loadu_ps(w + i)));
    for (; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// x[0..n) += RMSNorm(y) * w: a sandwich norm's residual add (y is overwritten).
void add_normed(float* x, float* y, const float* w, int n, float eps) {
    rms_norm(y, w, n, eps, y);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) x[i] += y[i];
}

// RMSNorm(x) * weight, quantized straight into activation row r.
void norm_quant(const Model& m, const float* x, const float* w, QAct& a, int r, float* tmp) {
    rms_norm(x, w, m.hidden, m.eps, tmp);
    m.quant(tmp, m.hidden, a, r);
}

#include "glu.h"  // silu_mul, gelu_mul: the gated MLPs' activations
#include "lora_delta.h"  // LoraStep, lora_delta: the adapters' low-rank deltas

// Writes n floats into a cache row: a copy for float32, round-to-nearest-even halves for float16.
inline void store_kv(float* dst, const float* src, int n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void store_kv(uint16_t* dst, const float* src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline void store_kv(KvE5M2* dst, const float* src, int n) { fp8::encode(dst, src, n); }
inline void store_kv(KvE4M3* dst, const float* src, int n) { fp8::encode(dst, src, n); }
inline void store_kv(KvQ8* dst, const float* src, int n) { q8::encode(dst, src, n); }

// Rotate-half RoPE (Hugging Face layout) on one head vector.
inline void rope(float* v, const float* c, const float* s, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; ++i) {
        const float a = v[i], b = v[i + h];
        v[i] = a * c[i] - b * s[i];
        v[i + h] = b * c[i + h] + a * s[i + h];
    }
}

}  // namespace

#include "moe.h"  // the sparse MLPs: moe_prepare, moe_ffn, tp_model_set_moe
#include "test_api.h"  // tests: tp_kv_convert, tp_attend_tile_test, tp_decode_chunks
#include "read_bw.h"  // tp_stream_read: the read-bandwidth bound

extern "C" {

// fparams: embedding scale, attention score scale.
void* tp_model_create(const int32_t* dims, float eps, int isa, const uint64_t* glob, const uint64_t* layer_ptrs,
                      const int32_t* layer_types, const float* fparams) {
    auto* m = new Model();
    m->n_layers = dims[0], m->hidden = dims[1], m->inter = dims[2], m->n_heads = dims[3], m->n_kv = dims[4];
    m->head_dim = dims[5], m->vocab = dims[6], m->max_pos = dims[7], m->block_size = dims[8];
    m->embed_t = dims[9], m->head_t = dims[10], m->exact = dims[11], m->kv_kind = dims[12];
    m->fine = dims[13];  // model.py leaves the exact bits out
    m->gelu = dims[14], m->float_w = dims[15];
#ifndef TP_NO_AVX512
    m->half = isa == 2 && (amx_permitted() || bf16dot::runs()) ? dims[16] : 0;  // (dot_impl.h gemm_rows)
    m->attn_tiles = m->half && dims[17] && amx_permitted() && amx::attend_prompt_runs(dims[5], dims[12]);
#endif
    m->attn512 = attn512_for(isa, dims[5]);
    bool bf16_all = m->head_t == W_BF16X16;
    m->eps = eps;
    m->embed_scale = fparams[0], m->attn_scale = fparams[1];
    m->gemm = gemm_rows_for(isa);
    m->quant = quantize_row_for(isa);
    m->embed = reinterpret_cast<const uint8_t*>(glob[0]);
    m->head = reinterpret_cast<const uint8_t*>(glob[1]);
    m->out_norm = reinterpret_cast<const float*>(glob[2]);
    // Per layer: 11 pointers (norms, bias, K/V cache, the optional norms, rope tables), then qkv,
    // o, gate_up, down as kMaxParts (pointer) each; layer_types holds their kMaxParts (type, rows)
    // pairs, rows 0 = unused part, then the layer's window and KV-cache group.
    constexpr int kFixed = 11, kPtrs = kFixed + 4 * kMaxParts, kTypes = 4 * kMaxParts * 2 + 2;
    auto f32 = [](uint64_t p) { return reinterpret_cast<const float*>(p); };
    for (int l = 0; l < m->n_layers; ++l) {
        const uint64_t* p = layer_ptrs + kPtrs * l;
        const int32_t* t = layer_types + kTypes * l;
        Layer L;
        L.attn_norm = reinterpret_cast<const float*>(p[0]);
        L.ffn_norm = reinterpret_cast<const float*>(p[1]);
        L.qkv_bias = reinterpret_cast<const float*>(p[2]);
        L.k_cache = reinterpret_cast<void*>(p[3]);
        L.v_cache = reinterpret_cast<void*>(p[4]);
        L.q_norm = f32(p[5]), L.k_norm = f32(p[6]), L.attn_out_norm = f32(p[7]), L.ffn_out_norm = f32(p[8]);
        m->sandwich = m->sandwich || L.attn_out_norm || L.ffn_out_norm;
        L.rope_cos = f32(p[9]), L.rope_sin = f32(p[10]);
        L.window = t[kTypes - 2], L.group = t[kTypes - 1];
        Mat* mats[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
        for (int j = 0; j < 4; ++j)
            for (int q = 0; q < kMaxParts; ++q) {
                const int idx = j * kMaxParts + q;
                if (t[2 * idx + 1] == 0) continue;
                Mat& M = *mats[j];
                M.type[M.parts] = t[2 * idx], M.rows[M.parts] = t[2 * idx + 1];
                bf16_all = bf16_all && t[2 * idx] == W_BF16X16;
                M.w[M.parts++] = reinterpret_cast<const uint8_t*>(p[kFixed + idx]);
            }
        m->layers.push_back(L);
    }
    m->tiles_only = bf16_all && (m->half & 0x1f) == 0x1f && !m->exact;  // (tp_model_set_moe clears it)
    return m;
}

void tp_model_free(void* handle) { delete static_cast<Model*>(handle); }

// The step buffers' bytes (grown to the largest step seen: a 1024-row prefill holds ~30 MiB of
// them for SmolLM2), and with `release` they go back to the OS first (their pages unmapped) and
// the next step grows what it needs again. The engine releases them when it goes idle, so a burst
// of wide steps (a flood's recomputed prompts) does not leave its high-water mark resident.
// Never during a forward (the engine's step thread calls both). MoE scratch is not counted.
void tp_model_step_buffers(void* handle, int release, uint64_t* out) {
    Model& m = *static_cast<Model*>(handle);
    if (release) {
        drop(m.x), drop(m.work), drop(m.logits_in), drop(m.scores), drop(m.sub), drop(m.lin);
        std::vector<ActBuf>().swap(m.acts);
        m.act_views.clear();
    }
    size_t n = held(m.x) + held(m.work) + held(m.logits_in) + held(m.scores) + held(m.sub) + held(m.lin);
    for (const ActBuf& b : m.acts)
        n += held(b.q) + held(b.q2) + held(b.q16) + held(b.d) + held(b.s) + held(b.f) + held(b.fs) + held(b.qsum) +
             held(b.qsum16) + held(b.bf);
    *out = uint64_t(n);
}

// The kernel sets this object carries (setup.py: _native_avx2 compiles forward_avx2.cpp, which
// defines TP_NO_AVX512).
int tp_kernel_isas() {
#ifdef TP_NO_AVX512
    return 1;
#else
    return 1 | 2 | 4 | 8;  // 4: the AMX-BF16 GEMM (amx_bf16.cpp), 8: the VDPBF16PS one (bf16_dot.cpp)
#endif
}

void tp_model_debug_phase_cap(void* handle, int cap) { static_cast<Model*>(handle)->phase_cap = cap; }

// The layout of tp_model_create's arrays and tp_model_forward's arguments, checked at load
// (kernels/abi.py MODEL_ABI, which lists what each number added): a library built from older
// sources is refused, not misread. 16: tp_decode_chunks.
int tp_model_abi() { return 16; }

// One engine step over T token rows (prefill chunks and decodes mixed).
//   ids, pos:       [T] token id and position of each row
//   slot_mapping:   [T] KV slot each row's new K/V is written to
//   row_table:      [T] offset into `tables` of the row's sequence block table; its context is
//                   positions 0..pos (causal within a prefill chunk, everything cached before)
//   logit_rows:     [S] rows whose next-token logits are wanted -> logits [S, vocab]
// With KV-cache groups (a window group's blocks are its own), slot_mapping and tables hold one
// row per group, slot_stride and table_stride apart; a layer reads its group's row.
//   row_kinds:      [T] per row, a mask over the matmuls (qkv, o, gate_up, down, head bits, as
//                   Model::fine) whose inputs take residual bytes, within the model's fine mask,
//                   and bit 7 (kPromptTiles) for a prompt row; nullptr: every row takes the fine
//                   mask's and none is a prompt row
//   lora_*:         the LoRA adapters of this step (see LoraStep); n_lora_blocks 0 for none
int tp_model_forward_lora(void* handle, int T, const int32_t* ids, const int32_t* pos, const int64_t* slot_mapping,
                           const int32_t* row_table, const int32_t* tables, int S, const int32_t* logit_rows,
                           float* logits, int nthreads, int slot_stride, int table_stride, const uint8_t* row_kinds,
                           int n_lora_blocks, const int32_t* lora_blocks, const int32_t* lora_rows,
                           const uint64_t* lora_ptrs, const int32_t* lora_ranks, const float* lora_scales) {
    Model& m = *static_cast<Model*>(handle);
    m.kinds = m.fine || m.half ? row_kinds : nullptr;
    if (m.kinds) {
        m.head_kinds.resize(size_t(S));
        for (int r = 0; r < S; ++r) m.head_kinds[size_t(r)] = row_kinds[logit_rows[r]];
    }
    const LoraStep ls{n_lora_blocks, lora_blocks, lora_rows, lora_ptrs, lora_ranks, lora_scales};
    const bool lora = n_lora_blocks > 0;
    const int H = m.hidden, I = m.inter, D = m.head_dim, nq = m.n_heads * D, nkv = m.n_kv * D;
    const int W = nq + 2 * nkv, rep = m.n_heads / m.n_kv, bs = m.block_size;
    const int kmax = std::max({I, H, nq});  // the widest activation row quantized (down, qkv/gate_up, o inputs)
    grow(m.x, size_t(T) * H);
    if (m.sandwich) grow(m.sub, size_t(T) * H);
    // The step's attention tiles and work items (attn_items.h), and each thread's scratch for one.
    const int nitems = plan_attention(m, T, row_table, pos, nthreads);
    const size_t attn_floats = attention_scratch_floats(m);
    const size_t per_thread = attn_floats + kmax;  // attention scratch + a norm/activation row
    grow(m.scores, per_thread * nthreads);
    // Rows to quantize for a matmul: with a few rows (decode), every thread quantizes all of them
    // into its own buffers and goes straight on to its share of the matmul; the phase boundary
    // (and the wait for the one thread doing the work) would cost more than the redundant work.
    // With more rows, the threads share the rows of one phase. Same arithmetic either way.
    // (Not with adapters: their deltas read each row's float input, which one thread must write.)
    const bool own_rows = T <= kOwnRowsMax && nthreads > 1 && !lora;
    if (lora) grow(m.lin, size_t(T) * kmax);
    float* lin = m.lin.data();
    if (m.acts.size() < size_t(nthreads) + 1) m.acts.resize(size_t(nthreads) + 1);
    m.act_views.clear();
    for (int i = 0; i <= (own_rows ? nthreads : 0); ++i) m.act_views.push_back(make_act(m, m.acts[i], T, kmax));
    const std::vector<QAct>& acts = m.act_views;
    float *x = m.x.data(), *sub = m.sub.data(), *qkv, *attn, *gu;
    step_buffers(m, T, W, nq, 2 * I, own_rows, qkv, attn, gu);
    const float scale = m.attn_scale;

    size_t need_phases = phases_for_step(m);
    if (m.phase_cap > 0) need_phases = std::min(need_phases, size_t(m.phase_cap));
    if (m.n_phases < need_phases) m.phases.reset(new Phase[need_phases]), m.n_phases = need_phases;
    for (size_t i = 0; i < need_phases; ++i) m.phases[i].next.store(0), m.phases[i].done.store(0);
    std::atomic<int> overflow{0};
    moe_prepare(m, T);
    const int rg = grain_for(T, nthreads, 1);  // rows per item for the per-row phases

#pragma omp parallel num_threads(nthreads)
    {
        PhaseCursor pc{m.phases.get(), int(need_phases), &overflow, 0, T <= kNapRows};  // this thread's walk
        float* scratch = m.scores.data() + per_thread * omp_get_thread_num();
        float* tmp = scratch + attn_floats;
        const int enb = (H + QK - 1) / QK;
        const size_t eb = size_t(enb) * (is_packed(m.embed_t) ? 0 : block_bytes(m.embed_t));
        team_for(pc, T, rg, [&](int t0, int t1) {
            for (int t = t0; t < t1; ++t) {
                if (is_packed(m.embed_t))  // a tied embedding shares the LM head's repacked rows
                    dequantize_packed_row(m.embed_t, m.embed, enb, ids[t], H, x + size_t(t) * H);
                else
                    tp_dequantize_row(m.embed_t, m.embed + size_t(ids[t]) * eb, H, x + size_t(t) * H);
                if (m.embed_scale != 1.f)
                    for (int i = 0; i < H; ++i) x[size_t(t) * H + i] *= m.embed_scale;
            }
        });
        const QAct& a = acts[own_rows ? 1 + omp_get_thread_num() : 0];
        // A per-row phase: shared among the threads, or (own_rows) done whole by each of them.
        auto row_phase = [&](int n, auto&& fn) {
            if (own_rows) fn(0, n);
            else team_for(pc, n, grain_for(n, nthreads, 1), fn);
        };
        QAct ah = a, aq = a, ai = a;
        const uint8_t *kinds = m.kinds, *hkinds = kinds ? m.head_kinds.data() : nullptr;
        ah.nb = (H + QK - 1) / QK, aq.nb = (nq + QK - 1) / QK, ai.nb = (I + QK - 1) / QK;
        use_fine(m, aq, a, 1), use_fine(m, ai, a, 3);  // o, down
        // The adapters' deltas of targets [tg0, tg0 + n) of layer l: one work item per (row block,
        // target). Input rows xin (stride ldx, `in` wide), outputs y (stride ldy) at offs[g], outs[g] wide.
        auto lora_phase = [&](int l, int tg0, int n, const float* xin, int ldx, int in, float* y, int ldy,
                              const int* offs, const int* outs) {
            team_for(pc, ls.n_blocks * n, 1, [&](int i0, int) {
                const int32_t* blk = ls.blocks + 3 * (i0 / n);
                const int sl = blk[0], g = i0 % n;
                const uint64_t* p = ls.ptrs + ((size_t(sl) * m.n_layers + l) * kLoraTargets + tg0 + g) * 2;
                const auto* A = reinterpret_cast<const uint16_t*>(p[0]);
                if (A == nullptr) return;
                lora_delta(A, reinterpret_cast<const uint16_t*>(p[1]), ls.ranks[sl], in, outs[g], ls.scales[sl],
                           ls.rows + blk[1], blk[2], xin, ldx, y + offs[g], ldy);
            });
        };
        const int qkv_offs[3] = {0, nq, nq + nkv}, qkv_outs[3] = {nq, nkv, nkv};
        const int gu_offs[2] = {0, I}, gu_outs[2] = {I, I}, h_off[1] = {0}, h_out[1] = {H};
        for (int l = 0; l < m.n_layers; ++l) {
            const Layer& L = m.layers[l];
            use_fine(m, ah, a, 0);  // qkv
            row_phase(T, [&](int t0, int t1) {
                for (int t = t0; t < t1; ++t) {
                    QAct v = row_act(m, ah, row_mask(kinds, t), 0);
                    norm_quant(m, x + size_t(t) * H, L.attn_norm, v, t, lora ? lin + size_t(t) * kmax : tmp);
                }
            });
            gemm_team(m, pc, nthreads, 0, L.qkv, W, ah, T, qkv, W, L.qkv_bias, false, kinds);
            if (lora) lora_phase(l, 0, 3, lin, kmax, H, qkv, W, qkv_offs, qkv_outs);
            // (QK-norm,) RoPE on q and k, then write k and v into their cache slots.
            team_for(pc, T, rg, [&](int t0, int t1) {
                for (int t = t0; t < t1; ++t) {
                    float* row = qkv + size_t(t) * W;
                    if (L.q_norm) {
                        for (int h = 0; h < m.n_heads; ++h) rms_norm(row + h * D, L.q_norm, D, m.eps, row + h * D);
                        for (int h = m.n_heads; h < m.n_heads + m.n_kv; ++h)
                            rms_norm(row + h * D, L.k_norm, D, m.eps, row + h * D);
                    }
                    const float *c = L.rope_cos + size_t(pos[t]) * D, *s = L.rope_sin + size_t(pos[t]) * D;
                    for (int h = 0; h < m.n_heads + m.n_kv; ++h) rope(row + h * D, c, s, D);
                    const size_t slot = size_t(slot_mapping[size_t(L.group) * slot_stride + t]);
                    with_kv_type(m.kv_kind, [&](auto* type) {
                        using KV = std::remove_pointer_t<decltype(type)>;
                        store_kv(kv_at(static_cast<KV*>(L.k_cache), slot * nkv), row + nq, nkv);
                        store_kv(kv_at(static_cast<KV*>(L.v_cache), slot * nkv), row + nq + nkv, nkv);
                    });
                }
            });
            // Attention over the work items above; K/V read in place from the block pool.
            team_for(pc, nitems, 1, [&](int i0, int) {
                const AttnItem it = m.items[i0];
                const int t = m.tiles[it.tile];
                const size_t q0 = (size_t(it.g0) * rep + it.h0) * D;  // (h0 > 0 only for a lone KV head)
                const paged::Tile tile{qkv + size_t(t) * W + q0, attn + size_t(t) * nq + q0, W, nq,
                                       m.tiles[it.tile + 1] - t, pos[t],
                                       tables + size_t(L.group) * table_stride + row_table[t], L.window};
#ifndef TP_NO_AVX512
                if (prompt_tile_row(m, t))
                    return amx::attend_prompt_tile(m.kv_kind, L.k_cache, L.v_cache, tile, bs, nkv, it.g0, it.g1, D,
                                                   it.h1 - it.h0, scale, scratch);
#endif
                attend(m.attn512, m.kv_kind, L.k_cache, L.v_cache, tile, bs, nkv, it.g0, it.g1, D, it.h1 - it.h0,
                       scale, scratch);
            });
            row_phase(T, [&](int t0, int t1) {
                for (int t = t0; t < t1; ++t) {
                    QAct v = row_act(m, aq, row_mask(kinds, t), 1);
                    m.quant(attn + size_t(t) * nq, nq, v, t);
                }
            });
            if (L.attn_out_norm) {  // x += RMSNorm(o(attn))
                gemm_team(m, pc, nthreads, 1, L.o, H, aq, T, sub, H, nullptr, false, kinds);
                if (lora) lora_phase(l, 3, 1, attn, nq, nq, sub, H, h_off, h_out);
                team_for(pc, T, rg, [&](int t0, int t1) {
                    for (int t = t0; t < t1; ++t) add_normed(x + size_t(t) * H, sub + size_t(t) * H, L.attn_out_norm, H, m.eps);
                });
            } else {
                gemm_team(m, pc, nthreads, 1, L.o, H, aq, T, x, H, nullptr, true, kinds);  // + residual
                if (lora) lora_phase(l, 3, 1, attn, nq, nq, x, H, h_off, h_out);
            }
            if (L.moe) { moe_ffn(m, pc, nthreads, L.ffn_norm, *L.moe, T, x, tmp); continue; }
            use_fine(m, ah, a, 2);  // gate_up
            row_phase(T, [&](int t0, int t1) {
                for (int t = t0; t < t1; ++t) {
                    QAct v = row_act(m, ah, row_mask(kinds, t), 2);
                    norm_quant(m, x + size_t(t) * H, L.ffn_norm, v, t, lora ? lin + size_t(t) * kmax : tmp);
                }
            });
            gemm_team(m, pc, nthreads, 2, L.gate_up, 2 * I, ah, T, gu, 2 * I, nullptr, false, kinds);
            if (lora) lora_phase(l, 4, 2, lin, kmax, H, gu, 2 * I, gu_offs, gu_outs);
            row_phase(T, [&](int t0, int t1) {  // SiLU(gate) * up, quantized for down
                for (int t = t0; t < t1; ++t) {
                    const float* g = gu + size_t(t) * 2 * I;
                    float* act = lora ? lin + size_t(t) * kmax : tmp;
                    if (m.gelu) gelu_mul(g, g + I, act, I);
                    else silu_mul(g, g + I, act, I);
                    QAct v = row_act(m, ai, row_mask(kinds, t), 3);
                    m.quant(act, I, v, t);
                }
            });
            if (L.ffn_out_norm) {  // x += RMSNorm(down(act))
                gemm_team(m, pc, nthreads, 3, L.down, H, ai, T, sub, H, nullptr, false, kinds);
                if (lora) lora_phase(l, 6, 1, lin, kmax, I, sub, H, h_off, h_out);
                team_for(pc, T, rg, [&](int t0, int t1) {
                    for (int t = t0; t < t1; ++t) add_normed(x + size_t(t) * H, sub + size_t(t) * H, L.ffn_out_norm, H, m.eps);
                });
            } else {
                gemm_team(m, pc, nthreads, 3, L.down, H, ai, T, x, H, nullptr, true, kinds);  // + residual
                if (lora) lora_phase(l, 6, 1, lin, kmax, I, x, H, h_off, h_out);
            }
        }
        use_fine(m, ah, a, 4);  // head
        row_phase(S, [&](int r0, int r1) {
            for (int r = r0; r < r1; ++r) {
                QAct v = row_act(m, ah, row_mask(hkinds, r), 4);
                norm_quant(m, x + size_t(logit_rows[r]) * H, m.out_norm, v, r, tmp);
            }
        });
        Mat head;
        head.parts = 1, head.type[0] = m.head_t, head.rows[0] = m.vocab, head.w[0] = m.head;
        gemm_team(m, pc, nthreads, 4, head, m.vocab, ah, S, logits, m.vocab, nullptr, false, hkinds);
    }
    return overflow.load() ? TP_STATUS_PHASES : TP_STATUS_OK;
}

int tp_model_forward(void* handle, int T, const int32_t* ids, const int32_t* pos, const int64_t* slot_mapping,
                      const int32_t* row_table, const int32_t* tables, int S, const int32_t* logit_rows,
                      float* logits, int nthreads, int slot_stride, int table_stride, const uint8_t* row_kinds) {
    return tp_model_forward_lora(handle, T, ids, pos, slot_mapping, row_table, tables, S, logit_rows, logits, nthreads,
                          slot_stride, table_stride, row_kinds, 0, nullptr, nullptr, nullptr, nullptr, nullptr);
}

// Standalone y[M, N] = x[M, K] W[N, K]^T for the tests and the per-call overhead measurement.
// mode: 0 int8 activations, 1 float activations (exact), 2 int8 with residual bytes (fine),
// 3 bf16 activations on AMX tiles: BF16X16 weights, or quantized ones dequantized into tiles (as
// prompt rows take them); without AMX, BF16X16 on VDPBF16PS (bf16dot::runs()), else float; int8.
void tp_gemm(int isa, int wtype, const uint8_t* w, int N, int K, const float* x, int M, float* y, int nthreads,
             int mode) {
    const bool exact = mode == 1 || is_float_packed(wtype);  // float weights take float activations
    const int nb = (K + QK - 1) / QK;
    std::vector<int8_t> q(size_t(M) * nb * QK);
    std::vector<float> d(size_t(M) * nb), s(size_t(M) * nb), f(exact ? size_t(M) * nb * QK : 0), fs(f.size() / QK);
    std::vector<int32_t> qsum(size_t(M) * nb), qsum16(2 * qsum.size());
    std::vector<int8_t> q2(mode == 2 ? q.size() : 0);
    QAct a{q.data(), d.data(), s.data(), nb, qsum.data(), exact ? f.data() : nullptr, exact ? fs.data() : nullptr,
           mode == 2 ? q2.data() : nullptr, qsum16.data()};
    std::vector<int16_t> q16(q2.size());
    if (mode == 2) a.q16 = q16.data();
    std::vector<uint16_t> bf;
#ifndef TP_NO_AVX512
    if (mode == 3 && isa == 2 && (amx_permitted() || bf16dot::runs())) bf.resize((size_t(M) + 16) * nb * QK), a.bf = bf.data();
#endif
    const GemmRowsFn gemm = gemm_rows_for(isa);
    const QuantRowFn quant = quantize_row_for(isa);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; ++m) quant(x + size_t(m) * K, K, a, m);
        // Chunks of outputs as the model's GEMMs claim them (gemm_team: 4 per thread, whole groups).
        const int g = grain_for(N, nthreads, 16), chunks = (N + g - 1) / g;
#pragma omp for schedule(static)
        for (int c = 0; c < chunks; ++c) gemm(wtype, w, nb, a, M, y, N, c * g, (c + 1) * g < N ? (c + 1) * g : N,
                                              nullptr, false, exact);
    }
}

int tp_gemm_tiles(int isa, int wtype, int fine, int M, int32_t* sizes) {
#ifdef TP_NO_AVX512
    (void)isa;
    return avx2::gemm_tiles(wtype, fine != 0, M, sizes);
#else
    return isa == 2 ? avx512::gemm_tiles(wtype, fine != 0, M, sizes) : avx2::gemm_tiles(wtype, fine != 0, M, sizes);
#endif
}

}  // extern "C"
