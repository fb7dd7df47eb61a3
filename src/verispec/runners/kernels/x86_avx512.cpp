// The AVX-512 VNNI path: 16 columns in the lanes of a register, up to 8 rows share each unpacked
// weight register; vpdpbusd multiplies unsigned weight bytes by signed activation bytes into int32
// with no intermediate saturation, so every block sum is the portable path's integer exactly.
// Float steps are the portable ones lane by lane (core.h: the exactness argument).

#include "core.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace vsk {

#define VS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

namespace {

VS_AVX512 inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// acc += dpbusd(w (unsigned bytes), the 4 signed bytes at p broadcast to every lane), with the
// broadcast folded into the instruction ({1to16}): one instruction per product.
VS_AVX512 inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
    asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*(const int32_t*)p));
    return acc;
}

// Software prefetch, by the number of rows R (a template argument: no branch in the loops). One row
// (decoding, every draft-model token) prefetches nothing: the hardware's stream prefetcher keeps up
// with a pass that does so little per byte, and a burst of prefetches ahead only takes load slots
// and miss buffers from it. Several rows: the 256-value formats fetch the block PREFETCH_BLOCKS
// ahead into L2 (prefetcht1), the 32-value formats theirs into L1 as before. Measured on an AMD
// EPYC (Zen 4) host: docs/kernel-measurements.md.
constexpr int PREFETCH_BLOCKS = 2;     // the 256-value formats (Q4_K, Q6_K), into L2
constexpr int PREFETCH_BLOCKS_32 = 8;  // the 32-value nibble formats (Q4_0, IQ4_NL, Q5_0), into L1
constexpr int PREFETCH_BLOCKS_Q8 = 6;  // Q8_0, into L1

template <int R, int HINT>
VS_AVX512 inline void prefetch_block(const uint8_t* next, int bytes) {
    if constexpr (R > 1)
        for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char*)(next + l), (enum _mm_hint)HINT);
}

// Each kernel walks one sub-block at a time: R int32 accumulators (one per row) take the
// sub-block's dot products, are multiplied by the sub-block scale and added to R int32 sums
// (integer sums: their order is free); the R float accumulators stay in registers across the
// blocks and are stored once.
template <int R>
VS_AVX512 void tile_q4k(const TileArgs& a) {
    const Activations& x = *a.act;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t nb = x.in / 256;
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * 2368;
        prefetch_block<R, _MM_HINT_T1>(t + PREFETCH_BLOCKS * 2368, 2368);
        const int8_t* xb = x.q.data() + a.row0 * x.in + b * 256;
        __m512i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles)
            __m512i lo[R], hi[R];
            for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
            const uint8_t* qp = t + 320 + p * 512;
#pragma GCC unroll 8
            for (int g = 0; g < 8; ++g) {
                const __m512i v = _mm512_loadu_si512(qp + 64 * g);
                const __m512i wl = _mm512_and_si512(v, m4), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                for (int r = 0; r < R; ++r) {
                    const int8_t* xr = xb + r * x.in + 64 * p + 4 * g;
                    lo[r] = dpbusd_bcast(lo[r], wl, xr);
                    hi[r] = dpbusd_bcast(hi[r], wh, xr + 32);
                }
            }
            const __m512i sl = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(t + 64 + 32 * p)));
            const __m512i sh = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(t + 80 + 32 * p)));
            for (int r = 0; r < R; ++r)
                isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[r], sl), _mm512_mullo_epi32(hi[r], sh)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)t));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(t + 32)));
        const __m512i m01 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(t + 192)));
        const __m512i m23 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(t + 224)));
        const __m512i m45 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(t + 256)));
        const __m512i m67 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(t + 288)));
        for (int r = 0; r < R; ++r) {
            const int16_t* s32 = x.s32.data() + (a.row0 + r) * (x.in / 32) + b * 8;
            __m512i imin = _mm512_dpwssd_epi32(_mm512_setzero_si512(), m01, _mm512_set1_epi32(load_i32(s32)));
            imin = _mm512_dpwssd_epi32(imin, m23, _mm512_set1_epi32(load_i32(s32 + 2)));
            imin = _mm512_dpwssd_epi32(imin, m45, _mm512_set1_epi32(load_i32(s32 + 4)));
            imin = _mm512_dpwssd_epi32(imin, m67, _mm512_set1_epi32(load_i32(s32 + 6)));
            const __m512 dx = _mm512_set1_ps(x.d[(a.row0 + r) * nb + b]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dx, d)));
            acc[r] = _mm512_sub_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(dx, dmin)));
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + r * a.ldo, acc[r]);
}

