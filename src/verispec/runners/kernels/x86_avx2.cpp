// The AVX2 path (Haswell and later, AMD Zen 1-3; with AVX-VNNI on Alder Lake and later): each half
// of a tile (8 columns) in the lanes of a 256-bit register, up to ROWS rows sharing each unpacked weight
// register. The tile layout is the AVX-512 one: each 64-byte run holds 4 values of 16 columns, so
// columns 8h .. 8h + 7 are the run's bytes 32h .. 32h + 31.
//
// Integer sums, exact (core.h). With AVX-VNNI, vpdpbusd adds 4 u8 x s8 products per column into
// int32 with no saturation. Without it, vpmaddubsw adds pairs of u8 x s8 products into int16 with
// saturation at +-32767, so every use keeps |unsigned weight| <= 128 and |activation| <= 127 (a
// pair is at most 2 * 128 * 127 = 32512): the 4- and 5- and 6-bit weights are small unsigned
// integers already; IQ4_NL levels and Q8_0 weights are signed, so they go in as |w| with the
// activation's sign flipped where w < 0 (vpsignb; llama.cpp's trick). Where pair sums of several
// groups are added in int16 before vpmaddwd widens them, the count is bounded so that they cannot
// pass 32767 either (named below, per format). Float steps are the portable ones lane by lane.

#include "core.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace vsk {

#define VS_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace {

constexpr int ROWS = 4;             // rows per register tile, at most
constexpr int HALF = 8;             // columns per register
// One pass over a tile takes both halves (16 columns: two registers per row), so each broadcast
// group of activations feeds two products and the unpacked weights serve every row. Q6_K's one row
// keeps a pass per half: the first fetches the tile's blocks PREFETCH_BLOCKS ahead, the second
// reads the tile from cache and meanwhile fetches the next tile's blocks, so the memory is busy
// during both. A call's rows go in groups of at most ROWS, as even as can be (5 rows as 3 + 2).
// Why each choice, with its measurements: docs/kernel-measurements.md.
constexpr int PREFETCH_BLOCKS = 2;     // prefetch distance of the 256-value formats, in blocks of the tile
constexpr int PREFETCH_BLOCKS_32 = 8;  // of the 32-value formats

VS_AVX2 inline void prefetch_block(const uint8_t* next, int bytes) {
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char*)(next + l), _MM_HINT_T0);
}

VS_AVX2 inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }

// acc += per column (4 bytes per 32-bit lane) the sum of 4 products u (unsigned) x s (signed).
// VNNI: one vpdpbusd (VEX-encoded; inline assembly so this function needs no avxvnni target and
// the dispatch alone decides whether it runs). Else vpmaddubsw + vpmaddwd (|u| <= 128, |s| <= 127).
//
// VSK_EMULATE_AVXVNNI (the kernel harness's `native-vnni` build only, never the extension): the
// same int32 sums from AVX2 instructions (bytes widened to int16, pairs by vpmaddwd, then the two
// pairs of each column added: exact, no saturation), so hosts without AVX-VNNI test its code path.
template <bool VNNI>
VS_AVX2 inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
    if constexpr (VNNI) {
#ifdef VSK_EMULATE_AVXVNNI
        const __m256i zero = _mm256_setzero_si256();
        const __m256i lo = _mm256_madd_epi16(_mm256_unpacklo_epi8(u, zero), _mm256_srai_epi16(_mm256_unpacklo_epi8(s, s), 8));
        const __m256i hi = _mm256_madd_epi16(_mm256_unpackhi_epi8(u, zero), _mm256_srai_epi16(_mm256_unpackhi_epi8(s, s), 8));
        return _mm256_add_epi32(acc, _mm256_hadd_epi32(lo, hi));
#else
        asm("%{vex%} vpdpbusd %[s], %[u], %[acc]" : [acc] "+x"(acc) : [u] "x"(u), [s] "x"(s));
        return acc;
#endif
    } else {
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
    }
}

