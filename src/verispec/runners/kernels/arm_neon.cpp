// The ARM NEON path (AArch64 with the ARMv8.2 dot-product extension: Neoverse N1 and later,
// Cortex-A55/A76 and later, Apple M1 and later): the 16 columns of a tile in four 128-bit registers
// of 4 columns each, up to TILE_ROWS rows sharing each unpacked weight register; where the CPU also
// has the int8 matrix multiply (FEAT_I8MM: Neoverse V1/N2 and later, Apple M2 and later), pairs of
// rows go through smmla, twice the products per instruction.
//
// Integer sums, exact (core.h). Each 64-byte run of the tile layout (formats.cpp, above
// write_column) holds 4 consecutive values of each of the 16 columns, column c at bytes 4c..4c+3.
// The kernels unpack two such groups of 4 values at a time (a and b) into int8 weight registers and
// hand them to an accumulator: DotAcc, one sdot (vdotq_s32) per group, row and 4 columns, the row's
// 4 activation bytes broadcast to every lane; or MmlaAcc, one smmla (vmmlaq_s32) per 2 rows and 2
// columns: the 2 x 8 activations (rows r, r + 1: group a's then group b's 4 bytes) times the 8 x 2
// weights (columns c, c + 1: the two groups' 4 bytes side by side, one zip of the registers) into
// the 2 x 2 int32 sums. Both are signed x signed into int32 with no saturation, so every weight
// must be an int8: the 4-, 5- and 6-bit weights go in with their offset already taken off (Q4_0
// q - 8, Q5_0 q - 16, Q6_K q - 32; the integer sum(w (q - o) x) equals the portable path's
// sum(w q x) - o sum(w x) exactly, with no intermediate anywhere near 2^31), IQ4_NL nibbles become
// their signed levels by one table look-up, Q4_K's nibbles are 0..15, and Q8_0's activations
// (stored as q + 128, Activations::offset) get their sign bit flipped back to q, so sum(w q) is
// the portable path's dot - 128 * wsum. Float steps are the portable ones lane by lane: separate
// vmulq_f32 / vaddq_f32 / vsubq_f32 with the portable operand order (never vfmaq / vmlaq: a fused
// or contracted operation rounds once instead of twice; the build has -ffp-contract=off), and
// fp16 scales widened by vcvt_f32_f16, exact for every finite half (subnormals included).
//
// The path's float kernels (activation rows, attention, the IQ4_NL scale search) are
// arm_neon_float.cpp.

#include "core.h"

#if defined(__aarch64__)

#include <arm_neon.h>

#include <algorithm>
#include <cmath>

// The dot-product and matrix-multiply instructions are enabled per function (GCC's arm_neon.h
// declares vdotq_s32 for armv8.2-a+dotprod, vmmlaq_s32 for armv8.2-a+i8mm), so the file also builds
// when the compiler's default target is plain ARMv8.0; the dispatch runs them only where the CPU has
// them (tile_neon takes MmlaAcc only where neon_has_i8mm()). The kernel templates serve both
// accumulators, so they carry the union (VS_KERNEL); the DotAcc instances use no i8mm instruction.
#if defined(__clang__) ? (__clang_major__ >= 11) : (__GNUC__ >= 10)
#define VS_HAVE_I8MM 1
#endif
#if defined(__clang__)
#define VS_NEON __attribute__((target("dotprod")))
#define VS_I8MM __attribute__((target("dotprod,i8mm")))
#else
#define VS_NEON __attribute__((target("arch=armv8.2-a+dotprod")))
#define VS_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#endif
#if defined(VS_HAVE_I8MM)
#define VS_KERNEL VS_I8MM
#else
#define VS_KERNEL VS_NEON
#endif

namespace vsk {

namespace {

constexpr int QUARTERS = TILE / 4;      // 128-bit registers (4 int32 / float lanes) per tile row
constexpr int TILE_ROWS = 4;            // rows per register tile (a tile call of up to 8 is split)
constexpr int PREFETCH_BYTES = 4096;    // prefetch distance: how far ahead of the block being multiplied
// The loops over a block's groups of 4 values stay loops (#pragma GCC unroll 1): unrolled, GCC
// hoists the loads of later groups and runs out of the 32 vector registers inside the loop.

inline void prefetch_block(const uint8_t* next, int bytes) {
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(next + l);
}

// The 4 activation bytes at p in every 32-bit lane.
inline int8x16_t bcast4(const int8_t* p) { return vreinterpretq_s8_s32(vdupq_n_s32(load_i32(p))); }

// 4 fp16 scales (columns 4q .. 4q + 3) as floats: exact for every finite half.
inline float32x4_t halves(const uint8_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)p))); }

