// The gated MLPs' activations on 8 lanes: SiLU(gate) * up (SwiGLU: Llama, Qwen, the experts of
// Qwen3-MoE and Mixtral) and tanh-GELU(gate) * up (GeGLU: Gemma). Included by forward.cpp (dense
// MLPs) inside its anonymous namespace, after vec_math.h, and so seen by moe.h.
#pragma once

// out[i] = SiLU(g[i]) * u[i] = g / (1 + exp(-g)) * u: the MLP's gate (libm's scalar expf here
// was ~3% of a prefill step).
inline void silu_mul(const float* g, const float* u, float* out, int n) {
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(one, vec::exp2_ps(_mm256_mul_ps(gv, _mm256_set1_ps(-1.44269504f))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// out[i] = GELU_tanh(g[i]) * u[i] (Gemma's GeGLU): 0.5 g (1 + tanh(z)) = g / (1 + exp(-2 z)),
// z = sqrt(2 / pi) (g + 0.044715 g^3).
inline void gelu_mul(const float* g, const float* u, float* out, int n) {
    constexpr float c = 0.7978845608f, k = 0.044715f;
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 z = _mm256_mul_ps(_mm256_set1_ps(c), _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k), gv),
                                                                          _mm256_mul_ps(gv, gv), gv));
        const __m256 den = _mm256_add_ps(one, vec::exp2_ps(_mm256_mul_ps(z, _mm256_set1_ps(-2.f * 1.44269504f))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; ++i) {
        const float z = c * (g[i] + k * g[i] * g[i] * g[i]);
        out[i] = g[i] / (1.f + std::exp(-2.f * z)) * u[i];
    }
}