// 8 fp16 scales of columns 8h .. 8h + 7 at p (2 bytes each) as floats.
VS_AVX2 inline __m256 halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// 8 unsigned bytes (one per column) -> int32 lanes; duplicated: the same in both int16 halves.
VS_AVX2 inline __m256i widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
VS_AVX2 inline __m256i duplicated_u8(const uint8_t* p) {
    const __m256i v = widen_u8(p);
    return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

// acc = acc + (float)total * (dx * d), the portable step.
VS_AVX2 inline __m256 scaled_add(__m256 acc, __m256i total, float dx, __m256 d) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(_mm256_set1_ps(dx), d)));
}

// Q4_K: per sub-block pair p, low nibbles are sub-block 2p, high nibbles 2p + 1 (4-bit unsigned
// weights). Without VNNI a sub-block's 8 groups add in int16: 8 * 2 * 15 * 127 = 30480 <= 32767,
// and vpmaddwd by the duplicated 6-bit scale gives (pair sum) * scale in int32.
//
// One sub-block of both halves: dot[i][r] = per column of half i the int16 (VNNI: int32) sums of
// its 32 products with row r; each broadcast of activations feeds both halves. HIGH (a template
// argument: the loop has no branch) picks the high nibbles; the group loop is unrolled twice, so
// the int16 sums stay in registers (docs/kernel-measurements.md).
template <int R, bool VNNI, bool HIGH>
VS_AVX2 inline void q4k_sub(const uint8_t* qp, const int8_t* xj, int64_t stride, __m256i (&dot)[2][R]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 2; ++i)
        for (int r = 0; r < R; ++r) dot[i][r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int g = 0; g < 8; ++g) {
        __m256i xr[R];
        for (int r = 0; r < R; ++r) xr[r] = bcast4(xj + r * stride + 4 * g);
        for (int i = 0; i < 2; ++i) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(qp + 32 * i + 64 * g));
            const __m256i w = HIGH ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
            for (int r = 0; r < R; ++r) {
                if constexpr (VNNI) dot[i][r] = dot4<true>(dot[i][r], w, xr[r]);
                else dot[i][r] = _mm256_add_epi16(dot[i][r], _mm256_maddubs_epi16(w, xr[r]));
            }
        }
    }
}

template <int R, bool VNNI>
VS_AVX2 void tile_q4k(const TileArgs& a) {
    constexpr int H = 2;  // both halves of the tile in one pass
    constexpr int BYTES = 2368;
    const Activations& x = *a.act;
    const int64_t nb = x.in / 256;
    float* out = a.out;  // the float accumulators live in the output rows
    for (int i = 0; i < H; ++i)
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * a.ldo + HALF * i, _mm256_setzero_ps());
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * BYTES;
        prefetch_block(t + PREFETCH_BLOCKS * BYTES, BYTES);  // one pass: fetch ahead
        const int8_t* xb = x.q.data() + a.row0 * x.in + b * 256;
        __m256i isum[H][R];
        for (int i = 0; i < H; ++i)
            for (int r = 0; r < R; ++r) isum[i][r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high)
            const uint8_t* qp = t + 320 + p * 512;
            for (int e = 0; e < 2; ++e) {
                const int j = 2 * p + e;
                __m256i dot[2][R];
                if (e) q4k_sub<R, VNNI, true>(qp, xb + 32 * j, x.in, dot);
                else q4k_sub<R, VNNI, false>(qp, xb + 32 * j, x.in, dot);
                for (int i = 0; i < H; ++i) {
                    const uint8_t* sc = t + 64 + 16 * j + HALF * i;  // the sub-block's scale per column
                    if constexpr (VNNI) {
                        const __m256i scale = widen_u8(sc);
                        for (int r = 0; r < R; ++r) isum[i][r] = _mm256_add_epi32(isum[i][r], _mm256_mullo_epi32(dot[i][r], scale));
                    } else {
                        const __m256i scale = duplicated_u8(sc);
                        for (int r = 0; r < R; ++r) isum[i][r] = _mm256_add_epi32(isum[i][r], _mm256_madd_epi16(dot[i][r], scale));
                    }
                }
            }
        }
        for (int i = 0; i < H; ++i) {
            const __m256 d = halves(t + 16 * i), dmin = halves(t + 32 + 16 * i);
            __m256i mins[4];  // per p: (min of 2p, min of 2p + 1) per column, int16 pairs
            for (int p = 0; p < 4; ++p) mins[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(t + 192 + 32 * p + 16 * i)));
            for (int r = 0; r < R; ++r) {
                const int16_t* s32 = x.s32.data() + (a.row0 + r) * (x.in / 32) + b * 8;
                __m256i imin = _mm256_setzero_si256();
                for (int p = 0; p < 4; ++p) imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(load_i32(s32 + 2 * p))));
                const float dx = x.d[(a.row0 + r) * nb + b];
                float* o = out + r * a.ldo + HALF * i;
                __m256 acc = scaled_add(_mm256_loadu_ps(o), isum[i][r], dx, d);
                acc = _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(_mm256_set1_ps(dx), dmin)));
                _mm256_storeu_ps(o, acc);
            }
        }
    }
}

