// The portable path: the reference arithmetic every other ISA must equal bit for bit (the oracle
// of the tests), one (row, column) at a time from the tile layout. One short function per block
// type gives a column's exact integer block sum; one loop adds them in block order in float.

#include <algorithm>
#include <cmath>

#include "core.h"

namespace vsk {

void quantize_block_portable(const float* xb, int block_k, int8_t* qb, float* d_out) {
    float amax = 0.0f;
    for (int i = 0; i < block_k; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < block_k; ++i) {
        float v = std::nearbyint(xb[i] * id);
        v = std::min(127.0f, std::max(-127.0f, v));
        qb[i] = (int8_t)v;
    }
    *d_out = d;
}

namespace {

// Integer sums of one block of column c. t: the tile block; x: the row's int8 activations of the
// block; s16 / s32: the row's sums of 16 / 32 activations for this block. Each returns the integer
// to multiply by (x scale * weight scale); Q4_K also the mins sum (times x scale * dmin).

int32_t block_q4_k(const uint8_t* t, int c, const int8_t* x, const int16_t* s32, int32_t& mins) {
    int32_t isum = 0, imin = 0;
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles)
        int32_t lo = 0, hi = 0;
        for (int g = 0; g < 8; ++g)
            for (int u = 0; u < 4; ++u) {
                const uint8_t v = t[320 + (p * 8 + g) * 64 + 4 * c + u];
                lo += (v & 0xF) * x[64 * p + 4 * g + u];
                hi += (v >> 4) * x[64 * p + 32 + 4 * g + u];
            }
        isum += lo * t[64 + 16 * (2 * p) + c] + hi * t[64 + 16 * (2 * p + 1) + c];
        imin += t[192 + 32 * p + 2 * c] * s32[2 * p] + t[192 + 32 * p + 2 * c + 1] * s32[2 * p + 1];
    }
    mins = imin;
    return isum;
}

int32_t block_q6_k(const uint8_t* t, int c, const int8_t* x, const int16_t* s16) {
    int32_t isum = 0, ioff = 0;
    for (int p = 0; p < 8; ++p) {
        const uint8_t* n = t + 288 + 384 * p;
        int32_t lo = 0, hi = 0;
        for (int h = 0; h < 4; ++h)
            for (int u = 0; u < 4; ++u) {
                const uint8_t nib = n[64 * h + 4 * c + u];
                const int q0 = (nib & 0xF) | (((n[256 + 4 * c + u] >> (2 * h)) & 3) << 4);
                const int q1 = (nib >> 4) | (((n[256 + 64 + 4 * c + u] >> (2 * h)) & 3) << 4);
                lo += q0 * x[32 * p + 4 * h + u];
                hi += q1 * x[32 * p + 16 + 4 * h + u];
            }
        const int s0 = (int8_t)t[32 + 32 * p + 2 * c], s1 = (int8_t)t[32 + 32 * p + 2 * c + 1];
        isum += lo * s0 + hi * s1;
        ioff += s0 * s16[2 * p] + s1 * s16[2 * p + 1];
    }
    return isum - ioff * 32;  // the weights are q - 32
}

// Q4_0: q - 8; IQ4_NL: the nibble's level.
template <int64_t QT>
int32_t block_nibbles(const uint8_t* t, int c, const int8_t* x, int32_t s32) {
    int32_t dot = 0;
    auto level = [](int n) { return QT == IQ4_NL ? (int)IQ4_NL_VALUES[n] : n; };
    for (int h = 0; h < 4; ++h)
        for (int u = 0; u < 4; ++u) {
            const uint8_t nib = t[32 + 64 * h + 4 * c + u];
            dot += level(nib & 0xF) * x[4 * h + u] + level(nib >> 4) * x[16 + 4 * h + u];
        }
    return dot - (QT == Q4_0 ? 8 * s32 : 0);
}