// 16 bytes of per-column scales, unsigned, as 4 int32 registers of 4 columns.
inline void widen_u8(const uint8_t* p, int32x4_t* out) {
    const uint8x16_t v = vld1q_u8(p);
    const uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_high_u8(v);
    out[0] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo)));
    out[1] = vreinterpretq_s32_u32(vmovl_high_u16(lo));
    out[2] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi)));
    out[3] = vreinterpretq_s32_u32(vmovl_high_u16(hi));
}

// The portable float step for one row and 16 columns, in the output row (the accumulator):
// out[c] = out[c] + (float)total[c] * (dx * d[c]).
inline void add_block(float* out, const int32x4_t* total, float32x4_t dx, const uint8_t* d16) {
    for (int q = 0; q < QUARTERS; ++q) {
        const float32x4_t pd = vmulq_f32(vcvtq_f32_s32(total[q]), vmulq_f32(dx, halves(d16 + 8 * q)));
        vst1q_f32(out + 4 * q, vaddq_f32(vld1q_f32(out + 4 * q), pd));
    }
}

// out[c] = out[c] - (float)mins[c] * (dx * dmin[c]) (Q4_K, after add_block).
inline void sub_block(float* out, const int32x4_t* mins, float32x4_t dx, const uint8_t* dmin16) {
    for (int q = 0; q < QUARTERS; ++q) {
        const float32x4_t pm = vmulq_f32(vcvtq_f32_s32(mins[q]), vmulq_f32(dx, halves(dmin16 + 8 * q)));
        vst1q_f32(out + 4 * q, vsubq_f32(vld1q_f32(out + 4 * q), pm));
    }
}

template <int R>
inline void zero_rows(const TileArgs& a) {
    for (int r = 0; r < R; ++r)
        for (int q = 0; q < QUARTERS; ++q) vst1q_f32(a.out + r * a.ldo + 4 * q, vdupq_n_f32(0.0f));
}

// Q4_K's mins term for the 16 columns: sum over the pairs p < `pairs` of m[p][c][0] * s[2p] +
// m[p][c][1] * s[2p + 1], m holding per pair (stride 32 bytes) each column's two u8 mins ([c][2])
// and s the row's 32-value sums; widening multiply-adds in int32, exact.
inline void pair_sums_u8(const uint8_t* m, int pairs, const int16_t* s, int32x4_t* out) {
    for (int q = 0; q < QUARTERS; ++q) {
        int32x4_t even = vdupq_n_s32(0), odd = vdupq_n_s32(0);  // columns 4q, 4q + 1 / 4q + 2, 4q + 3
        for (int p = 0; p < pairs; ++p) {
            const int16x8_t mq = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(m + 32 * p + 8 * q)));
            const int16x8_t sp = vreinterpretq_s16_s32(vdupq_n_s32(load_i32(s + 2 * p)));  // s[2p], s[2p+1], ...
            even = vmlal_s16(even, vget_low_s16(mq), vget_low_s16(sp));
            odd = vmlal_high_s16(odd, mq, sp);
        }
        out[q] = vpaddq_s32(even, odd);
    }
}

// ---------------------------------------------------------------------------------------------
// Accumulators: R rows x 16 columns of int32 sums. feed(wa, wb, x, stride, a, b) adds, for each row
// r and column c, sum over t < 4 of wa[c][t] * x_r[a + t] + wb[c][t] * x_r[b + t], where wa / wb
// hold the int8 weights of two groups (QUARTERS registers, column 4q + i at bytes 4i..4i+3 of
// register q) and x_r = x + r * stride the row's activations (FLIP: stored as q + 128, flipped back
// to q). sums(out) gives the totals per row, out[r][q] = columns 4q .. 4q + 3.

template <int R>
struct DotAcc {
    static constexpr int ROWS = R;
    int32x4_t acc[R][QUARTERS];