// Q6_K: 16 sub-blocks of 16 values, weights q in 0..63 (the value is q - 32, taken back with the
// activations' 16-sums). Without VNNI two groups add in int16: 2 * 2 * 63 * 127 = 32004 <= 32767.
// The float accumulators live in the output rows (as in tile_32).
template <int R, bool VNNI, int H>
VS_AVX2 void tile_q6k(const TileArgs& a, int h0) {
    constexpr int BYTES = 3360;
    const Activations& x = *a.act;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const int64_t nb = x.in / 256;
    float* out = a.out + HALF * h0;  // the float accumulators live in the output rows
    for (int i = 0; i < H; ++i)
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * a.ldo + HALF * i, _mm256_setzero_ps());
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * BYTES;
        if (h0 == 0) prefetch_block(t + PREFETCH_BLOCKS * BYTES, BYTES);
        else prefetch_block(t + a.nblocks * BYTES, BYTES);  // the next tile, while this half reads from cache
        const int8_t* xb = x.q.data() + a.row0 * x.in + b * 256;
        __m256i isum[H][R];
        for (int i = 0; i < H; ++i)
            for (int r = 0; r < R; ++r) isum[i][r] = _mm256_setzero_si256();
        for (int j = 0; j < 16; ++j) {
            const int p = j / 2, e = j & 1;
            __m256i hb[H], sc[H];
            for (int i = 0; i < H; ++i) {
                const int h = h0 + i;
                hb[i] = _mm256_loadu_si256((const __m256i*)(t + 288 + 384 * p + 32 * h + 256 + 64 * e));
                // int16 pairs (scale of sub-block 2p, of 2p + 1) per column
                const __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(t + 32 + 32 * p + 16 * h)));
                // VNNI: the sub-block's scale per column (int32); else in both int16 lanes of each column
                sc[i] = VNNI ? (e ? _mm256_srai_epi32(pairs, 16) : _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16))
                             : (e ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xF5), 0xF5)
                                  : _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xA0), 0xA0));
            }
            __m256i dot[H][R];
            for (int i = 0; i < H; ++i)
                for (int r = 0; r < R; ++r) dot[i][r] = _mm256_setzero_si256();
            for (int g = 0; g < 4; ++g) {
                __m256i xr[R];
                for (int r = 0; r < R; ++r) xr[r] = bcast4(xb + r * x.in + 16 * j + 4 * g);
                for (int i = 0; i < H; ++i) {
                    const uint8_t* n = t + 288 + 384 * p + 32 * (h0 + i);
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(n + 64 * g));
                    const __m256i lo = e ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
                    __m256i bits;  // bits 2g..2g+1 moved to bits 4..5
                    switch (g) {
                        case 0: bits = _mm256_slli_epi16(hb[i], 4); break;
                        case 1: bits = _mm256_slli_epi16(hb[i], 2); break;
                        case 2: bits = hb[i]; break;
                        default: bits = _mm256_srli_epi16(hb[i], 2); break;
                    }
                    const __m256i w = _mm256_or_si256(lo, _mm256_and_si256(bits, m30));
                    for (int r = 0; r < R; ++r) {
                        if constexpr (VNNI) dot[i][r] = dot4<true>(dot[i][r], w, xr[r]);
                        else dot[i][r] = _mm256_add_epi16(dot[i][r], _mm256_maddubs_epi16(w, xr[r]));
                    }
                }
                if (!VNNI && (g & 1))  // two groups per int16 sum (bound above), then times the scale
                    for (int i = 0; i < H; ++i)
                        for (int r = 0; r < R; ++r) {
                            isum[i][r] = _mm256_add_epi32(isum[i][r], _mm256_madd_epi16(dot[i][r], sc[i]));
                            dot[i][r] = _mm256_setzero_si256();
                        }
            }
            if constexpr (VNNI)
                for (int i = 0; i < H; ++i)
                    for (int r = 0; r < R; ++r) isum[i][r] = _mm256_add_epi32(isum[i][r], _mm256_mullo_epi32(dot[i][r], sc[i]));
        }
        for (int i = 0; i < H; ++i) {
            const int h = h0 + i;
            const __m256 d = halves(t + 16 * h);
            for (int r = 0; r < R; ++r) {
                const int16_t* s16 = x.s16.data() + (a.row0 + r) * (x.in / 16) + b * 16;
                __m256i ioff = _mm256_setzero_si256();
                for (int p = 0; p < 8; ++p) {
                    const __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(t + 32 + 32 * p + 16 * h)));
                    ioff = _mm256_add_epi32(ioff, _mm256_madd_epi16(pairs, _mm256_set1_epi32(load_i32(s16 + 2 * p))));
                }
                const __m256i total = _mm256_sub_epi32(isum[i][r], _mm256_slli_epi32(ioff, 5));
                float* o = out + r * a.ldo + HALF * i;
                _mm256_storeu_ps(o, scaled_add(_mm256_loadu_ps(o), total, x.d[(a.row0 + r) * nb + b], d));
            }
        }
    }
}