int32_t block_q5_0(const uint8_t* t, int c, const int8_t* x, int32_t s32) {
    int32_t dot = 0;
    for (int h = 0; h < 4; ++h)
        for (int u = 0; u < 4; ++u) {
            const uint8_t nib = t[32 + 64 * h + 4 * c + u], bits = t[288 + 4 * c + u];
            const int q0 = (nib & 0xF) | (((bits >> h) & 1) << 4);
            const int q1 = (nib >> 4) | (((bits >> (h + 4)) & 1) << 4);
            dot += q0 * x[4 * h + u] + q1 * x[16 + 4 * h + u];
        }
    return dot - 16 * s32;  // the weights are q - 16
}

int32_t block_q8_0(const uint8_t* t, int c, const int8_t* x) {
    int32_t dot = 0, wsum = 0;
    for (int g = 0; g < 8; ++g)
        for (int u = 0; u < 4; ++u) {
            const int w = (int8_t)t[32 + 64 * g + 4 * c + u];
            dot += (int)(uint8_t)x[4 * g + u] * w;  // activations stored as q + 128
            wsum += w;
        }
    return dot - 128 * wsum;
}

// The block sum of each format in one signature (s16, s32: the row's sums for the block; mins:
// Q4_K's mins sum), so that tile_type<QT> inlines its own.
template <int64_t QT>
int32_t block_sum(const uint8_t* t, int c, const int8_t* x, const int16_t* s16, const int16_t* s32, int32_t& mins);
template <>
int32_t block_sum<Q4_K>(const uint8_t* t, int c, const int8_t* x, const int16_t*, const int16_t* s32, int32_t& mins) {
    return block_q4_k(t, c, x, s32, mins);
}
template <>
int32_t block_sum<Q6_K>(const uint8_t* t, int c, const int8_t* x, const int16_t* s16, const int16_t*, int32_t&) {
    return block_q6_k(t, c, x, s16);
}
template <>
int32_t block_sum<Q4_0>(const uint8_t* t, int c, const int8_t* x, const int16_t*, const int16_t* s32, int32_t&) {
    return block_nibbles<Q4_0>(t, c, x, *s32);
}
template <>
int32_t block_sum<IQ4_NL>(const uint8_t* t, int c, const int8_t* x, const int16_t*, const int16_t* s32, int32_t&) {
    return block_nibbles<IQ4_NL>(t, c, x, *s32);
}
template <>
int32_t block_sum<Q5_0>(const uint8_t* t, int c, const int8_t* x, const int16_t*, const int16_t* s32, int32_t&) {
    return block_q5_0(t, c, x, *s32);
}
template <>
int32_t block_sum<Q8_0>(const uint8_t* t, int c, const int8_t* x, const int16_t*, const int16_t*, int32_t&) {
    return block_q8_0(t, c, x);
}

// The float part, the same for every type: acc + total * (dx * d), then (Q4_K) - mins * (dx * dmin).
template <int64_t QT>
void tile_type(const TileArgs& a) {
    const BlockTraits& f = block_traits(QT);
    const Activations& x = *a.act;
    const int64_t nb = x.in / f.block_k;
    for (int r = 0; r < a.rows; ++r) {
        const int64_t row = a.row0 + r;
        const int8_t* xq = x.q.data() + row * x.in;
        for (int c = 0; c < TILE; ++c) {
            float acc = 0.0f;
            for (int64_t b = 0; b < a.nblocks; ++b) {
                const uint8_t* t = a.tile + b * f.tile_bytes;
                const int8_t* xb = xq + b * f.block_k;
                const int16_t* s16 = x.s16.data() + row * (x.in / 16) + b * (f.block_k / 16);
                const int16_t* s32 = x.s32.data() + row * (x.in / 32) + b * (f.block_k / 32);
                int32_t mins = 0;
                const int32_t total = block_sum<QT>(t, c, xb, s16, s32, mins);
                const float dx = x.d[row * nb + b];
                const float pd = (float)total * (dx * half_to_float(load_u16(t + 2 * c)));
                acc = acc + pd;
                if constexpr (QT == Q4_K) {
                    const float pm = (float)mins * (dx * half_to_float(load_u16(t + 32 + 2 * c)));
                    acc = acc - pm;
                }
            }
            a.out[r * a.ldo + c] = acc;
        }
    }
}

