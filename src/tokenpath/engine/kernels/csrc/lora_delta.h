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

inline __m256 load_half8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

// u[b][j0 + q] = scale * A[j0 + q] . x[b] for NB rows and NJ (1 or 2) rows of A: NB * NJ
// independent FMA chains, each A load shared by NB rows and each x load by NJ rows of A. One
// chain per dot (the first version) ran at the FMA's latency, a quarter of its throughput.
template <int NB, int NJ>
inline void lora_down(const uint16_t* A, int j0, int in, float scale, const float* const* xs,
                      float (*u)[kLoraMaxRank]) {
    __m256 acc[NJ][NB];
    for (int q = 0; q < NJ; ++q)
        for (int b = 0; b < NB; ++b) acc[q][b] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= in; i += 8) {
        __m256 xv[NB];
        for (int b = 0; b < NB; ++b) xv[b] = _mm256_loadu_ps(xs[b] + i);
        for (int q = 0; q < NJ; ++q) {
            const __m256 av = load_half8(A + size_t(j0 + q) * in + i);
            for (int b = 0; b < NB; ++b) acc[q][b] = _mm256_fmadd_ps(av, xv[b], acc[q][b]);
        }
    }
    for (int q = 0; q < NJ; ++q)
        for (int b = 0; b < NB; ++b) {
            float sum = hsum8(acc[q][b]);
            for (int t = i; t < in; ++t) sum += _cvtsh_ss(A[size_t(j0 + q) * in + t]) * xs[b][t];
            u[b][j0 + q] = scale * sum;
        }
}

// y[b][o..) += sum_j u[b][j] * B^T[j][o..) for NB rows: each output chunk of 16 stays in
// registers across all r rows of B^T (loaded and stored once, not once per j), and each B^T
// load is shared by the NB rows.
template <int NB>
inline void lora_up(const uint16_t* Bt, int r, int out, const float (*u)[kLoraMaxRank], float* const* ys) {
    int o = 0;
    for (; o + 16 <= out; o += 16) {
        __m256 acc[NB][2];
        for (int b = 0; b < NB; ++b) acc[b][0] = _mm256_loadu_ps(ys[b] + o), acc[b][1] = _mm256_loadu_ps(ys[b] + o + 8);
        for (int j = 0; j < r; ++j) {
            const uint16_t* bt = Bt + size_t(j) * out + o;
            const __m256 w0 = load_half8(bt), w1 = load_half8(bt + 8);
            for (int b = 0; b < NB; ++b) {
                const __m256 ub = _mm256_broadcast_ss(&u[b][j]);
                acc[b][0] = _mm256_fmadd_ps(ub, w0, acc[b][0]);
                acc[b][1] = _mm256_fmadd_ps(ub, w1, acc[b][1]);
            }
        }
        for (int b = 0; b < NB; ++b) _mm256_storeu_ps(ys[b] + o, acc[b][0]), _mm256_storeu_ps(ys[b] + o + 8, acc[b][1]);
    }
    for (; o < out; ++o)
        for (int b = 0; b < NB; ++b) {
            float sum = ys[b][o];
            for (int j = 0; j < r; ++j) sum += u[b][j] * _cvtsh_ss(Bt[size_t(j) * out + o]);
            ys[b][o] = sum;
        }
}

template <int NB>
inline void lora_rows(const uint16_t* A, const uint16_t* Bt, int r, int in, int out, float scale, const float* const* xs,
                      float* const* ys, float (*u)[kLoraMaxRank]) {
    int j = 0;
    for (; j + 2 <= r; j += 2) lora_down<NB, 2>(A, j, in, scale, xs, u);
    if (j < r) lora_down<NB, 1>(A, j, in, scale, xs, u);
    lora_up<NB>(Bt, r, out, u, ys);
}

// Y[row] += scale * B (A X[row]) for the rows of one block, four rows at a time: A and B^T
// (stored transposed, so both loops stream contiguous memory) are read once per four rows.
// A and B^T are IEEE halves (engine/lora.py native_table): each resident adapter's native copy is
// half the memory of float32. The halves were made to halve the bytes a mixed decode step reads
// (4 rank-16 adapters on SmolLM2: ~75 MiB in float32 beside ~85 MiB of Q4_1 base weights), but
// the mixed/base throughput did not move (0.84x float32, 0.82x halves): the delta was bound by
// its one FMA chain per dot, not by memory (benchmarks/README.md). The sums stay float32.
inline void lora_delta(const uint16_t* A, const uint16_t* Bt, int r, int in, int out, float scale, const int32_t* rows,
                       int nrows, const float* x, int ldx, float* y, int ldy) {
    alignas(32) float u[4][kLoraMaxRank];
    for (int b0 = 0; b0 < nrows; b0 += 4) {
        const int nb = std::min(4, nrows - b0);
        const float* xs[4];
        float* ys[4];
        for (int b = 0; b < nb; ++b) xs[b] = x + size_t(rows[b0 + b]) * ldx, ys[b] = y + size_t(rows[b0 + b]) * ldy;
        switch (nb) {
            case 4: lora_rows<4>(A, Bt, r, in, out, scale, xs, ys, u); break;
            case 3: lora_rows<3>(A, Bt, r, in, out, scale, xs, ys, u); break;
            case 2: lora_rows<2>(A, Bt, r, in, out, scale, xs, ys, u); break;
            default: lora_rows<1>(A, Bt, r, in, out, scale, xs, ys, u); break;
        }
    }
}