// The 32-value formats. Q4_0 (q - 8) and Q5_0 ((nibble | fifth bit) - 16): unsigned weights, the
// offset taken back with the activations' block sum; without VNNI Q4_0's 8 groups add in int16
// (8 * 2 * 15 * 127 = 30480) and Q5_0's in two halves of 4 (4 * 2 * 31 * 127 = 31496). IQ4_NL
// (the nibble's signed level) and Q8_0 (signed bytes; activations stored as q + 128, xor 0x80
// gives q back): |w| x (activation with w's sign), each group widened at once.
template <int R, bool VNNI, int64_t QT>
VS_AVX2 void tile_32(const TileArgs& a) {
    constexpr int H = 2;  // both halves of the tile in one pass
    constexpr int BYTES = QT == Q5_0 ? 352 : QT == Q8_0 ? 544 : 288;
    constexpr bool SIGNED = QT == IQ4_NL || QT == Q8_0;
    constexpr int GROUP = QT == Q4_0 ? 8 : 4;  // Q4_0, Q5_0 without VNNI: groups added in int16 (bounds above)
    const Activations& x = *a.act;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10), flip = _mm256_set1_epi8((char)0x80);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)IQ4_NL_VALUES));
    const int64_t nb = x.in / 32;
    float* out = a.out;  // the float accumulators live in the output rows
    for (int i = 0; i < H; ++i)
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * a.ldo + HALF * i, _mm256_setzero_ps());
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * BYTES;
        prefetch_block(t + PREFETCH_BLOCKS_32 * BYTES, BYTES);  // one pass: fetch ahead
        const int8_t* xb = x.q.data() + a.row0 * x.in + b * 32;
        __m256i dot[H][R], part[H][R];
        for (int i = 0; i < H; ++i)
            for (int r = 0; r < R; ++r) dot[i][r] = part[i][r] = _mm256_setzero_si256();
        for (int k = 0; k < 8; ++k) {  // values 4k .. 4k + 3 of each column
            __m256i xk[R];
            for (int r = 0; r < R; ++r) xk[r] = bcast4(xb + r * x.in + 4 * k);
            for (int i = 0; i < H; ++i) {
                __m256i w;
                if constexpr (QT == Q8_0) {
                    w = _mm256_loadu_si256((const __m256i*)(t + 32 + 64 * k + 32 * i));
                } else {  // group g = k % 4: low nibbles are values 4g .., high nibbles 16 + 4g ..
                    const int g = k & 3;
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(t + 32 + 64 * g + 32 * i));
                    w = k < 4 ? _mm256_and_si256(v, m4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    if constexpr (QT == IQ4_NL) {
                        w = _mm256_shuffle_epi8(table, w);
                    } else if constexpr (QT == Q5_0) {  // the fifth bit of value 4k + l is bit k of H
                        const __m256i hb = _mm256_loadu_si256((const __m256i*)(t + 288 + 32 * i));
                        const __m256i bit = k < 4 ? _mm256_slli_epi16(hb, 4 - k) : _mm256_srli_epi16(hb, k - 4);
                        w = _mm256_or_si256(w, _mm256_and_si256(bit, m10));
                    }
                }
                if constexpr (SIGNED) {
                    const __m256i mag = _mm256_abs_epi8(w);
                    for (int r = 0; r < R; ++r) {
                        __m256i xs = xk[r];
                        if constexpr (QT == Q8_0) xs = _mm256_xor_si256(xs, flip);
                        dot[i][r] = dot4<VNNI>(dot[i][r], mag, _mm256_sign_epi8(xs, w));
                    }
                } else if constexpr (VNNI) {
                    for (int r = 0; r < R; ++r) dot[i][r] = dot4<true>(dot[i][r], w, xk[r]);
                } else {
                    for (int r = 0; r < R; ++r) part[i][r] = _mm256_add_epi16(part[i][r], _mm256_maddubs_epi16(w, xk[r]));
                    if (k % GROUP == GROUP - 1)
                        for (int r = 0; r < R; ++r) {
                            dot[i][r] = _mm256_add_epi32(dot[i][r], _mm256_madd_epi16(part[i][r], _mm256_set1_epi16(1)));
                            part[i][r] = _mm256_setzero_si256();
                        }
                }
            }
        }
        for (int i = 0; i < H; ++i) {
            const __m256 d = halves(t + 16 * i);
            for (int r = 0; r < R; ++r) {
                __m256i total = dot[i][r];
                if constexpr (!SIGNED) {
                    constexpr int32_t OFFSET = QT == Q4_0 ? 8 : 16;
                    total = _mm256_sub_epi32(total, _mm256_set1_epi32(OFFSET * x.s32[(a.row0 + r) * nb + b]));
                }
                float* o = out + r * a.ldo + HALF * i;
                _mm256_storeu_ps(o, scaled_add(_mm256_loadu_ps(o), total, x.d[(a.row0 + r) * nb + b], d));
            }
        }
    }
}

