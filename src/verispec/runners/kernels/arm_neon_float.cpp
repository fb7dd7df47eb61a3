// The ARM NEON path's float kernels (AArch64; plain ARMv8.0 Advanced SIMD, no extension needed):
// the activation rows' int8 quantization (quantize_block_neon), attention's scores, softmax
// numerators and weighted sums (scores_neon, softmax_numerators_neon, weighted_sum_neon), SwiGLU
// (silu_mul_row_neon) and the IQ4_NL scale search (fit_iq4_nl_neon). The tile products are
// arm_neon.cpp.
//
// Each is its portable counterpart (portable.cpp, attention.cpp, requantize.cpp) lane by lane, bit
// for bit: separate vmulq_f32 / vaddq_f32 in the portable operand order (never vfmaq / vmlaq: a
// fused or contracted operation rounds once instead of twice; the build has -ffp-contract=off), and
// float reductions that add the same pairs, in the same order, as the portable tree.

#include "core.h"

#if defined(__aarch64__)

#include <arm_neon.h>

#include <algorithm>
#include <limits>

namespace vsk {

namespace {

// 16 partial lanes in 4 registers reduced by the portable tree: l + 8 (registers 0 + 2, 1 + 3),
// then l + 4 (the first of those sums plus the second); the last two steps are left to the caller
// (they go across lanes).
inline float32x4_t fold_to_4(const float32x4_t* v) { return vaddq_f32(vaddq_f32(v[0], v[2]), vaddq_f32(v[1], v[3])); }

// The rest of the tree for one set of 4 lanes: l + 2 (lanes 0 + 2, 1 + 3), then l + 1.
inline float fold_4(float32x4_t s) {
    const float32x4_t u = vaddq_f32(s, vextq_f32(s, s, 2));
    return vgetq_lane_f32(u, 0) + vgetq_lane_f32(u, 1);
}

// The nearest IQ4_NL level as a float: the index is the number of midpoints between levels strictly
// below v (ties go low, NaN to 0: the index nearest_iq4_nl gives, whose table decides the same
// way), looked up in the 16 float levels (64 bytes) by a byte table look-up.
struct LevelTable {
    float mid[15];
    uint8x16x4_t levels;
    LevelTable() {
        alignas(16) float f[16];
        for (int l = 0; l < 16; ++l) f[l] = (float)IQ4_NL_VALUES[l];
        for (int k = 0; k < 15; ++k) mid[k] = 0.5f * (float)(IQ4_NL_VALUES[k] + IQ4_NL_VALUES[k + 1]);
        levels = vld1q_u8_x4((const uint8_t*)f);
    }
};

inline float32x4_t nearest_levels(float32x4_t v, const LevelTable& table) {
    int32x4_t index = vdupq_n_s32(0);
    for (int k = 0; k < 15; ++k)  // a true comparison is -1
        index = vsubq_s32(index, vreinterpretq_s32_u32(vcgtq_f32(v, vdupq_n_f32(table.mid[k]))));
    // bytes 4 index .. 4 index + 3 of the table for each lane
    const uint32x4_t bytes = vmlaq_n_u32(vdupq_n_u32(0x03020100u), vreinterpretq_u32_s32(index), 0x04040404u);
    return vreinterpretq_f32_u8(vqtbl4q_u8(table.levels, vreinterpretq_u8_u32(bytes)));
}

// NQ queries (a0 ..) times 16 columns (c0 ..) of the values, the portable order per element: each
// value row's 64 bytes are read once for the NQ queries (4 x NQ accumulators: 24 of the 32
// registers at NQ = 6), as on the AVX2 path. Not timed on an ARM CPU (none at hand; qemu proves bits).
template <int NQ>
void weighted_sum_tile(const float* p, int a0, const float* values, int64_t head_dim, const int64_t* slots,
                       int64_t count, int64_t c0, float* out) {
    float32x4_t s[NQ][4];
    for (int a = 0; a < NQ; ++a)
        for (int i = 0; i < 4; ++i) s[a][i] = vdupq_n_f32(0.0f);
    for (int64_t j = 0; j < count; ++j) {
        const float* v = values + (slots ? slots[j] : j) * head_dim + c0;
        float32x4_t vi[4];
        for (int i = 0; i < 4; ++i) vi[i] = vld1q_f32(v + 4 * i);
        for (int a = 0; a < NQ; ++a) {
            const float32x4_t pj = vdupq_n_f32(p[(a0 + a) * count + j]);
            for (int i = 0; i < 4; ++i) s[a][i] = vaddq_f32(s[a][i], vmulq_f32(pj, vi[i]));
        }
    }
    for (int a = 0; a < NQ; ++a)
        for (int i = 0; i < 4; ++i) vst1q_f32(out + (a0 + a) * head_dim + c0 + 4 * i, s[a][i]);
}

// exp_clamped (core.h) in 4 lanes: the same operations in the same order (separate multiplies and
// adds), so the same bits; the clamps as selects keep a NaN a NaN as the scalar ternaries do,
// vrndiq rounds in the current mode as nearbyint does, and vcvtq is the scalar conversion's fcvtzs.
inline float32x4_t exp_clamped4(float32x4_t x) {
    x = vbslq_f32(vcgtq_f32(x, vdupq_n_f32(88.0f)), vdupq_n_f32(88.0f), x);
    x = vbslq_f32(vcltq_f32(x, vdupq_n_f32(-87.0f)), vdupq_n_f32(-87.0f), x);
    const float32x4_t n = vrndiq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    const float32x4_t r = vsubq_f32(vsubq_f32(x, vmulq_f32(n, vdupq_n_f32(0.693359375f))),
                                    vmulq_f32(n, vdupq_n_f32(-2.12194440e-4f)));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(1.3981999507e-3f));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(8.3334519073e-3f));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(4.1665795894e-2f));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(1.6666665459e-1f));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(5.0000001201e-1f));
    p = vmulq_f32(p, vmulq_f32(r, r));
    p = vaddq_f32(p, r);
    p = vaddq_f32(p, vdupq_n_f32(1.0f));
    const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(bits));
}

}  // namespace

