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
//
// Causal rows without a window are scored ATTENTION_ROWS at a time (a prefill's rows): the query
// heads of those rows that share a KV head go through the keys together (each key row read once
// for all of them, from L1, instead of once per row from L2 or L3), over the slots the last row
// sees; each row then takes the first start + i + 1 of its scores, exactly the scores it gets
// alone (a query's score for a key is the same operations whichever queries share the pass), and
// its softmax and weighted sum run as alone.

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
// The rest of attend_group once the scores [nq][count] are in: softmax numerators, their sums,
// the weighted sums of the values and the division.
void finish_group(int nq, const float* values, int64_t head_dim, const int64_t* slots, int64_t count,
                  const KernelTable& k, float* scores, float* out) {
    float total[MAX_GROUP];
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

void attend_group(const float* q, int nq, const float* keys, const float* values, int64_t head_dim, const int64_t* slots,
                  int64_t count, float scale, const KernelTable& k, float* scores, float* out) {
    k.scores(q, nq, keys, head_dim, slots, count, scale, scores);
    finish_group(nq, values, head_dim, slots, count, k, scores, out);
}

// Whether the rows are scored ATTENTION_ROWS at a time: causal, no window, one group per KV head.
bool blocks_rows(const AttentionArgs& a) { return !a.visible && a.window <= 0 && a.heads / a.kv_heads <= MAX_GROUP; }

// Rows i0 .. i0 + nr - 1 of KV head kvh (see the top of the file).
void attend_rows(const AttentionArgs& a, int64_t i0, int64_t nr, int64_t kvh, const KernelTable& k,
                 std::vector<float>& queries, std::vector<float>& scores, std::vector<float>& row_scores) {
    const int64_t group = a.heads / a.kv_heads, dim = a.head_dim;
    const int64_t count = a.start + i0 + nr;  // the slots the block's last row sees
    queries.resize(nr * group * dim);
    for (int64_t r = 0; r < nr; ++r)
        std::copy_n(a.q + ((i0 + r) * a.heads + kvh * group) * dim, group * dim, queries.data() + r * group * dim);
    scores.resize(nr * group * count);
    k.scores(queries.data(), (int)(nr * group), a.keys + kvh * a.capacity * dim, dim, nullptr, count, a.scale, scores.data());
    for (int64_t r = 0; r < nr; ++r) {
        const int64_t seen = a.start + i0 + r + 1;
        row_scores.resize(group * seen);
        for (int64_t h = 0; h < group; ++h)
            std::copy_n(scores.data() + (r * group + h) * count, seen, row_scores.data() + h * seen);
        finish_group((int)group, a.values + kvh * a.capacity * dim, dim, nullptr, seen, k, row_scores.data(),
                     a.out + ((i0 + r) * a.heads + kvh * group) * dim);
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

int64_t attention_item_count(const AttentionArgs& a) {
    return (blocks_rows(a) ? (a.rows + ATTENTION_ROWS - 1) / ATTENTION_ROWS : a.rows) * a.kv_heads;
}

void attention_items(const AttentionArgs& a, int64_t begin, int64_t end, Isa isa) {
    std::vector<float> scores;
    const KernelTable& k = kernel_table(isa);
    if (blocks_rows(a)) {
        std::vector<float> queries, row_scores;
        for (int64_t index = begin; index < end; ++index) {
            const int64_t i0 = (index / a.kv_heads) * ATTENTION_ROWS, kvh = index % a.kv_heads;
            if (i0 < a.rows) attend_rows(a, i0, std::min(ATTENTION_ROWS, a.rows - i0), kvh, k, queries, scores, row_scores);
        }
        return;
    }
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
