// The LoRA delta of the fused forward (forward.cpp), kept apart so the forward reads as the
// decoder it is. Included by forward.cpp inside its anonymous namespace, after <immintrin.h>
// (AVX2 + FMA, the target forward.cpp is compiled for).
#pragma once

// LoRA (S-LoRA/punica style): the base GEMMs run once for every row; the rows of each adapter
// then get its low-rank delta, y += scale * B (A x), in float32 from the matmul's float input
// (kept in Model::lin while a step has adapters). Rows come grouped by adapter in blocks of up
// to kLoraBlockRows, so one work item reads an adapter's A and B once for a whole block (the
// SGMV idea): per row, they would be read as often as the base weights themselves.
constexpr int kLoraTargets = 7;  // q, k, v, o, gate, up, down (model.py LORA_TARGETS)
constexpr int kLoraMaxRank = 256;
constexpr int kLoraBlockRows = 16;
struct LoraStep {
    int n_blocks;           // row blocks (0: no adapter in this step)
    const int32_t* blocks;  // [n_blocks][3]: slot, first index into rows, number of rows (<= kLoraBlockRows)
    const int32_t* rows;    // the rows of each slot, grouped by slot
    const uint64_t* ptrs;   // [slots][layers][kLoraTargets][2]: A [r, in] and B^T [r, out], IEEE half; 0: untargeted
    const int32_t* ranks;   // [slots]
    const float* scales;    // [slots]: lora_alpha / r (or / sqrt(r), rsLoRA)
};

// dot(a, b) with a in IEEE half precision (widened 8 at a time with F16C), b float32.
inline float fdot(const uint16_t* a, const float* b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i))),
                              _mm256_loadu_ps(b + i), acc);
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    v = _mm_hadd_ps(v, v);
    v = _mm_hadd_ps(v, v);
    float sum = _mm_cvtss_f32(v);
    for (; i < n; ++i) sum += _cvtsh_ss(a[i]) * b[i];
    return sum;
}

// Y[row] += scale * B (A X[row]) for the rows of one block: each row of A and of B^T (stored
// transposed, so both loops stream contiguous memory) is read once for all the block's rows.
// A and B^T are IEEE halves (engine/lora.py native_table): each resident adapter's native copy is
// half the memory of float32. Made to halve the bytes a mixed decode step reads (4 rank-16
// adapters on SmolLM2: ~75 MiB in float32 beside ~85 MiB of Q4_1 base weights), but on a quiet
// machine the mixed/base throughput did not move measurably (0.84x float32, 0.82x halves;
// benchmarks/README.md): the memory is the gain. The sums stay float32.
inline void lora_delta(const uint16_t* A, const uint16_t* Bt, int r, int in, int out, float scale, const int32_t* rows,
                       int nrows, const float* x, int ldx, float* y, int ldy) {
    float u[kLoraBlockRows][kLoraMaxRank];
    for (int j = 0; j < r; ++j) {
        const uint16_t* a = A + size_t(j) * in;
        for (int b = 0; b < nrows; ++b) u[b][j] = scale * fdot(a, x + size_t(rows[b]) * ldx, in);
    }
    for (int j = 0; j < r; ++j) {
        const uint16_t* bt = Bt + size_t(j) * out;
        for (int b = 0; b < nrows; ++b) {
            float* yr = y + size_t(rows[b]) * ldy;
            const float uj = u[b][j];
            const __m256 uv = _mm256_set1_ps(uj);
            int o = 0;
            for (; o + 8 <= out; o += 8)
                _mm256_storeu_ps(yr + o, _mm256_fmadd_ps(uv, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bt + o))),
                                                         _mm256_loadu_ps(yr + o)));
            for (; o < out; ++o) yr[o] += uj * _cvtsh_ss(bt[o]);
        }
    }
}