// quantize_block_portable with 4 lanes: the same values bit for bit. max |x| is exact and
// order-free; each lane keeps max(m, |x|) exactly as std::max(m, |x|) = m < |x| ? |x| : m does
// (a NaN never enters, as in the scalar loop), so the lanes hold no NaN and vmaxvq gives the
// block's max. Then x * id, round to nearest even (nearbyint in the default rounding mode), and
// the clamps written as the scalar std::max(-127, v) = -127 < v ? v : -127 (NaN -> -127) and
// std::min(127, v) = v < 127 ? v : 127, so NaN and signed zeros behave as in the scalar code.
void quantize_block_neon(const float* xb, int block_k, int8_t* qb, float* d_out) {
    float32x4_t m[4];
    for (int i = 0; i < 4; ++i) m[i] = vdupq_n_f32(0.0f);
    for (int i = 0; i < block_k; i += 16)
        for (int u = 0; u < 4; ++u) {
            const float32x4_t f = vabsq_f32(vld1q_f32(xb + i + 4 * u));
            m[u] = vbslq_f32(vcltq_f32(m[u], f), f, m[u]);
        }
    const float amax = vmaxvq_f32(vmaxq_f32(vmaxq_f32(m[0], m[1]), vmaxq_f32(m[2], m[3])));
    const float d = amax / 127.0f;
    const float32x4_t id = vdupq_n_f32(d > 0.0f ? 1.0f / d : 0.0f);
    const float32x4_t lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(127.0f);
    for (int i = 0; i < block_k; i += 16) {
        int16x4_t n[4];
        for (int u = 0; u < 4; ++u) {
            float32x4_t v = vrndnq_f32(vmulq_f32(vld1q_f32(xb + i + 4 * u), id));
            v = vbslq_f32(vcltq_f32(lo, v), v, lo);
            v = vbslq_f32(vcltq_f32(v, hi), v, hi);
            n[u] = vmovn_s32(vcvtq_s32_f32(v));  // an integer in -127..127: exact
        }
        vst1q_s8(qb + i, vcombine_s8(vmovn_s16(vcombine_s16(n[0], n[1])), vmovn_s16(vcombine_s16(n[2], n[3]))));
    }
    *d_out = d;
}