// Both halves in one pass (see ROWS); Q6_K's one row in two.
template <int R, bool VNNI>
void tile_q6k_rows(const TileArgs& a) {
    if constexpr (R == 1) {
        tile_q6k<1, VNNI, 1>(a, 0);
        tile_q6k<1, VNNI, 1>(a, 1);
    } else {
        tile_q6k<R, VNNI, 2>(a, 0);
    }
}

// The AVX2 (VNNI: AVX-VNNI) tile kernels for R rows, one row per block format (QTYPES order).
template <int R, bool VNNI>
constexpr TileKernel TILES[] = {{Q4_K, tile_q4k<R, VNNI>}, {Q6_K, tile_q6k_rows<R, VNNI>},
                                {Q4_0, tile_32<R, VNNI, Q4_0>}, {IQ4_NL, tile_32<R, VNNI, IQ4_NL>},
                                {Q5_0, tile_32<R, VNNI, Q5_0>}, {Q8_0, tile_32<R, VNNI, Q8_0>}};
static_assert(in_format_order(TILES<1, false>), "the AVX2 tile kernels: one per format, in QTYPES order");

template <bool VNNI>
void tile_split(int format, const TileArgs& args) {
    const int groups = (args.rows + ROWS - 1) / ROWS;
    for (int g = 0, r0 = 0; g < groups; ++g) {
        TileArgs a = args;
        a.row0 = args.row0 + r0;
        a.rows = (args.rows - r0 + groups - g - 1) / (groups - g);  // as even as can be: 5 rows as 3 + 2
        a.out = args.out + r0 * args.ldo;
        switch (a.rows) {  // one table lookup per group of rows
            case 1: TILES<1, VNNI>[format].run(a); break;
            case 2: TILES<2, VNNI>[format].run(a); break;
            case 3: TILES<3, VNNI>[format].run(a); break;
            default: TILES<4, VNNI>[format].run(a); break;
        }
        r0 += a.rows;
    }
}