template <int R>
VS_AVX512 void tile_q6k(const TileArgs& a) {
    const Activations& x = *a.act;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t nb = x.in / 256;
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * 3360;
        prefetch_block<R, _MM_HINT_T1>(t + PREFETCH_BLOCKS * 3360, 3360);
        const int8_t* xb = x.q.data() + a.row0 * x.in + b * 256;
        __m512i isum[R], ioff[R];
        for (int r = 0; r < R; ++r) isum[r] = ioff[r] = _mm512_setzero_si512();
        for (int p = 0; p < 8; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high) share their bytes
            const uint8_t* n = t + 288 + 384 * p;
            const __m512i hb0 = _mm512_loadu_si512(n + 256), hb1 = _mm512_loadu_si512(n + 320);
            __m512i dot0[R], dot1[R];
            for (int r = 0; r < R; ++r) dot0[r] = dot1[r] = _mm512_setzero_si512();
            for (int h = 0; h < 4; ++h) {
                const __m512i v = _mm512_loadu_si512(n + 64 * h);
                const __m512i lo0 = _mm512_and_si512(v, m4), lo1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                __m512i bits0, bits1;  // bits 2h..2h+1 moved to bits 4..5
                switch (h) {
                    case 0: bits0 = _mm512_slli_epi16(hb0, 4); bits1 = _mm512_slli_epi16(hb1, 4); break;
                    case 1: bits0 = _mm512_slli_epi16(hb0, 2); bits1 = _mm512_slli_epi16(hb1, 2); break;
                    case 2: bits0 = hb0; bits1 = hb1; break;
                    default: bits0 = _mm512_srli_epi16(hb0, 2); bits1 = _mm512_srli_epi16(hb1, 2); break;
                }
                const __m512i w0 = _mm512_ternarylogic_epi32(lo0, bits0, m30, 0xF8);  // lo | (bits & 0x30)
                const __m512i w1 = _mm512_ternarylogic_epi32(lo1, bits1, m30, 0xF8);
                for (int r = 0; r < R; ++r) {
                    const int8_t* xr = xb + r * x.in + 32 * p + 4 * h;
                    dot0[r] = dpbusd_bcast(dot0[r], w0, xr);
                    dot1[r] = dpbusd_bcast(dot1[r], w1, xr + 16);
                }
            }
            const __m512i pairs = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(t + 32 + 32 * p)));
            const __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16), sc1 = _mm512_srai_epi32(pairs, 16);
            for (int r = 0; r < R; ++r) {
                isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(dot0[r], sc0), _mm512_mullo_epi32(dot1[r], sc1)));
                const int16_t* s16 = x.s16.data() + (a.row0 + r) * (x.in / 16) + b * 16;
                ioff[r] = _mm512_dpwssd_epi32(ioff[r], pairs, _mm512_set1_epi32(load_i32(s16 + 2 * p)));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)t));
        for (int r = 0; r < R; ++r) {
            const __m512i total = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(ioff[r], 5));
            const __m512 dx = _mm512_set1_ps(x.d[(a.row0 + r) * nb + b]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dx, d)));
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + r * a.ldo, acc[r]);
}

