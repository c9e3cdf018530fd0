// A prompt tile's attention on AMX tiles (the _native_avx512 object; forward.cpp calls it for
// tiles of prompt rows where the model asks, kernels/model.py says when).
//
// Why: in a bf16 prefill on an AMX host the GEMMs run on tiles, and attention became a quarter of
// the prompt's CPU time (SmolLM2, 1024-row chunks, one thread: 24% against 54% for every matmul),
// although it is ~4% of the multiply-adds: attn_avx512.cpp does one FMA lane per multiply-add and
// sums scores across lanes. Here a 32-key block of one KV head costs a handful of TDPBF16PS for
// every query of the tile: Q K^T into two 16 x 16 score tiles, then P V into D / 16 output tiles.
//
// What it computes, as vLLM and transformers compute a bf16 checkpoint's attention: queries, keys,
// values and the softmax weights rounded to bf16 (nearest even), every sum in float32. Only prompt
// rows take it (the kPromptTiles bit): generated rows and speculation's verification rows keep
// attn_avx512.cpp's float32 arithmetic, so greedy output with speculation on or off, and across
// batches, is unchanged. A row's result here depends only on its own query and the keys it sees:
// scores are per-element tile sums in a fixed order, and key blocks stay aligned to multiples of
// kKeyBlock, so a prompt gives the same KV bits in any chunking (prefix caching relies on that).
// The online softmax is attn_softmax.h's (log2 units, running max and sum, final divide).
//
// Layout per 32-key block and KV head: K^T as B tiles (row r: the d-pair (2r, 2r + 1) of 16 keys;
// a 16 x 16 transpose of 32-bit pairs per 16 keys and 32 features), V as B tiles (row r: keys
// 2r and 2r + 1 side by side for 16 features; one vpermw per row), P as an A tile (16 queries x 32
// keys). Both pools that hold halves or floats are read (float16, float32); fp8 and q8_0 pools
// keep attn_avx512.cpp's kernel (attend_prompt_runs).
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // see dot_avx512.cpp (and -Wuninitialized: the same)
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "amx_tiles.h"
#include "attn_tile.h"
#include "kv_fp8.h"
#include "tp_kernels.h"
#include "vec_math.h"

namespace tp::amx {
namespace {

using paged::kKeyBlock;
using paged::Tile;

constexpr int kKiB = 256;  // floats per KiB (one tile)

// 16 floats -> 16 bf16 (round to nearest even), as forward's bf16 activations are rounded.
inline __m256i bf16x16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16));
}
inline __m512i bf16x32(__m512 lo, __m512 hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16(lo)), bf16x16(hi), 1);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// 2^x on 16 lanes: vec_math.h's exp2_ps (the same clamp, reduction and polynomial).
inline __m512 exp2_16(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-125.f)), _mm512_set1_ps(127.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(vec::kExp2Poly[0]);
    for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(vec::kExp2Poly[i]));
    const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e)));
}

// r[k] <- column k of the 16 x 16 matrix of 32-bit lanes whose rows are r[0..15].
inline void transpose16(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows 0-3 with 4-7, 8-11 with 12-15
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88), t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i)
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
}

// Where the scratch's parts start (floats from a 64-byte aligned base).
struct Parts {
    uint16_t *q, *kt, *vt, *p;
    float *o, *run_max, *run_sum, *alpha, *s, *c;
};

inline size_t round16(size_t n) { return (n + 15) / 16 * 16; }

Parts carve(float* scratch, int D, int nqp) {
    float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
    Parts s;
    s.kt = reinterpret_cast<uint16_t*>(base);                       // 2 x D/32 tiles: K^T of the block
    s.vt = s.kt + size_t(2 * (D / 32)) * 512;                       // D/16 tiles: V of the block
    s.p = s.vt + size_t(D / 16) * 512;                              // 1 tile: the block's weights (A)
    s.s = reinterpret_cast<float*>(s.p + 512);                      // 16 x 32 scores
    s.c = s.s + 2 * kKiB;                                           // 4 output tiles
    s.q = reinterpret_cast<uint16_t*>(s.c + 4 * kKiB);              // [nqp][D] bf16 queries
    s.o = reinterpret_cast<float*>(s.q + size_t(nqp) * D);          // [nqp][D] outputs
    s.run_max = s.o + size_t(nqp) * D, s.run_sum = s.run_max + nqp, s.alpha = s.run_sum + nqp;
    return s;
}

// One 16 x 16 tile of P V (the weights in A tile 4, V's B tile vt) into c, on C tile T and B tile
// 5. A macro: the tile intrinsics spell their tile number into the instruction.
#define TP_PV_TILE(T, vt, c)        \
    do {                            \
        _tile_zero(T);              \
        _tile_loadd(5, (vt), 64);   \
        _tile_dpbf16ps(T, 4, 5);    \
        _tile_stored(T, (c), 64);   \
    } while (0)