// The nearest IQ4_NL level of each lane, as a float: the lowest level plus the step to the next
// level for every midpoint strictly below v (ties go low, NaN to the lowest: nearest_iq4_nl's
// index). The sums are of small integers: exact.
VS_AVX2 inline __m256 nearest_levels(__m256 v) {
    __m256 level = _mm256_set1_ps((float)IQ4_NL_VALUES[0]);
    for (int k = 0; k < 15; ++k) {
        const __m256 mid = _mm256_set1_ps(0.5f * (float)(IQ4_NL_VALUES[k] + IQ4_NL_VALUES[k + 1]));
        const __m256 step = _mm256_set1_ps((float)(IQ4_NL_VALUES[k + 1] - IQ4_NL_VALUES[k]));
        level = _mm256_add_ps(level, _mm256_and_ps(_mm256_cmp_ps(v, mid, _CMP_GT_OQ), step));
    }
    return level;
}

// Lanes 0-7 in lo, 8-15 in hi, folded l += l + 8, l + 4, l + 2, l + 1 (fold16 of portable.cpp).
VS_AVX2 inline float fold16(__m256 lo, __m256 hi) {
    const __m256 a8 = _mm256_add_ps(lo, hi);
    const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
    const __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
    const __m128 a1 = _mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1));
    return _mm_cvtss_f32(a1);
}

// NQ queries (a0 ..) times 16 columns (c0 ..) of the values, the portable order per element. Each
// value row's 64 bytes are read once for the NQ queries.
template <int NQ>
VS_AVX2 void weighted_sum_tile(const float* p, int a0, const float* values, int64_t head_dim, const int64_t* slots,
                               int64_t count, int64_t c0, float* out) {
    __m256 s[NQ][2];
    for (int a = 0; a < NQ; ++a) s[a][0] = s[a][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
        const float* v = values + (slots ? slots[j] : j) * head_dim + c0;
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        for (int a = 0; a < NQ; ++a) {
            const __m256 pj = _mm256_set1_ps(p[(a0 + a) * count + j]);
            s[a][0] = _mm256_add_ps(s[a][0], _mm256_mul_ps(pj, v0));
            s[a][1] = _mm256_add_ps(s[a][1], _mm256_mul_ps(pj, v1));
        }
    }
    for (int a = 0; a < NQ; ++a) {
        _mm256_storeu_ps(out + (a0 + a) * head_dim + c0, s[a][0]);
        _mm256_storeu_ps(out + (a0 + a) * head_dim + c0 + 8, s[a][1]);
    }
}

}  // namespace

void tile_avx2(int format, const TileArgs& a) { tile_split<false>(format, a); }
void tile_avxvnni(int format, const TileArgs& a) { tile_split<true>(format, a); }

// exp_clamped (core.h) in 8 lanes: the same operations in the same order (no FMA), so the same
// bits; the clamps as selects keep a NaN a NaN as the scalar ternaries do.
VS_AVX2 static inline __m256 exp_clamped8(__m256 x) {
    x = _mm256_blendv_ps(x, _mm256_set1_ps(88.0f), _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
    x = _mm256_blendv_ps(x, _mm256_set1_ps(-87.0f), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_CUR_DIRECTION);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_mul_ps(p, _mm256_mul_ps(r, r));
    p = _mm256_add_ps(p, r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

VS_AVX2 void silu_mul_row_avx2(const float* gate, const float* up, int64_t n, float* out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(gate + j);
        const __m256 e = exp_clamped8(_mm256_xor_ps(v, sign));  // -v, as the scalar negation
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + j)));
    }
    for (; j < n; ++j) out[j] = (gate[j] / (1.0f + exp_clamped(-gate[j]))) * up[j];
}

// gelu_mul_row's scalar loop in 8 lanes, the same operations in the same order.
VS_AVX2 void gelu_mul_row_avx2(const float* gate, const float* up, int64_t n, float* out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 cubic = _mm256_set1_ps(GELU_CUBIC), k = _mm256_set1_ps(GELU_TWO_SQRT_2_OVER_PI);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(gate + j);
        __m256 t = _mm256_mul_ps(v, v);
        t = _mm256_mul_ps(t, v);
        t = _mm256_mul_ps(t, cubic);
        t = _mm256_add_ps(v, t);
        t = _mm256_mul_ps(t, k);
        const __m256 e = exp_clamped8(_mm256_xor_ps(t, sign));  // -t, as the scalar negation
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + j)));
    }
    gelu_mul_row_portable(gate + j, up + j, n - j, out + j);
}