// The 32-value nibble formats (Q4_0, IQ4_NL, Q5_0) in one kernel: per group h the unsigned
// weights of values 4h.. (w0) and 16 + 4h.. (w1), VNNI products with the signed activations,
// then OFFSET * (the activations' block sum) taken back: Q4_0 q - 8; Q5_0 (nibble | fifth bit)
// - 16; IQ4_NL the nibble picks its level + 128 (one byte shuffle per 64 bytes), - 128. Each is
// exactly the portable path's int32 sum.
template <int R, int64_t QT>
VS_AVX512 void tile_nibbles(const TileArgs& a) {
    constexpr int BYTES = QT == Q5_0 ? 352 : 288;
    constexpr int32_t OFFSET = QT == Q4_0 ? 8 : QT == Q5_0 ? 16 : 128;
    const Activations& x = *a.act;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    alignas(16) int8_t shifted[16];
    for (int i = 0; i < 16; ++i) shifted[i] = (int8_t)(uint8_t)(IQ4_NL_VALUES[i] + 128);
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)shifted));
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t nb = x.in / 32;
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * BYTES;
        prefetch_block<R, _MM_HINT_T0>(t + PREFETCH_BLOCKS_32 * BYTES, BYTES);
        const __m512i hb = QT == Q5_0 ? _mm512_loadu_si512(t + 288) : _mm512_setzero_si512();
        __m512i dot[R];
        for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
        for (int h = 0; h < 4; ++h) {
            const __m512i v = _mm512_loadu_si512(t + 32 + 64 * h);
            __m512i w0 = _mm512_and_si512(v, m4), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if constexpr (QT == IQ4_NL) {
                w0 = _mm512_shuffle_epi8(table, w0);
                w1 = _mm512_shuffle_epi8(table, w1);
            } else if constexpr (QT == Q5_0) {
                __m512i b0, b1;  // bit h (group h) and bit h + 4 (group h + 4) moved to bit 4
                switch (h) {
                    case 0: b0 = _mm512_slli_epi16(hb, 4); b1 = hb; break;
                    case 1: b0 = _mm512_slli_epi16(hb, 3); b1 = _mm512_srli_epi16(hb, 1); break;
                    case 2: b0 = _mm512_slli_epi16(hb, 2); b1 = _mm512_srli_epi16(hb, 2); break;
                    default: b0 = _mm512_slli_epi16(hb, 1); b1 = _mm512_srli_epi16(hb, 3); break;
                }
                w0 = _mm512_ternarylogic_epi32(w0, b0, m10, 0xF8);  // lo | (b0 & 0x10)
                w1 = _mm512_ternarylogic_epi32(w1, b1, m10, 0xF8);
            }
            for (int r = 0; r < R; ++r) {
                const int8_t* xr = x.q.data() + (a.row0 + r) * x.in + b * 32 + 4 * h;
                dot[r] = dpbusd_bcast(dot[r], w0, xr);
                dot[r] = dpbusd_bcast(dot[r], w1, xr + 16);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)t));
        for (int r = 0; r < R; ++r) {
            const int32_t s = x.s32[(a.row0 + r) * nb + b];
            const __m512i total = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(OFFSET * s));
            const __m512 dx = _mm512_set1_ps(x.d[(a.row0 + r) * nb + b]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dx, d)));
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + r * a.ldo, acc[r]);
}

template <int R>
VS_AVX512 void tile_q8_0(const TileArgs& a) {
    const Activations& x = *a.act;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t nb = x.in / 32;
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * 544;
        prefetch_block<R, _MM_HINT_T0>(t + PREFETCH_BLOCKS_Q8 * 544, 544);
        __m512i dot[R];
        __m512i wsum = _mm512_setzero_si512();
        for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
        for (int g = 0; g < 8; ++g) {
            const __m512i w = _mm512_loadu_si512(t + 32 + 64 * g);
            wsum = _mm512_dpbusd_epi32(wsum, ones, w);
            for (int r = 0; r < R; ++r) {
                const int8_t* xr = x.q.data() + (a.row0 + r) * x.in + b * 32 + 4 * g;
                dot[r] = _mm512_dpbusd_epi32(dot[r], bcast4(xr), w);  // activations are q + 128
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)t));
        const __m512i offset = _mm512_slli_epi32(wsum, 7);
        for (int r = 0; r < R; ++r) {
            const __m512i total = _mm512_sub_epi32(dot[r], offset);
            const __m512 dx = _mm512_set1_ps(x.d[(a.row0 + r) * nb + b]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dx, d)));
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + r * a.ldo, acc[r]);
}


// The AVX-512 tile kernels for R rows, one row per block format (QTYPES order).
template <int R>
constexpr TileKernel TILES[] = {{Q4_K, tile_q4k<R>},
                                {Q6_K, tile_q6k<R>},
                                {Q4_0, tile_nibbles<R, Q4_0>},
                                {IQ4_NL, tile_nibbles<R, IQ4_NL>},
                                {Q5_0, tile_nibbles<R, Q5_0>},
                                {Q8_0, tile_q8_0<R>}};
static_assert(in_format_order(TILES<1>), "the AVX-512 tile kernels: one per format, in QTYPES order");

// The nearest level as the number of midpoints between levels strictly below v (ties go low,
// NaN to 0: the same index as nearest_iq4_nl), 16 values per register.
VS_AVX512 inline __m512 nearest_levels(__m512 v) {
    __m512i index = _mm512_setzero_si512();
    const __m512i one = _mm512_set1_epi32(1);
    for (int k = 0; k < 15; ++k) {
        const __m512 mid = _mm512_set1_ps(0.5f * (float)(IQ4_NL_VALUES[k] + IQ4_NL_VALUES[k + 1]));
        index = _mm512_mask_add_epi32(index, _mm512_cmp_ps_mask(v, mid, _CMP_GT_OQ), index, one);
    }
    alignas(64) float levels[16];
    for (int l = 0; l < 16; ++l) levels[l] = (float)IQ4_NL_VALUES[l];
    return _mm512_permutexvar_ps(index, _mm512_load_ps(levels));
}