// The portable tile kernels, one row per block format (QTYPES order).
constexpr TileKernel TILES[] = {{Q4_K, tile_type<Q4_K>}, {Q6_K, tile_type<Q6_K>}, {Q4_0, tile_type<Q4_0>},
                                {IQ4_NL, tile_type<IQ4_NL>}, {Q5_0, tile_type<Q5_0>}, {Q8_0, tile_type<Q8_0>}};
static_assert(in_format_order(TILES), "the portable tile kernels: one per format, in QTYPES order");

}  // namespace

void tile_portable(int format, const TileArgs& a) { TILES[format].run(a); }

// scores[a][j] = (q_a . k_j) * scale: 16 partial lanes (lanes[l] += q[c + l] * k[c + l] over the
// chunks c in order, from 0), reduced by the tree l + 8, l + 4, l + 2, l + 1, then one multiply.
void scores_portable(const float* q, int nq, const float* keys, int64_t head_dim, const int64_t* slots, int64_t count,
                     float scale, float* scores) {
    for (int64_t j = 0; j < count; ++j) {
        const float* k = keys + (slots ? slots[j] : j) * head_dim;
        for (int a = 0; a < nq; ++a) {
            const float* qa = q + a * head_dim;
            float lanes[LANES] = {0};
            for (int64_t c = 0; c < head_dim; c += LANES)
                for (int l = 0; l < LANES; ++l) lanes[l] = lanes[l] + qa[c + l] * k[c + l];
            for (int width = LANES / 2; width >= 1; width /= 2)
                for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
            scores[a * count + j] = lanes[0] * scale;
        }
    }
}

// out[a][c] = sum over the slots j in order of p[a][j] * v_j[c], from 0 (one multiply, one add per term).
void weighted_sum_portable(const float* p, int nq, const float* values, int64_t head_dim, const int64_t* slots,
                           int64_t count, float* out) {
    for (int64_t i = 0; i < nq * head_dim; ++i) out[i] = 0.0f;
    for (int64_t j = 0; j < count; ++j) {
        const float* v = values + (slots ? slots[j] : j) * head_dim;
        for (int a = 0; a < nq; ++a) {
            const float pj = p[a * count + j];
            float* oa = out + a * head_dim;
            for (int64_t c = 0; c < head_dim; ++c) oa[c] = oa[c] + pj * v[c];
        }
    }
}

// sum(a[i] * b[i]) over 32 values in the order every IQ4_NL fit uses: lane l = (0 + a_l b_l) +
// a_(l+16) b_(l+16), then lanes folded l += l + 8, l + 4, l + 2, l + 1 (lane 0 is the sum).
static float fold16(float* lane) {
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) lane[l] = lane[l] + lane[l + width];
    return lane[0];
}

void fit_iq4_nl_portable(const float* x, const float* w, float inv, float& sumqx, float& sumq2) {
    float qx[16], q2[16];
    for (int l = 0; l < 16; ++l) {
        const float qa = IQ4_NL_VALUES[nearest_iq4_nl(inv * x[l])], qb = IQ4_NL_VALUES[nearest_iq4_nl(inv * x[l + 16])];
        const float wqa = w[l] * qa, wqb = w[l + 16] * qb;
        qx[l] = (0.0f + wqa * x[l]) + wqb * x[l + 16];
        q2[l] = (0.0f + wqa * qa) + wqb * qb;
    }
    sumqx = fold16(qx);
    sumq2 = fold16(q2);
}

}  // namespace vsk