VS_AVX2 void softmax_numerators_avx2(float* s, int64_t count) {
    // The maximum: per lane as std::max(best, x) does (vmaxps returns its second operand, best,
    // when either is NaN or both are zeros), then the lanes.
    __m256 best8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) best8 = _mm256_max_ps(_mm256_loadu_ps(s + j), best8);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, best8);
    float best = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < 8; ++l) best = std::max(best, lanes[l]);
    for (; j < count; ++j) best = std::max(best, s[j]);
    const __m256 b = _mm256_set1_ps(best);
    for (j = 0; j + 8 <= count; j += 8) _mm256_storeu_ps(s + j, exp_clamped8(_mm256_sub_ps(_mm256_loadu_ps(s + j), b)));
    for (; j < count; ++j) s[j] = exp_clamped(s[j] - best);
}

// quantize_block_portable with 8 lanes, the same values bit for bit (see x86_avx512.cpp; packing
// the int32 results to bytes cannot saturate: they lie in -127 .. 127).
VS_AVX2 void quantize_block_avx2(const float* xb, int block_k, int8_t* qb, float* d_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < block_k; i += 8) amax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), amax);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < block_k; i += 32) {
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * k), id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
            q[k] = _mm256_cvtps_epi32(v);
        }
        // packs work per 128-bit lane: bytes come out as groups of 4 values in the order 0,1,2,3 of
        // each lane's halves; the permute puts the 8 groups of 4 back in value order.
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i*)(qb + i), _mm256_permutevar8x32_epi32(p, order));
    }
    *d_out = d;
}

VS_AVX2 void fit_iq4_nl_avx2(const float* x, const float* w, float inv, float& sumqx, float& sumq2) {
    const __m256 s = _mm256_set1_ps(inv), zero = _mm256_setzero_ps();
    __m256 qx[2], q2[2];
    for (int k = 0; k < 2; ++k) {  // lanes 8k .. 8k + 7: values l and l + 16
        const __m256 xa = _mm256_loadu_ps(x + 8 * k), xb = _mm256_loadu_ps(x + 16 + 8 * k);
        const __m256 qa = nearest_levels(_mm256_mul_ps(s, xa)), qb = nearest_levels(_mm256_mul_ps(s, xb));
        const __m256 wqa = _mm256_mul_ps(_mm256_loadu_ps(w + 8 * k), qa), wqb = _mm256_mul_ps(_mm256_loadu_ps(w + 16 + 8 * k), qb);
        qx[k] = _mm256_add_ps(_mm256_add_ps(zero, _mm256_mul_ps(wqa, xa)), _mm256_mul_ps(wqb, xb));
        q2[k] = _mm256_add_ps(_mm256_add_ps(zero, _mm256_mul_ps(wqa, qa)), _mm256_mul_ps(wqb, qb));
    }
    sumqx = fold16(qx[0], qx[1]);
    sumq2 = fold16(q2[0], q2[1]);
}