VS_AVX512 inline float fold16(__m512 a) {
    a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(3, 2, 3, 2)));  // lane l += lane l + 8
    a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(1, 1, 1, 1)));  // l += l + 4
    a = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));        // l += l + 2
    a = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));        // l += l + 1
    return _mm512_cvtss_f32(a);
}

// NQ queries (a0 ..) times 64 columns (c0 ..: four registers) of the values, the portable order per
// element (sum over the slots in order, from 0). Each value row's bytes are read once for the NQ
// queries of the KV head (before, 2 queries x 128 columns a pass read each row 3 times for 6
// queries); 4 x NQ <= 24 accumulators of the 32 registers.
template <int NQ, int NC>
VS_AVX512 void weighted_sum_tile(const float* p, int a0, const float* values, int64_t head_dim, const int64_t* slots,
                                 int64_t count, int64_t c0, float* out) {
    __m512 s[NQ][NC];
    for (int a = 0; a < NQ; ++a)
        for (int i = 0; i < NC; ++i) s[a][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
        const float* v = values + (slots ? slots[j] : j) * head_dim + c0;
        __m512 vi[NC];
        for (int i = 0; i < NC; ++i) vi[i] = _mm512_loadu_ps(v + 16 * i);
        for (int a = 0; a < NQ; ++a) {
            const __m512 pj = _mm512_set1_ps(p[(a0 + a) * count + j]);
            for (int i = 0; i < NC; ++i) s[a][i] = _mm512_add_ps(s[a][i], _mm512_mul_ps(pj, vi[i]));
        }
    }
    for (int a = 0; a < NQ; ++a)
        for (int i = 0; i < NC; ++i) _mm512_storeu_ps(out + (a0 + a) * head_dim + c0 + 16 * i, s[a][i]);
}

template <int NC>
void weighted_sum_columns(const float* p, int nq, const float* values, int64_t head_dim, const int64_t* slots,
                          int64_t count, int64_t c0, float* out) {
    constexpr int MAX_NQ = 6;  // the queries of a KV head at a time (Qwen2.5-1.5B: 6)
    for (int a0 = 0; a0 < nq; a0 += MAX_NQ)
        with_group_size(std::min(MAX_NQ, nq - a0), [&](auto n) {
            weighted_sum_tile<decltype(n)::value, NC>(p, a0, values, head_dim, slots, count, c0, out);
        });
}

}  // namespace

void weighted_sum_avx512(const float* p, int nq, const float* values, int64_t head_dim, const int64_t* slots,
                         int64_t count, float* out) {
    for (int64_t c0 = 0; c0 < head_dim; c0 += 4 * LANES) {  // head_dim is a multiple of 16 (check_attention)
        switch (std::min<int64_t>(4, (head_dim - c0) / LANES)) {
            case 1: weighted_sum_columns<1>(p, nq, values, head_dim, slots, count, c0, out); break;
            case 2: weighted_sum_columns<2>(p, nq, values, head_dim, slots, count, c0, out); break;
            case 3: weighted_sum_columns<3>(p, nq, values, head_dim, slots, count, c0, out); break;
            default: weighted_sum_columns<4>(p, nq, values, head_dim, slots, count, c0, out); break;
        }
    }
}

// One table lookup per call: the row count picks the table, the format its row.
void tile_avx512(int format, const TileArgs& a) {
    switch (a.rows) {
        case 1: TILES<1>[format].run(a); break;
        case 2: TILES<2>[format].run(a); break;
        case 3: TILES<3>[format].run(a); break;
        case 4: TILES<4>[format].run(a); break;
        case 5: TILES<5>[format].run(a); break;
        case 6: TILES<6>[format].run(a); break;
        case 7: TILES<7>[format].run(a); break;
        default: TILES<8>[format].run(a); break;
    }
}

// quantize_block_portable with 16 lanes: the same values bit for bit (max is exact and order-free; the
// product, the round-to-nearest-even and the clamps are the scalar operations lane by lane, with
// the scalar code's NaN behaviour: max(x, -127) keeps -127 for NaN as std::max(-127, x) does).
VS_AVX512 void quantize_block_avx512(const float* xb, int block_k, int8_t* qb, float* d_out) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < block_k; i += 16) amax = _mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(xb + i)), amax);
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 id = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int i = 0; i < block_k; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + i), id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm_storeu_si128((__m128i*)(qb + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
    }
    *d_out = d;
}