    VS_NEON inline void zero() {
        for (int r = 0; r < R; ++r)
            for (int q = 0; q < QUARTERS; ++q) acc[r][q] = vdupq_n_s32(0);
    }
    template <bool FLIP>
    VS_NEON inline void feed(const int8x16_t* wa, const int8x16_t* wb, const int8_t* x, int64_t stride, int a, int b) {
        for (int r = 0; r < R; ++r) {
            int8x16_t xa = bcast4(x + r * stride + a), xb = bcast4(x + r * stride + b);
            if (FLIP) {
                xa = veorq_s8(xa, vdupq_n_s8((int8_t)0x80));
                xb = veorq_s8(xb, vdupq_n_s8((int8_t)0x80));
            }
            for (int q = 0; q < QUARTERS; ++q) acc[r][q] = vdotq_s32(vdotq_s32(acc[r][q], wa[q], xa), wb[q], xb);
        }
    }
    VS_NEON inline void sums(int32x4_t (*out)[QUARTERS]) const {
        for (int r = 0; r < R; ++r)
            for (int q = 0; q < QUARTERS; ++q) out[r][q] = acc[r][q];
    }
};

#if defined(VS_HAVE_I8MM)
// acc[p][q][h]: rows 2p, 2p + 1 times columns 4q + 2h, 4q + 2h + 1, as smmla leaves them
// (r0c0, r0c1, r1c0, r1c1).
template <int R>
struct MmlaAcc {
    static_assert(R % 2 == 0, "smmla multiplies pairs of rows");
    static constexpr int ROWS = R;
    int32x4_t acc[R / 2][QUARTERS][2];

    VS_I8MM inline void zero() {
        for (int p = 0; p < R / 2; ++p)
            for (int q = 0; q < QUARTERS; ++q) acc[p][q][0] = acc[p][q][1] = vdupq_n_s32(0);
    }
    // rows r and r + 1: 8 bytes each, group a's 4 then group b's 4
    VS_I8MM static inline int8x16_t two_rows(const int8_t* x0, const int8_t* x1, int a, int b) {
        const uint64_t lo = (uint64_t)(uint32_t)load_i32(x0 + a) | (uint64_t)(uint32_t)load_i32(x0 + b) << 32;
        const uint64_t hi = (uint64_t)(uint32_t)load_i32(x1 + a) | (uint64_t)(uint32_t)load_i32(x1 + b) << 32;
        return vcombine_s8(vcreate_s8(lo), vcreate_s8(hi));
    }
    template <bool FLIP>
    VS_I8MM inline void feed(const int8x16_t* wa, const int8x16_t* wb, const int8_t* x, int64_t stride, int a, int b) {
        int8x16_t rows[R / 2];
        for (int p = 0; p < R / 2; ++p) {
            rows[p] = two_rows(x + 2 * p * stride, x + (2 * p + 1) * stride, a, b);
            if (FLIP) rows[p] = veorq_s8(rows[p], vdupq_n_s8((int8_t)0x80));
        }
        for (int q = 0; q < QUARTERS; ++q) {
            const int32x4_t sa = vreinterpretq_s32_s8(wa[q]), sb = vreinterpretq_s32_s8(wb[q]);
            const int8x16_t c01 = vreinterpretq_s8_s32(vzip1q_s32(sa, sb));  // columns 4q, 4q + 1: a's 4, b's 4
            const int8x16_t c23 = vreinterpretq_s8_s32(vzip2q_s32(sa, sb));  // columns 4q + 2, 4q + 3
            for (int p = 0; p < R / 2; ++p) {
                acc[p][q][0] = vmmlaq_s32(acc[p][q][0], rows[p], c01);
                acc[p][q][1] = vmmlaq_s32(acc[p][q][1], rows[p], c23);
            }
        }
    }
    VS_I8MM inline void sums(int32x4_t (*out)[QUARTERS]) const {
        for (int p = 0; p < R / 2; ++p)
            for (int q = 0; q < QUARTERS; ++q) {
                const int64x2_t h0 = vreinterpretq_s64_s32(acc[p][q][0]), h1 = vreinterpretq_s64_s32(acc[p][q][1]);
                out[2 * p][q] = vreinterpretq_s32_s64(vzip1q_s64(h0, h1));      // row 2p: columns 4q .. 4q + 3
                out[2 * p + 1][q] = vreinterpretq_s32_s64(vzip2q_s64(h0, h1));  // row 2p + 1
            }
    }
};
#endif

// ---------------------------------------------------------------------------------------------
// Kernels, one per format, for any accumulator (Acc::ROWS rows).