// scores_portable for 4 keys at a time: each key's 16 partial lanes in two registers, then the
// tree l + 8, l + 4, l + 2, l + 1 on all four together (lower partial first, as the portable
// loop adds them). A last short group repeats its first key in the unused places.
VS_AVX2 void scores_avx2(const float* q, int nq, const float* keys, int64_t head_dim, const int64_t* slots, int64_t count,
                         float scale, float* scores) {
    constexpr int KEYS = 4;
    const __m256i order = _mm256_setr_epi32(0, 4, 2, 6, 1, 3, 5, 7);  // key t's sum is in lane 0, 4, 2, 6
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t j0 = 0; j0 < count; j0 += KEYS) {
        const int n = (int)std::min<int64_t>(KEYS, count - j0);
        const float* k[KEYS];
        for (int t = 0; t < KEYS; ++t) k[t] = keys + (slots ? slots[j0 + (t < n ? t : 0)] : j0 + (t < n ? t : 0)) * head_dim;
        for (int a = 0; a < nq; ++a) {
            const float* qa = q + a * head_dim;
            __m256 lo[KEYS], hi[KEYS];
            for (int t = 0; t < KEYS; ++t) lo[t] = hi[t] = _mm256_setzero_ps();
            for (int64_t c = 0; c < head_dim; c += LANES) {
                const __m256 q0 = _mm256_loadu_ps(qa + c), q1 = _mm256_loadu_ps(qa + c + 8);
                for (int t = 0; t < KEYS; ++t) {
                    lo[t] = _mm256_add_ps(lo[t], _mm256_mul_ps(q0, _mm256_loadu_ps(k[t] + c)));
                    hi[t] = _mm256_add_ps(hi[t], _mm256_mul_ps(q1, _mm256_loadu_ps(k[t] + c + 8)));
                }
            }
            __m256 u[KEYS];  // l + 8
            for (int t = 0; t < KEYS; ++t) u[t] = _mm256_add_ps(lo[t], hi[t]);
            // l + 4: [key 0 lanes 0-3 | key 1 lanes 0-3] + [key 0 lanes 4-7 | key 1 lanes 4-7], keys 2, 3 likewise
            const __m256 w01 = _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
            const __m256 w23 = _mm256_add_ps(_mm256_permute2f128_ps(u[2], u[3], 0x20), _mm256_permute2f128_ps(u[2], u[3], 0x31));
            // l + 2 within each 128-bit half: [k0: 0+2, 1+3, k2: 0+2, 1+3 | k1: .., k3: ..]
            const __m256 y = _mm256_add_ps(_mm256_shuffle_ps(w01, w23, 0x44), _mm256_shuffle_ps(w01, w23, 0xEE));
            // l + 1: lane 2i + 1 added to lane 2i
            const __m256 z = _mm256_add_ps(y, _mm256_shuffle_ps(y, y, 0xB1));
            const __m256 sums = _mm256_mul_ps(_mm256_permutevar8x32_ps(z, order), vscale);
            // one 16-byte store (8 lanes stored and n read back stall store forwarding); the last keys masked
            const __m128 four = _mm256_castps256_ps128(sums);
            if (n == KEYS) _mm_storeu_ps(scores + a * count + j0, four);
            else _mm_maskstore_ps(scores + a * count + j0, _mm_cmpgt_epi32(_mm_set1_epi32(n), _mm_setr_epi32(0, 1, 2, 3)), four);
        }
    }
}

void weighted_sum_avx2(const float* p, int nq, const float* values, int64_t head_dim, const int64_t* slots, int64_t count,
                       float* out) {
    constexpr int MAX_NQ = 6;  // 12 accumulators: the queries of a KV head at a time (Qwen2.5-1.5B: 6)
    for (int a0 = 0; a0 < nq; a0 += MAX_NQ)
        for (int64_t c0 = 0; c0 < head_dim; c0 += 16)  // head_dim is a multiple of 16 (check_attention)
            with_group_size(std::min(MAX_NQ, nq - a0), [&](auto n) {
                weighted_sum_tile<decltype(n)::value>(p, a0, values, head_dim, slots, count, c0, out);
            });
}

}  // namespace vsk

#else  // not x86-64: the path is not compiled in (isa_supported says so; these are never called)

namespace vsk {
void tile_avx2(int, const TileArgs&) { fail("the AVX2 path is not compiled for this CPU"); }
void tile_avxvnni(int, const TileArgs&) { fail("the AVX2 path is not compiled for this CPU"); }
void silu_mul_row_avx2(const float*, const float*, int64_t, float*) { fail("the AVX2 path is not compiled for this CPU"); }
void gelu_mul_row_avx2(const float*, const float*, int64_t, float*) { fail("the AVX2 path is not compiled for this CPU"); }
void softmax_numerators_avx2(float*, int64_t) { fail("the AVX2 path is not compiled for this CPU"); }
void quantize_block_avx2(const float*, int, int8_t*, float*) { fail("the AVX2 path is not compiled for this CPU"); }
void fit_iq4_nl_avx2(const float*, const float*, float, float&, float&) { fail("the AVX2 path is not compiled for this CPU"); }
void scores_avx2(const float*, int, const float*, int64_t, const int64_t*, int64_t, float, float*) {
    fail("the AVX2 path is not compiled for this CPU");
}
void weighted_sum_avx2(const float*, int, const float*, int64_t, const int64_t*, int64_t, float*) {
    fail("the AVX2 path is not compiled for this CPU");
}
}  // namespace vsk

#endif