VS_AVX512 void fit_iq4_nl_avx512(const float* x, const float* w, float inv, float& sumqx, float& sumq2) {
    const __m512 xa = _mm512_loadu_ps(x), xb = _mm512_loadu_ps(x + 16);
    const __m512 wa = _mm512_loadu_ps(w), wb = _mm512_loadu_ps(w + 16), s = _mm512_set1_ps(inv);
    const __m512 qa = nearest_levels(_mm512_mul_ps(s, xa)), qb = nearest_levels(_mm512_mul_ps(s, xb));
    const __m512 wqa = _mm512_mul_ps(wa, qa), wqb = _mm512_mul_ps(wb, qb), zero = _mm512_setzero_ps();
    sumqx = fold16(_mm512_add_ps(_mm512_add_ps(zero, _mm512_mul_ps(wqa, xa)), _mm512_mul_ps(wqb, xb)));
    sumq2 = fold16(_mm512_add_ps(_mm512_add_ps(zero, _mm512_mul_ps(wqa, qa)), _mm512_mul_ps(wqb, qb)));
}

// One block of 32 values -> IQ4_NL, the search of llama.cpp's IQ4_NL quantizer without an
// importance matrix (ggml-quants.c): weights w = x^2; for the scale m / 127 and the 15 scales
// m / (t - 127), t in -7..7 (m, the first value of largest magnitude, near the level -127), pick
// levels nearest to x / scale and keep the least-squares scale sum(w q x) / sum(w q^2) with the
// largest sum(w q x)^2 / sum(w q^2) (float sums in fit_iq4_nl's order); the levels are then chosen

// scores_portable for 16 keys at a time: each key's 16 partial lanes as above (one register),
// then the 16 registers reduced together by shuffles that add, for every key, exactly the pairs
// of the scalar tree (l + 8, then l + 4, l + 2, l + 1; lower partial first), so the bits are the
// portable path's. A last short group repeats its first key in the unused lanes.
VS_AVX512 void scores_avx512(const float* q, int nq, const float* keys, int64_t head_dim, const int64_t* slots,
                             int64_t count, float scale, float* scores) {
    // the reduction leaves key t's sum in lane 4 (t % 4) + t / 4; this puts it back in lane t
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < count; j0 += 16) {
        const int n = (int)std::min<int64_t>(16, count - j0);
        const float* k[16];
        for (int t = 0; t < 16; ++t) k[t] = keys + (slots ? slots[j0 + (t < n ? t : 0)] : j0 + (t < n ? t : 0)) * head_dim;
        for (int a = 0; a < nq; ++a) {
            const float* qa = q + a * head_dim;
            __m512 v[16];
            for (int t = 0; t < 16; ++t) v[t] = _mm512_setzero_ps();
            for (int64_t c = 0; c < head_dim; c += LANES) {
                const __m512 qc = _mm512_loadu_ps(qa + c);
                for (int t = 0; t < 16; ++t) v[t] = _mm512_add_ps(v[t], _mm512_mul_ps(qc, _mm512_loadu_ps(k[t] + c)));
            }
            __m512 w[8], x[4], y[2];
            for (int i = 0; i < 8; ++i)  // l + 8: low 256 bits plus high 256 bits, two keys per register
                w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
            for (int i = 0; i < 4; ++i)  // l + 4: quarters 0 + 1 of each key
                x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
            for (int i = 0; i < 2; ++i)  // l + 2 within each quarter
                y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
            const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));  // l + 1
            const __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(order, z), vscale);
            _mm512_mask_storeu_ps(scores + a * count + j0, (__mmask16)((1u << n) - 1), s);
        }
    }
}


}  // namespace vsk

#else  // not x86-64: the path is not compiled in (isa_supported says so; these are never called)

namespace vsk {
void tile_avx512(int, const TileArgs&) { fail("the AVX-512 path is not compiled for this CPU"); }
void quantize_block_avx512(const float*, int, int8_t*, float*) { fail("the AVX-512 path is not compiled for this CPU"); }
void fit_iq4_nl_avx512(const float*, const float*, float, float&, float&) { fail("the AVX-512 path is not compiled for this CPU"); }
void scores_avx512(const float*, int, const float*, int64_t, const int64_t*, int64_t, float, float*) {
    fail("the AVX-512 path is not compiled for this CPU");
}
void weighted_sum_avx512(const float*, int, const float*, int64_t, const int64_t*, int64_t, float*) {
    fail("the AVX-512 path is not compiled for this CPU");
}
}  // namespace vsk

#endif