// Q4_K: per sub-block j (32 values: low nibbles for j = 2p, high for 2p + 1) the accumulator's
// sums, multiplied by the column's 6-bit scale and added to the block sums (kept in a small array:
// with 4 rows the 16 block sums and the 16 sub-block sums do not both fit the 32 registers); then
// the mins term from the rows' 32-value sums.
template <class Acc>
VS_KERNEL void tile_q4_k(const TileArgs& a) {
    constexpr int R = Acc::ROWS;
    constexpr int DMIN = 32, SCALES = 64, MINS = 192, QS = 320;  // byte offsets in a tile block
    const int bytes = block_traits(Q4_K).tile_bytes;
    const Activations& x = *a.act;
    const int64_t nb = x.in / 256;
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    zero_rows<R>(a);
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * bytes;
        prefetch_block(t + PREFETCH_BYTES, bytes);
        const int8_t* xb = x.q.data() + a.row0 * x.in + b * 256;
        alignas(16) int32_t isum[R][TILE] = {};
        for (int j = 0; j < 8; ++j) {
            const uint8_t* qp = t + QS + (j / 2) * 512;
            const int8x16_t nibble = vdupq_n_s8((int8_t)(-4 * (j & 1)));  // shift right by 0 (low) or 4 (high)
            Acc acc;
            acc.zero();
#pragma GCC unroll 1
            for (int g = 0; g < 8; g += 2) {
                int8x16_t wa[QUARTERS], wb[QUARTERS];
                for (int q = 0; q < QUARTERS; ++q) {
                    wa[q] = vreinterpretq_s8_u8(vandq_u8(vshlq_u8(vld1q_u8(qp + 64 * g + 16 * q), nibble), m4));
                    wb[q] = vreinterpretq_s8_u8(vandq_u8(vshlq_u8(vld1q_u8(qp + 64 * (g + 1) + 16 * q), nibble), m4));
                }
                acc.template feed<false>(wa, wb, xb, x.in, 32 * j + 4 * g, 32 * j + 4 * g + 4);
            }
            int32x4_t dot[R][QUARTERS], sc[QUARTERS];
            acc.sums(dot);
            widen_u8(t + SCALES + 16 * j, sc);
            for (int r = 0; r < R; ++r)
                for (int q = 0; q < QUARTERS; ++q)
                    vst1q_s32(isum[r] + 4 * q, vmlaq_s32(vld1q_s32(isum[r] + 4 * q), dot[r][q], sc[q]));
        }
        for (int r = 0; r < R; ++r) {
            const int64_t row = a.row0 + r;
            int32x4_t total[QUARTERS], mins[QUARTERS];
            for (int q = 0; q < QUARTERS; ++q) total[q] = vld1q_s32(isum[r] + 4 * q);
            pair_sums_u8(t + MINS, 4, x.s32.data() + row * (x.in / 32) + b * 8, mins);
            const float32x4_t dx = vdupq_n_f32(x.d[row * nb + b]);
            add_block(a.out + r * a.ldo, total, dx, t);
            sub_block(a.out + r * a.ldo, mins, dx, t + DMIN);
        }
    }
}

// Q6_K: per sub-block j = 2p + e (16 values: 4 groups) the accumulator's sums; the weight is
// (nibble | two high bits << 4) - 32, an int8 in -32..31; the block sum is sum_j scale_j * dot_j
// (int8 scales), which is the portable isum - 32 * ioff exactly.
template <class Acc>
VS_KERNEL void tile_q6_k(const TileArgs& a) {
    constexpr int R = Acc::ROWS;
    constexpr int SCALES = 32, PAIRS = 288, PAIR_BYTES = 384, HIGH = 256;  // byte offsets / strides
    const int bytes = block_traits(Q6_K).tile_bytes;
    const Activations& x = *a.act;
    const int64_t nb = x.in / 256;
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m30 = vdupq_n_u8(0x30);
    const int8x16_t k32 = vdupq_n_s8(32);
    zero_rows<R>(a);
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * bytes;
        prefetch_block(t + PREFETCH_BYTES, bytes);
        const int8_t* xb = x.q.data() + a.row0 * x.in + b * 256;
        alignas(16) int32_t isum[R][TILE] = {};
        for (int j = 0; j < 16; ++j) {
            const int p = j / 2, e = j & 1;
            const uint8_t* n = t + PAIRS + PAIR_BYTES * p;
            const int8x16_t nibble = vdupq_n_s8((int8_t)(-4 * e));  // shift right by 0 (low) or 4 (high)
            Acc acc;
            acc.zero();
#pragma GCC unroll 1
            for (int h = 0; h < 4; h += 2) {
                int8x16_t w[2][QUARTERS];
                for (int i = 0; i < 2; ++i) {
                    const int8x16_t up = vdupq_n_s8((int8_t)(4 - 2 * (h + i)));  // bits 2(h+i)..2(h+i)+1 -> 4..5
                    for (int q = 0; q < QUARTERS; ++q) {
                        const uint8x16_t lo = vandq_u8(vshlq_u8(vld1q_u8(n + 64 * (h + i) + 16 * q), nibble), m4);
                        const uint8x16_t hi = vandq_u8(vshlq_u8(vld1q_u8(n + HIGH + 64 * e + 16 * q), up), m30);
                        w[i][q] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, hi)), k32);
                    }
                }
                acc.template feed<false>(w[0], w[1], xb, x.in, 16 * j + 4 * h, 16 * j + 4 * h + 4);
            }
            int32x4_t dot[R][QUARTERS];
            acc.sums(dot);
            for (int q = 0; q < QUARTERS; ++q) {
                // the column's pair of int8 scales (2p, 2p + 1) as one int32: keep the low or high half
                const int32x4_t pairs = vreinterpretq_s32_s16(vmovl_s8(vld1_s8((const int8_t*)t + SCALES + 32 * p + 8 * q)));
                const int32x4_t sc = e ? vshrq_n_s32(pairs, 16) : vshrq_n_s32(vshlq_n_s32(pairs, 16), 16);
                for (int r = 0; r < R; ++r) vst1q_s32(isum[r] + 4 * q, vmlaq_s32(vld1q_s32(isum[r] + 4 * q), dot[r][q], sc));
            }
        }
        for (int r = 0; r < R; ++r) {
            int32x4_t total[QUARTERS];
            for (int q = 0; q < QUARTERS; ++q) total[q] = vld1q_s32(isum[r] + 4 * q);
            add_block(a.out + r * a.ldo, total, vdupq_n_f32(x.d[(a.row0 + r) * nb + b]), t);
        }
    }
}

