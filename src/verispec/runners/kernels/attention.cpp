// Attention over a static KV cache, one (query row, KV head) at a time, through the kernel table
// of the ISA (scores, softmax numerators, weighted sums).
//
// Row i attends slots 0 .. start + i (causal; with a sliding window W, slots start + i - W + 1 ..
// start + i) or the slots listed in visible[i] (a token tree, windows already applied by the
// caller), in increasing order; both cases run the same loop over a list of slots, so a tree node's
// result equals the chain position's with the same keys. Dot products keep 16 partial lanes reduced
// in one fixed tree (each ISA's scores_* adds the same pairs); the softmax uses exp_clamped; the
// weighted sums run over the slots in order. The query heads sharing a KV head (GQA) go through
// the keys together, each with exactly its one-query operations. Nothing depends on the other
// rows, the thread or the number of rows.

#include <algorithm>
#include <cmath>
#include <vector>

#include "core.h"

namespace vsk {

namespace {

// The query heads of one group (GQA: nq heads sharing one KV head) of one row, over the same
// `count` slots: each key and value row is loaded once for all nq queries. scores: [nq][count].
// Each query's numerators are summed in slot order from 0; the nq sums advance together (one
// chain each: the additions of one do not wait for another's).
void attend_group(const float* q, int nq, const float* keys, const float* values, int64_t head_dim, const int64_t* slots,
                  int64_t count, float scale, const KernelTable& k, float* scores, float* out) {
    float total[MAX_GROUP];
    k.scores(q, nq, keys, head_dim, slots, count, scale, scores);
    for (int a = 0; a < nq; ++a) {
        k.softmax_numerators(scores + a * count, count);
        total[a] = 0.0f;
    }
    for (int64_t j = 0; j < count; ++j)
        for (int a = 0; a < nq; ++a) total[a] = total[a] + scores[a * count + j];
    k.weighted_sum(scores, nq, values, head_dim, slots, count, out);
    for (int a = 0; a < nq; ++a) {
        const float inv = 1.0f / total[a];
        for (int64_t c = 0; c < head_dim; ++c) out[a * head_dim + c] = out[a * head_dim + c] * inv;
    }
}

}  // namespace

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
    const KernelTable& k = kernel_table(isa);
    const int64_t group = a.heads / a.kv_heads;
    for (int64_t index = begin; index < end; ++index) {
        const int64_t i = index / a.kv_heads, kvh = index % a.kv_heads;
        // causal with a sliding window: the contiguous slots first .. start + i (slot = position)
        const int64_t first = (a.visible || a.window <= 0) ? 0 : std::max<int64_t>(0, a.start + i + 1 - a.window);
        const int64_t count = a.visible ? a.lengths[i] : a.start + i + 1 - first;
        for (int64_t h0 = 0; h0 < group; h0 += MAX_GROUP) {
            const int nq = (int)std::min<int64_t>(MAX_GROUP, group - h0);
            const int64_t h = kvh * group + h0;
            scores.resize(std::max<int64_t>(count, 1) * nq);
            attend_group(a.q + (i * a.heads + h) * a.head_dim, nq, a.keys + (kvh * a.capacity + first) * a.head_dim,
                         a.values + (kvh * a.capacity + first) * a.head_dim, a.head_dim, a.visible ? a.visible + i * a.width : nullptr,
                         count, a.scale, k, scores.data(), a.out + (i * a.heads + h) * a.head_dim);
        }
    }
}

}  // namespace vsk
