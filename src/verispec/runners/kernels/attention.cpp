// Attention over a static KV cache, one (query row, KV head) at a time, and the other row-local
// float ops of a decoder step (RoPE, SwiGLU, RMSNorm).
//
// Row i attends slots 0 .. start + i (causal) or the slots listed in visible[i] (a token tree),
// in increasing order; both cases run the same loop over a list of slots, so a tree node's
// result equals the chain position's with the same keys. Dot products keep 16 partial lanes reduced
// in one fixed tree (each ISA's scores_* adds the same pairs); the softmax uses exp_clamped; the
// weighted sums run over the slots in order. The query heads sharing a KV head (GQA) go through
// the keys together, each with exactly its one-query operations. Nothing depends on the other
// rows, the thread or the number of rows.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core.h"

#if defined(__x86_64__) || defined(_M_X64)
// The compiler vectorises these loops for the CPU it runs on; the operations are the scalar ones
// lane by lane (no contraction, no reassociation), so every clone gives the same bits.
#define VS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VS_CLONES
#endif

namespace vsk {

namespace {

void scores_for(Isa isa, const float* q, int nq, const float* keys, int64_t head_dim, const int64_t* slots, int64_t count,
                float scale, float* scores) {
    switch (isa) {
        case Isa::Avx512: scores_avx512(q, nq, keys, head_dim, slots, count, scale, scores); break;
        case Isa::Avx2:
        case Isa::AvxVnni: scores_avx2(q, nq, keys, head_dim, slots, count, scale, scores); break;
        case Isa::Neon: scores_neon(q, nq, keys, head_dim, slots, count, scale, scores); break;
        default: scores_portable(q, nq, keys, head_dim, slots, count, scale, scores); break;
    }
}

void weighted_sum_for(Isa isa, const float* p, int nq, const float* values, int64_t head_dim, const int64_t* slots,
                      int64_t count, float* out) {
    switch (isa) {
        case Isa::Avx512: weighted_sum_avx512(p, nq, values, head_dim, slots, count, out); break;
        case Isa::Avx2:
        case Isa::AvxVnni: weighted_sum_avx2(p, nq, values, head_dim, slots, count, out); break;
        case Isa::Neon: weighted_sum_neon(p, nq, values, head_dim, slots, count, out); break;
        default: weighted_sum_portable(p, nq, values, head_dim, slots, count, out); break;
    }
}

// softmax numerators in place: p[j] = exp(s[j] - max s) (their sums: attend_group).
VS_CLONES void softmax_numerators_scalar(float* s, int64_t count) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < count; ++j) best = std::max(best, s[j]);
    for (int64_t j = 0; j < count; ++j) s[j] = exp_clamped(s[j] - best);  // vectorised (AVX-512)
}

// The query heads of one group (GQA: nq heads sharing one KV head) of one row, over the same
// `count` slots: each key and value row is loaded once for all nq queries. scores: [nq][count].
// Each query's numerators are summed in slot order from 0; the nq sums advance together (one
// chain each: the additions of one do not wait for another's).
void attend_group(const float* q, int nq, const float* keys, const float* values, int64_t head_dim, const int64_t* slots,
                  int64_t count, float scale, Isa isa, float* scores, float* out) {
    float total[MAX_GROUP];
    scores_for(isa, q, nq, keys, head_dim, slots, count, scale, scores);
    for (int a = 0; a < nq; ++a) {
        softmax_numerators(scores + a * count, count, isa);
        total[a] = 0.0f;
    }
    for (int64_t j = 0; j < count; ++j)
        for (int a = 0; a < nq; ++a) total[a] = total[a] + scores[a * count + j];
    weighted_sum_for(isa, scores, nq, values, head_dim, slots, count, out);
    for (int a = 0; a < nq; ++a) {
        const float inv = 1.0f / total[a];
        for (int64_t c = 0; c < head_dim; ++c) out[a * head_dim + c] = out[a * head_dim + c] * inv;
    }
}

}  // namespace

void softmax_numerators(float* s, int64_t count, Isa isa) {
    // GCC vectorises the scalar loop for AVX-512 only (its clamps are branches under the default
    // -ftrapping-math elsewhere): AVX2 and NEON have their own, the same operations lane by lane.
    if ((isa == Isa::Avx2 || isa == Isa::AvxVnni) && softmax_numerators_avx2(s, count)) return;
    if (isa == Isa::Neon && softmax_numerators_neon(s, count)) return;
    softmax_numerators_scalar(s, count);
}

void check_attention(const AttentionArgs& a) {
    VSK_CHECK(a.head_dim % LANES == 0, "head_dim must be a multiple of 16, got " + std::to_string(a.head_dim));
    VSK_CHECK(a.kv_heads > 0 && a.heads % a.kv_heads == 0, "query and key heads do not match");
    if (a.visible) {
        for (int64_t i = 0; i < a.rows; ++i) {
            VSK_CHECK(a.lengths[i] >= 0 && a.lengths[i] <= a.width, "a tree row's length exceeds its slot list");
            for (int64_t j = 0; j < a.lengths[i]; ++j)
                VSK_CHECK(a.visible[i * a.width + j] >= 0 && a.visible[i * a.width + j] < a.capacity,
                          "a visible slot is outside the cache");
        }
    } else {
        VSK_CHECK(a.start >= 0 && a.start + a.rows <= a.capacity, "the rows do not fit the cache");
    }
}

void attention_items(const AttentionArgs& a, int64_t begin, int64_t end, Isa isa) {
    std::vector<float> scores;
    const int64_t group = a.heads / a.kv_heads;
    for (int64_t index = begin; index < end; ++index) {
        const int64_t i = index / a.kv_heads, kvh = index % a.kv_heads;
        const int64_t count = a.visible ? a.lengths[i] : a.start + i + 1;
        for (int64_t h0 = 0; h0 < group; h0 += MAX_GROUP) {
            const int nq = (int)std::min<int64_t>(MAX_GROUP, group - h0);
            const int64_t h = kvh * group + h0;
            scores.resize(std::max<int64_t>(count, 1) * nq);
            attend_group(a.q + (i * a.heads + h) * a.head_dim, nq, a.keys + kvh * a.capacity * a.head_dim,
                         a.values + kvh * a.capacity * a.head_dim, a.head_dim, a.visible ? a.visible + i * a.width : nullptr,
                         count, a.scale, isa, scores.data(), a.out + (i * a.heads + h) * a.head_dim);
        }
    }
}

VS_CLONES void silu_mul_row_scalar(const float* gate, const float* up, int64_t n, float* out) {
    for (int64_t j = 0; j < n; ++j) {
        const float v = gate[j];
        out[j] = (v / (1.0f + exp_clamped(-v))) * up[j];
    }
}

void silu_mul_row(const float* gate, const float* up, int64_t n, float* out, Isa isa) {
    // GCC vectorises the scalar loop for AVX-512 only (its clamps are branches under the default
    // -ftrapping-math elsewhere): AVX2 and NEON have their own, the same operations lane by lane.
    if ((isa == Isa::Avx2 || isa == Isa::AvxVnni) && silu_mul_row_avx2(gate, up, n, out)) return;
    if (isa == Isa::Neon && silu_mul_row_neon(gate, up, n, out)) return;
    silu_mul_row_scalar(gate, up, n, out);
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