// The 32-value nibble formats in one kernel: per group h the int8 weights of values 4h.. (group a,
// low nibbles) and 16 + 4h.. (group b, high nibbles): Q4_0 nibble - 8; IQ4_NL the nibble's level
// (table look-up); Q5_0 nibble | fifth bit << 4, - 16, which is the nibble with bits 4..7 set where
// the fifth bit is clear.
template <class Acc, int64_t QT>
VS_KERNEL void tile_nibbles(const TileArgs& a) {
    constexpr int R = Acc::ROWS;
    constexpr int NIBBLES = 32, HIGH = 288;  // byte offsets in a tile block
    const int bytes = block_traits(QT).tile_bytes;
    const Activations& x = *a.act;
    const int64_t nb = x.in / 32;
    const uint8x16_t m4 = vdupq_n_u8(0x0F), top = vdupq_n_u8(0xF0);
    const int8x16_t k8 = vdupq_n_s8(8), levels = vld1q_s8(IQ4_NL_VALUES);
    zero_rows<R>(a);
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * bytes;
        prefetch_block(t + PREFETCH_BYTES, bytes);
        Acc acc;
        acc.zero();
#pragma GCC unroll 1
        for (int h = 0; h < 4; ++h) {
            int8x16_t w0[QUARTERS], w1[QUARTERS];
            for (int q = 0; q < QUARTERS; ++q) {
                const uint8x16_t v = vld1q_u8(t + NIBBLES + 64 * h + 16 * q);
                const uint8x16_t lo = vandq_u8(v, m4), hi = vshrq_n_u8(v, 4);
                if constexpr (QT == Q4_0) {
                    w0[q] = vsubq_s8(vreinterpretq_s8_u8(lo), k8);
                    w1[q] = vsubq_s8(vreinterpretq_s8_u8(hi), k8);
                } else if constexpr (QT == IQ4_NL) {
                    w0[q] = vqtbl1q_s8(levels, lo);
                    w1[q] = vqtbl1q_s8(levels, hi);
                } else {  // Q5_0: bit h (value 4h + t) and bit h + 4 (value 16 + 4h + t) of the high bits
                    const uint8x16_t hb = vld1q_u8(t + HIGH + 16 * q);
                    const uint8x16_t set0 = vtstq_u8(hb, vdupq_n_u8((uint8_t)(1u << h)));
                    const uint8x16_t set1 = vtstq_u8(hb, vdupq_n_u8((uint8_t)(1u << (h + 4))));
                    w0[q] = vreinterpretq_s8_u8(vorrq_u8(lo, vbicq_u8(top, set0)));
                    w1[q] = vreinterpretq_s8_u8(vorrq_u8(hi, vbicq_u8(top, set1)));
                }
            }
            acc.template feed<false>(w0, w1, x.q.data() + a.row0 * x.in + b * 32, x.in, 4 * h, 16 + 4 * h);
        }
        int32x4_t dot[R][QUARTERS];
        acc.sums(dot);
        for (int r = 0; r < R; ++r) add_block(a.out + r * a.ldo, dot[r], vdupq_n_f32(x.d[(a.row0 + r) * nb + b]), t);
    }
}