template <class KV>
void attend(const KV* kc, const KV* vc, const Tile& tile, int bs, int kv_width, int g0, int g1, int D, int rep,
            float scale, float* scratch) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    const int nq = tile.nrows * rep, nqp = int(round16(size_t(nq))), ndc = D / 32, ndt = D / 16;
    const Parts s = carve(scratch, D, nqp);
    const float sl2e = scale * 1.44269504f;
    const int ctx_end = tile.p0 + tile.nrows;
    for (int g = g0; g < g1; ++g) {
        const size_t head = size_t(g - g0) * rep * D;
        for (int i = 0; i < nqp; ++i) {  // this KV head's queries in bf16, query i = row i / rep, head i % rep
            uint16_t* dst = s.q + size_t(i) * D;
            if (i >= nq) {
                std::memset(dst, 0, sizeof(uint16_t) * D);
                continue;
            }
            const float* q = tile.q0 + size_t(i / rep) * tile.q_stride + head + size_t(i % rep) * D;
            for (int c = 0; c < D; c += 32) _mm512_storeu_si512(dst + c, bf16x32(load16(q + c), load16(q + c + 16)));
        }
        std::memset(s.o, 0, sizeof(float) * size_t(nqp) * D);
        for (int i = 0; i < nqp; ++i) s.run_max[i] = -INFINITY, s.run_sum[i] = 0.f;
        const size_t first = size_t(g) * D;
        for (int j0 = tile.key_lo(0) / kKeyBlock * kKeyBlock; j0 < ctx_end; j0 += kKeyBlock) {
            const int nk = ctx_end - j0 < kKeyBlock ? ctx_end - j0 : kKeyBlock;
            const KV* krow[kKeyBlock];
            const KV* vrow[kKeyBlock];
            for (int i = 0; i < nk; ++i) {
                const int j = j0 + i;
                const size_t off = (size_t(tile.table[j / bs]) * bs + j % bs) * kv_width + first;
                krow[i] = kc + off, vrow[i] = vc + off;
            }
            // K^T: B tile (half h, features [32 dc, 32 dc + 32)), row r = feature pair r of keys 16 h ..
            for (int h = 0; h < 2; ++h)
                for (int dc = 0; dc < ndc; ++dc) {
                    __m512i r[16];
                    for (int c = 0; c < 16; ++c) {
                        const int i = 16 * h + c;
                        r[c] = i < nk ? bf16x32(load16(krow[i] + 32 * dc), load16(krow[i] + 32 * dc + 16))
                                      : _mm512_setzero_si512();
                    }
                    transpose16(r);
                    uint16_t* dst = s.kt + size_t(h * ndc + dc) * 512;
                    for (int c = 0; c < 16; ++c) _mm512_store_si512(dst + 32 * c, r[c]);
                }
            // V: B tile (features [16 dt, 16 dt + 16)), row r = keys 2r and 2r + 1 interleaved.
            const __m512i pairs = _mm512_load_si512(kPairInterleave);
            for (int dt = 0; dt < ndt; ++dt)
                for (int r = 0; r < 16; ++r) {
                    const int i = 2 * r;
                    const __m512 a = i < nk ? load16(vrow[i] + 16 * dt) : _mm512_setzero_ps();
                    const __m512 b = i + 1 < nk ? load16(vrow[i + 1] + 16 * dt) : _mm512_setzero_ps();
                    _mm512_store_si512(s.vt + size_t(dt) * 512 + 32 * r, _mm512_permutexvar_epi16(pairs, bf16x32(a, b)));
                }
            for (int a0 = 0; a0 < nqp; a0 += 16) {
                _tile_zero(0);
                _tile_zero(1);
                for (int dc = 0; dc < ndc; ++dc) {
                    _tile_loadd(4, s.q + size_t(a0) * D + 32 * dc, D * 2);
                    _tile_loadd(5, s.kt + size_t(dc) * 512, 64);
                    _tile_loadd(6, s.kt + size_t(ndc + dc) * 512, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(1, 4, 6);
                }
                _tile_stored(0, s.s, 128);
                _tile_stored(1, s.s + 16, 128);
                // The block's softmax step per query (attn_softmax.h's), and its weights as a bf16 A tile.
                for (int q = 0; q < 16; ++q) {
                    const int i = a0 + q;
                    __m512 p0 = _mm512_setzero_ps(), p1 = p0;
                    float alpha = 1.f;
                    if (i < nq) {
                        const int row = i / rep;
                        const int hi = tile.p0 + row + 1 - j0 < nk ? tile.p0 + row + 1 - j0 : nk;  // causal
                        const int lo = tile.key_lo(row) > j0 ? tile.key_lo(row) - j0 : 0;          // window
                        if (hi > lo) {
                            const uint32_t bits = (hi == 32 ? ~0u : (1u << hi) - 1) & ~((1u << lo) - 1);
                            const __mmask16 m0 = __mmask16(bits), m1 = __mmask16(bits >> 16);
                            const __m512 ninf = _mm512_set1_ps(-INFINITY), vs = _mm512_set1_ps(sl2e);
                            const __m512 s0 = _mm512_mask_mul_ps(ninf, m0, _mm512_load_ps(s.s + 32 * q), vs);
                            const __m512 s1 = _mm512_mask_mul_ps(ninf, m1, _mm512_load_ps(s.s + 32 * q + 16), vs);
                            const float bm = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
                            const float mx = s.run_max[i] > bm ? s.run_max[i] : bm;
                            alpha = std::exp2(s.run_max[i] - mx);  // 0 on the row's first block
                            p0 = exp2_16(_mm512_sub_ps(s0, _mm512_set1_ps(mx)));
                            p1 = exp2_16(_mm512_sub_ps(s1, _mm512_set1_ps(mx)));
                            s.run_sum[i] = s.run_sum[i] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
                            s.run_max[i] = mx;
                        }
                    }
                    s.alpha[q] = alpha;
                    _mm512_store_si512(s.p + 32 * q, bf16x32(p0, p1));
                }
                for (int q = 0; q < 16 && a0 + q < nq; ++q)
                    if (s.alpha[q] != 1.f) {
                        float* o = s.o + size_t(a0 + q) * D;
                        const __m512 va = _mm512_set1_ps(s.alpha[q]);
                        for (int c = 0; c < D; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(va, _mm512_loadu_ps(o + c)));
                    }
                _tile_loadd(4, s.p, 64);
                for (int dt = 0; dt < ndt; dt += 4) {  // up to 4 output tiles at a time (C tiles 0..3)
                    const int n = ndt - dt < 4 ? ndt - dt : 4;
                    TP_PV_TILE(0, s.vt + size_t(dt) * 512, s.c);
                    if (n > 1) TP_PV_TILE(1, s.vt + size_t(dt + 1) * 512, s.c + kKiB);
                    if (n > 2) TP_PV_TILE(2, s.vt + size_t(dt + 2) * 512, s.c + 2 * kKiB);
                    if (n > 3) TP_PV_TILE(3, s.vt + size_t(dt + 3) * 512, s.c + 3 * kKiB);
                    for (int q = 0; q < 16 && a0 + q < nq; ++q) {
                        float* o = s.o + size_t(a0 + q) * D + 16 * dt;
                        for (int t = 0; t < n; ++t)
                            _mm512_storeu_ps(o + 16 * t, _mm512_add_ps(_mm512_loadu_ps(o + 16 * t),
                                                                       _mm512_load_ps(s.c + t * kKiB + 16 * q)));
                    }
                }
            }
        }
        for (int i = 0; i < nq; ++i) {
            float* out = tile.o0 + size_t(i / rep) * tile.o_stride + head + size_t(i % rep) * D;
            const __m512 inv = _mm512_set1_ps(1.f / s.run_sum[i]);
            for (int c = 0; c < D; c += 16) _mm512_storeu_ps(out + c, _mm512_mul_ps(inv, _mm512_loadu_ps(s.o + size_t(i) * D + c)));
        }
    }
    _tile_release();
}

}  // namespace

bool attend_prompt_runs(int head_dim, int kv_kind) {
    return head_dim % 32 == 0 && head_dim <= 512 && (kv_kind == kKvF16 || kv_kind == kKvF32);
}

size_t attend_prompt_scratch_floats(int head_dim, int queries) {
    const size_t nqp = round16(size_t(queries)), D = size_t(head_dim);
    return 16 + (2 * (D / 32) + D / 16 + 1) * kKiB + 2 * kKiB + 4 * kKiB + nqp * D / 2 + nqp * D + 3 * nqp;
}

void attend_prompt_tile(int kv_kind, const void* k_cache, const void* v_cache, const Tile& tile, int bs, int kv_width,
                        int g0, int g1, int D, int rep, float scale, float* scratch) {
    if (kv_kind == kKvF16)
        attend(static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache), tile, bs, kv_width, g0, g1,
               D, rep, scale, scratch);
    else
        attend(static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), tile, bs, kv_width, g0, g1, D,
               rep, scale, scratch);
}

}  // namespace tp::amx
