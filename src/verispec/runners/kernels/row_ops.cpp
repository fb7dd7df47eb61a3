// The row-local float ops of a decoder step outside attention and the products: SwiGLU, the
// GELU-tanh gated MLP (GeGLU), RMSNorm and the softmax numerators (attention's), each the same bits
// on every ISA path.
//
// The portable versions are plain loops that GCC vectorises for the CPU it runs on (function
// clones); the operations are the scalar ones lane by lane (no contraction, no reassociation), so
// every clone gives the same bits. GCC vectorises the clamped loops (exp_clamped) for AVX-512
// only (under the default -ftrapping-math its clamps are branches elsewhere), so the AVX2 and NEON
// paths have their own (x86_avx2.cpp, arm_neon_float.cpp), the same operations lane by lane.

#include <algorithm>
#include <cmath>
#include <limits>

#include "core.h"

#if defined(__x86_64__) || defined(_M_X64)
#define VS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VS_CLONES
#endif

namespace vsk {

VS_CLONES void softmax_numerators_portable(float* s, int64_t count) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < count; ++j) best = std::max(best, s[j]);
    for (int64_t j = 0; j < count; ++j) s[j] = exp_clamped(s[j] - best);  // vectorised (AVX-512)
}

VS_CLONES void silu_mul_row_portable(const float* gate, const float* up, int64_t n, float* out) {
    for (int64_t j = 0; j < n; ++j) {
        const float v = gate[j];
        out[j] = (v / (1.0f + exp_clamped(-v))) * up[j];
    }
}

// gelu_tanh(v) = 0.5 v (1 + tanh(u)) = v / (1 + exp(-2u)), u = sqrt(2 / pi) (v + 0.044715 v^3)
// (Hendrycks & Gimpel 2016; transformers' gelu_pytorch_tanh), with exp_clamped: no libm tanh,
// whose results differ between libraries and vector widths. The operations in this order.
VS_CLONES void gelu_mul_row_portable(const float* gate, const float* up, int64_t n, float* out) {
    for (int64_t j = 0; j < n; ++j) {
        const float v = gate[j];
        float t = v * v;
        t = t * v;
        t = t * GELU_CUBIC;
        t = v + t;
        t = t * GELU_TWO_SQRT_2_OVER_PI;
        out[j] = (v / (1.0f + exp_clamped(-t))) * up[j];
    }
}

void gelu_mul_row(const float* gate, const float* up, int64_t n, float* out, Isa isa) {
    kernel_table(isa).gelu_mul_row(gate, up, n, out);
}

void softmax_numerators(float* s, int64_t count, Isa isa) { kernel_table(isa).softmax_numerators(s, count); }

void silu_mul_row(const float* gate, const float* up, int64_t n, float* out, Isa isa) {
    kernel_table(isa).silu_mul_row(gate, up, n, out);
}

VS_CLONES void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* out) {
    float lane[16] = {};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; ++l) lane[l] += x[j + l] * x[j + l];
    for (int l = 0; j + l < n; ++l) lane[l] += x[j + l] * x[j + l];
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
    const float inv = 1.0f / std::sqrt(lane[0] / (float)n + eps);
    for (j = 0; j < n; ++j) out[j] = (x[j] * inv) * weight[j];
}

}  // namespace vsk