// scores_portable for 4 keys at a time: each key's 16 partial lanes in 4 registers (lanes[l] +=
// q[c + l] * k[c + l], a separate multiply and add, from 0), folded l + 8 and l + 4 within the key
// (fold_to_4), then the 4 keys' l + 2 steps in two registers (lanes 0 + 2, 1 + 3 of two keys each)
// and their l + 1 steps in one pairwise add (faddp adds lane 2i and 2i + 1, lower first): the
// pairs of the scalar tree, in its operand order, so the bits are the portable path's. A last
// short group repeats its first key in the unused lanes and stores only its own.
void scores_neon(const float* q, int nq, const float* keys, int64_t head_dim, const int64_t* slots, int64_t count,
                 float scale, float* scores) {
    constexpr int KEYS = 4;  // keys reduced together (one register of scores)
    const float32x4_t vscale = vdupq_n_f32(scale);
    for (int64_t j0 = 0; j0 < count; j0 += KEYS) {
        const int n = (int)std::min<int64_t>(KEYS, count - j0);
        const float* k[KEYS];
        for (int t = 0; t < KEYS; ++t) {
            const int64_t j = j0 + (t < n ? t : 0);
            k[t] = keys + (slots ? slots[j] : j) * head_dim;
        }
        for (int a = 0; a < nq; ++a) {
            const float* qa = q + a * head_dim;
            float32x4_t v[KEYS][4];
            for (int t = 0; t < KEYS; ++t)
                for (int i = 0; i < 4; ++i) v[t][i] = vdupq_n_f32(0.0f);
            for (int64_t c = 0; c < head_dim; c += LANES)
                for (int i = 0; i < 4; ++i) {
                    const float32x4_t qc = vld1q_f32(qa + c + 4 * i);
                    for (int t = 0; t < KEYS; ++t) v[t][i] = vaddq_f32(v[t][i], vmulq_f32(qc, vld1q_f32(k[t] + c + 4 * i)));
                }
            float32x4_t s[KEYS];
            for (int t = 0; t < KEYS; ++t) s[t] = fold_to_4(v[t]);
            const float32x4_t x01 = vaddq_f32(vcombine_f32(vget_low_f32(s[0]), vget_low_f32(s[1])),
                                              vcombine_f32(vget_high_f32(s[0]), vget_high_f32(s[1])));
            const float32x4_t x23 = vaddq_f32(vcombine_f32(vget_low_f32(s[2]), vget_low_f32(s[3])),
                                              vcombine_f32(vget_high_f32(s[2]), vget_high_f32(s[3])));
            const float32x4_t z = vmulq_f32(vpaddq_f32(x01, x23), vscale);
            if (n == KEYS) {
                vst1q_f32(scores + a * count + j0, z);
            } else {
                alignas(16) float tmp[KEYS];
                vst1q_f32(tmp, z);
                for (int t = 0; t < n; ++t) scores[a * count + j0 + t] = tmp[t];
            }
        }
    }
}

// weighted_sum_portable lane by lane: out[a][c] = (((0 + p[a][0] v_0[c]) + p[a][1] v_1[c]) + ...),
// 16 columns of up to 6 queries (a KV head's queries in Qwen2.5-1.5B) at a time.
void weighted_sum_neon(const float* p, int nq, const float* values, int64_t head_dim, const int64_t* slots, int64_t count,
                       float* out) {
    constexpr int MAX_NQ = 6;
    for (int a0 = 0; a0 < nq; a0 += MAX_NQ)
        for (int64_t c0 = 0; c0 < head_dim; c0 += LANES)  // head_dim is a multiple of 16 (check_attention)
            with_group_size(std::min(MAX_NQ, nq - a0), [&](auto n) {
                weighted_sum_tile<decltype(n)::value>(p, a0, values, head_dim, slots, count, c0, out);
            });
}

// silu_mul_row's scalar loop in 4 lanes (vnegq flips the sign as the scalar negation does).
void silu_mul_row_neon(const float* gate, const float* up, int64_t n, float* out) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float32x4_t v = vld1q_f32(gate + j);
        const float32x4_t e = exp_clamped4(vnegq_f32(v));
        vst1q_f32(out + j, vmulq_f32(vdivq_f32(v, vaddq_f32(one, e)), vld1q_f32(up + j)));
    }
    for (; j < n; ++j) out[j] = (gate[j] / (1.0f + exp_clamped(-gate[j]))) * up[j];
}

