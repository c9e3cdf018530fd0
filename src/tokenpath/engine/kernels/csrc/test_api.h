// Test entry points (forward.cpp includes this after store_kv and step_acts.h). The KV pool's
// conversions and the paged attention: tests/engine/test_kv_fp8.py checks the fp8 codes against a
// reference written from the formats' definitions, and attention over an fp8 pool against attention
// over the float32 values decoded from the same bytes. A decode GEMM's chunk table:
// tests/engine/test_kernels.py checks its cover and its bounds for any matrix and team size. They
// run the engine's own functions, not copies.
#pragma once

#include <vector>

extern "C" {

// decode_chunks (step_acts.h) for a matrix of `parts` parts (kernel type and rows each), N rows of nb
// 32-blocks, `nthreads` threads: the chunks' ends into `ends` (room for kMaxDecodeChunks); their number.
int tp_decode_chunks(const int32_t* types, const int32_t* rows, int parts, int N, int nb, int nthreads,
                     int32_t* ends) {
    Mat w;
    for (; w.parts < std::min(parts, kMaxParts); ++w.parts)
        w.type[w.parts] = types[w.parts], w.rows[w.parts] = rows[w.parts];
    const DecodeChunks dc = decode_chunks(w, N, nb, std::max(nthreads, 1));
    std::copy(dc.end, dc.end + dc.n, ends);
    return dc.n;
}

// n values through store_kv / widen: floats -> KvKind `kind` codes or q8_0 blocks (to_float 0), or back (1).
void tp_kv_convert(int kind, int to_float, const void* src, void* dst, int n) {
    if (kind == kKvQ8 && n % 32) return;  // whole q8_0 blocks only
    with_kv_type(kind, [&](auto* type) {
        using KV = std::remove_pointer_t<decltype(type)>;
        if (!to_float) return store_kv(static_cast<KV*>(dst), static_cast<const float*>(src), n);
        const float* row = paged::widen(static_cast<const KV*>(src), static_cast<float*>(dst), n);
        if (row != dst) std::memcpy(dst, row, sizeof(float) * n);
    });
}

// One attention tile over all n_kv heads: rows 0..nrows-1 (at most paged::kTileRows) at positions
// p0.., queries q [nrows, n_kv * rep, D], output o alike; the pool [slots, n_kv, D] of KvKind
// `kind` with block table `table` (block size bs); window 0: full causal attention; isa 2: the
// AVX-512 kernels where the object has them and head_dim allows (as tp_model_create chooses); isa
// 3: a tile of prompt rows (up to paged::kPromptTileRows) on AMX tiles (attn_amx.cpp), where the
// object has it, this process may run tiles and the kind and head_dim allow; else o is not written.
void tp_attend_tile_test(int kind, const void* k_cache, const void* v_cache, const float* q, float* o,
                         const int32_t* table, int nrows, int p0, int bs, int n_kv, int D, int rep, float scale,
                         int window, int isa) {
    if (nrows < 1 || nrows > (isa == 3 ? paged::kPromptTileRows : paged::kTileRows)) return;
    std::vector<float> scratch(paged::scratch_floats(n_kv * D, n_kv * rep));
    const int stride = n_kv * rep * D;
    const paged::Tile tile{q, o, stride, stride, nrows, p0, table, window};
    if (isa == 3) {
#ifndef TP_NO_AVX512
        if (amx_permitted() && amx::attend_prompt_runs(D, kind)) {
            scratch.resize(amx::attend_prompt_scratch_floats(D, nrows * rep));
            amx::attend_prompt_tile(kind, k_cache, v_cache, tile, bs, n_kv * D, 0, n_kv, D, rep, scale, scratch.data());
        }
#endif
        return;
    }
    attend(attn512_for(isa, D), kind, k_cache, v_cache, tile, bs, n_kv * D, 0, n_kv, D, rep, scale, scratch.data());
}

}  // extern "C"