// Q8_0: int8 weights times the activations with their sign bit flipped back (q + 128 -> q).
template <class Acc>
VS_KERNEL void tile_q8_0(const TileArgs& a) {
    constexpr int R = Acc::ROWS;
    constexpr int WEIGHTS = 32;  // byte offset in a tile block
    const int bytes = block_traits(Q8_0).tile_bytes;
    const Activations& x = *a.act;
    const int64_t nb = x.in / 32;
    zero_rows<R>(a);
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * bytes;
        prefetch_block(t + PREFETCH_BYTES, bytes);
        Acc acc;
        acc.zero();
#pragma GCC unroll 1
        for (int g = 0; g < 8; g += 2) {
            int8x16_t wa[QUARTERS], wb[QUARTERS];
            for (int q = 0; q < QUARTERS; ++q) {
                wa[q] = vld1q_s8((const int8_t*)t + WEIGHTS + 64 * g + 16 * q);
                wb[q] = vld1q_s8((const int8_t*)t + WEIGHTS + 64 * (g + 1) + 16 * q);
            }
            acc.template feed<true>(wa, wb, x.q.data() + a.row0 * x.in + b * 32, x.in, 4 * g, 4 * g + 4);
        }
        int32x4_t dot[R][QUARTERS];
        acc.sums(dot);
        for (int r = 0; r < R; ++r) add_block(a.out + r * a.ldo, dot[r], vdupq_n_f32(x.d[(a.row0 + r) * nb + b]), t);
    }
}

// The NEON tile kernels for one accumulator (Acc::ROWS rows), one row per block format (QTYPES order).
template <class Acc>
constexpr TileKernel TILES[] = {{Q4_K, tile_q4_k<Acc>},
                                {Q6_K, tile_q6_k<Acc>},
                                {Q4_0, tile_nibbles<Acc, Q4_0>},
                                {IQ4_NL, tile_nibbles<Acc, IQ4_NL>},
                                {Q5_0, tile_nibbles<Acc, Q5_0>},
                                {Q8_0, tile_q8_0<Acc>}};
static_assert(in_format_order(TILES<DotAcc<1>>), "the NEON tile kernels: one per format, in QTYPES order");

}  // namespace

// Rows in register tiles of at most TILE_ROWS; with i8mm, pairs of rows through smmla and a last
// odd row through sdot (8 = 4 + 4, 7 = 4 + 2 + 1, 3 = 2 + 1); without, 8 = 4 + 4, 7 = 4 + 3, ...
// Each row's result is independent of the split and of the accumulator (core.h).
// One table lookup per register tile of rows: the accumulator picks the table, the format its row.
void tile_neon(int format, const TileArgs& a) {
#if defined(VS_HAVE_I8MM)
    static const bool mmla = neon_has_i8mm();
#else
    constexpr bool mmla = false;
#endif
    for (int r0 = 0; r0 < a.rows;) {
        TileArgs part = a;
        part.row0 = a.row0 + r0;
        part.out = a.out + r0 * a.ldo;
        const int left = a.rows - r0;
        part.rows = mmla && left >= 2 ? (left >= TILE_ROWS ? TILE_ROWS : 2) : std::min(TILE_ROWS, left);
        if (mmla && part.rows % 2 == 0) {
#if defined(VS_HAVE_I8MM)
            if (part.rows == 4) TILES<MmlaAcc<4>>[format].run(part);
            else TILES<MmlaAcc<2>>[format].run(part);
#endif
        } else {
            switch (part.rows) {
                case 1: TILES<DotAcc<1>>[format].run(part); break;
                case 2: TILES<DotAcc<2>>[format].run(part); break;
                case 3: TILES<DotAcc<3>>[format].run(part); break;
                default: TILES<DotAcc<4>>[format].run(part); break;
            }
        }
        r0 += part.rows;
    }
}

}  // namespace vsk

#else  // not AArch64: the path is not compiled in (isa_supported says so; these are never called)

namespace vsk {
void tile_neon(int, const TileArgs&) { fail("the NEON path is not compiled for this CPU"); }
}  // namespace vsk

#endif