// gelu_mul_row's scalar loop in 4 lanes, the same operations in the same order.
void gelu_mul_row_neon(const float* gate, const float* up, int64_t n, float* out) {
    const float32x4_t one = vdupq_n_f32(1.0f), cubic = vdupq_n_f32(GELU_CUBIC), k = vdupq_n_f32(GELU_TWO_SQRT_2_OVER_PI);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float32x4_t v = vld1q_f32(gate + j);
        float32x4_t t = vmulq_f32(v, v);
        t = vmulq_f32(t, v);
        t = vmulq_f32(t, cubic);
        t = vaddq_f32(v, t);
        t = vmulq_f32(t, k);
        const float32x4_t e = exp_clamped4(vnegq_f32(t));
        vst1q_f32(out + j, vmulq_f32(vdivq_f32(v, vaddq_f32(one, e)), vld1q_f32(up + j)));
    }
    gelu_mul_row_portable(gate + j, up + j, n - j, out + j);
}

// softmax_numerators' scalar loops in 4 lanes: the maximum per lane as std::max(best, x) =
// best < x ? x : best (a select, so NaNs are skipped as there), then the lanes; then the exponentials.
void softmax_numerators_neon(float* s, int64_t count) {
    float32x4_t best4 = vdupq_n_f32(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 4 <= count; j += 4) {
        const float32x4_t x = vld1q_f32(s + j);
        best4 = vbslq_f32(vcltq_f32(best4, x), x, best4);
    }
    float best = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < 4; ++l) best = std::max(best, best4[l]);
    for (; j < count; ++j) best = std::max(best, s[j]);
    const float32x4_t b = vdupq_n_f32(best);
    for (j = 0; j + 4 <= count; j += 4) vst1q_f32(s + j, exp_clamped4(vsubq_f32(vld1q_f32(s + j), b)));
    for (; j < count; ++j) s[j] = exp_clamped(s[j] - best);
}

// fit_iq4_nl_portable with lanes l (4 registers) and l + 16 (4 more): the same products, the
// lane sums (0 + wqa x_l) + wqb x_(l+16), and the fold l + 8, l + 4, l + 2, l + 1 in its order.
void fit_iq4_nl_neon(const float* x, const float* w, float inv, float& sumqx, float& sumq2) {
    static const LevelTable table;
    const float32x4_t s = vdupq_n_f32(inv), zero = vdupq_n_f32(0.0f);
    float32x4_t qx[4], q2[4];
    for (int i = 0; i < 4; ++i) {
        const float32x4_t xa = vld1q_f32(x + 4 * i), xb = vld1q_f32(x + 16 + 4 * i);
        const float32x4_t qa = nearest_levels(vmulq_f32(s, xa), table), qb = nearest_levels(vmulq_f32(s, xb), table);
        const float32x4_t wqa = vmulq_f32(vld1q_f32(w + 4 * i), qa), wqb = vmulq_f32(vld1q_f32(w + 16 + 4 * i), qb);
        qx[i] = vaddq_f32(vaddq_f32(zero, vmulq_f32(wqa, xa)), vmulq_f32(wqb, xb));
        q2[i] = vaddq_f32(vaddq_f32(zero, vmulq_f32(wqa, qa)), vmulq_f32(wqb, qb));
    }
    sumqx = fold_4(fold_to_4(qx));
    sumq2 = fold_4(fold_to_4(q2));
}

}  // namespace vsk

#else  // not AArch64: the path is not compiled in (isa_supported says so; these are never called)

namespace vsk {
void quantize_block_neon(const float*, int, int8_t*, float*) { fail("the NEON path is not compiled for this CPU"); }
void fit_iq4_nl_neon(const float*, const float*, float, float&, float&) { fail("the NEON path is not compiled for this CPU"); }
void scores_neon(const float*, int, const float*, int64_t, const int64_t*, int64_t, float, float*) {
    fail("the NEON path is not compiled for this CPU");
}
void weighted_sum_neon(const float*, int, const float*, int64_t, const int64_t*, int64_t, float*) {
    fail("the NEON path is not compiled for this CPU");
}
void silu_mul_row_neon(const float*, const float*, int64_t, float*) { fail("the NEON path is not compiled for this CPU"); }
void gelu_mul_row_neon(const float*, const float*, int64_t, float*) { fail("the NEON path is not compiled for this CPU"); }
void softmax_numerators_neon(float*, int64_t) { fail("the NEON path is not compiled for this CPU"); }
}  // namespace vsk

#endif
