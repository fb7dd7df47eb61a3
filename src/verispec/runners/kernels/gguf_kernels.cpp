// Batch-invariant products of float activations with GGUF block-quantized weights, on the CPU.
//
// Owns: the repacked weight layout (16 output columns interleaved per block, same bits as the
// GGUF file), per-row activation quantization (int8 per block, row-local), the integer block
// products (AVX-512 VNNI, and a portable C++ path with the same arithmetic) and causal / tree
// attention over a static KV cache. Knows nothing about models or decoding.
//
// Exactness: for output element (row, col) the kernel computes, block after block in increasing
// k, an exact int32 dot product of the row's int8 activations with the column's integer weights,
// converts it to float and adds `isum * (x_scale * w_scale)` (and, for Q4_K, subtracts the mins
// term) to a float accumulator that starts at 0. No other rows, no other columns and no tile or
// thread choice enter that sequence, and the compiler may not contract it (-ffp-contract=off and
// separate mul/add intrinsics), so every row of a k-row call is bit-identical to a 1-row call,
// and the AVX-512 path equals the portable path bit for bit.
//
// Block formats: ggml's Q4_K, Q6_K, Q4_0, IQ4_NL, Q5_0 and Q8_0 (ggml-common.h, ggml-quants.c).
// Activation quantization follows llama.cpp's Q8_K (256 values per scale, K-quants) and Q8_0 (32
// values). requantize_4bit turns any of them into Q4_0 or IQ4_NL blocks, for a draft model read at
// 4.5 bits per weight.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int TILE = 16;  // output columns per interleaved tile

enum QType : int64_t { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, IQ4_NL = 20 };

// IQ4_NL's 16 levels (ggml-common.h kvalues_iq4nl), and the same plus 128 as unsigned bytes for
// the VNNI product (u8 weights times s8 activations, the offset taken back with the row sums).
constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct Format {
    int block_k;      // weights per block along the input dimension
    int raw_bytes;    // bytes of one block in the GGUF file
    int tile_bytes;   // bytes of one block of a 16-column tile after repacking
    bool k_quant;     // activations in 256-value blocks (else 32)
};

Format format_of(int64_t qtype) {
    switch (qtype) {
        case Q4_K: return {256, 144, 2368, true};
        case Q6_K: return {256, 210, 3360, true};
        case Q4_0:
        case IQ4_NL: return {32, 18, 288, false};
        case Q5_0: return {32, 22, 352, false};
        case Q8_0: return {32, 34, 544, false};
        default: TORCH_CHECK(false, "unsupported GGUF block type ", qtype);
    }
    return {};
}

inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {  // subnormal half: normalise
            int e = -1;
            do { ++e; mantissa <<= 1; } while ((mantissa & 0x400) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mantissa & 0x3ff) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline int32_t load_i32(const void* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// ---------------------------------------------------------------------------------------------
// Decoding one GGUF block into integer weights (the repack step and nothing else uses these).

struct Decoded {
    uint8_t q[256];     // unsigned integer weights (Q8_0: int8 bits)
    uint8_t scale[16];  // Q4_K: 8 sub-block scales; Q6_K: 16 int8 scales (bits)
    uint8_t min[8];     // Q4_K: 8 sub-block mins
    uint16_t d, dmin;   // fp16 bits
};

void decode_block(int64_t qtype, const uint8_t* raw, Decoded& out) {
    switch (qtype) {
        case Q4_K: {
            out.d = load_u16(raw);
            out.dmin = load_u16(raw + 2);
            const uint8_t* s = raw + 4;
      for (int j = 0; j < 8; ++j) {
                if (j < 4) {
                    out.scale[j] = s[j] & 63;
                    out.min[j] = s[j + 4] & 63;
                } else {
                    out.scale[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
                    out.min[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
                }
            }
            const uint8_t* qs = raw + 16;
      for (int p = 0; p < 4; ++p)
                for (int i = 0; i < 32; ++i) {
                    out.q[64 * p + i] = qs[32 * p + i] & 0xF;
                    out.q[64 * p + 32 + i] = qs[32 * p + i] >> 4;
                }
            break;
        }
        case Q6_K: {
            const uint8_t* ql = raw;
            const uint8_t* qh = raw + 128;
            std::memcpy(out.scale, raw + 192, 16);
            out.d = load_u16(raw + 208);
            for (int k = 0; k < 256; ++k) {
                const int half = k / 128, r = k % 128;
                const int lo = (ql[64 * half + r % 64] >> (4 * (r / 64))) & 0xF;
                const int hi = (qh[32 * half + r % 32] >> (2 * (r / 32))) & 3;
                out.q[k] = (uint8_t)(lo | (hi << 4));
            }
            break;
        }
        case Q4_0:
        case IQ4_NL: {  // IQ4_NL: q is the index of the level
            out.d = load_u16(raw);
            const uint8_t* qs = raw + 2;
            for (int i = 0; i < 16; ++i) {
                out.q[i] = qs[i] & 0xF;
                out.q[16 + i] = qs[i] >> 4;
            }
            break;
        }
        case Q5_0: {
            out.d = load_u16(raw);
            uint32_t qh;
            std::memcpy(&qh, raw + 2, 4);
            const uint8_t* qs = raw + 6;
            for (int i = 0; i < 32; ++i) {
                const int lo = i < 16 ? (qs[i] & 0xF) : (qs[i - 16] >> 4);
                out.q[i] = (uint8_t)(lo | (((qh >> i) & 1) << 4));
            }
            break;
        }
        case Q8_0: {
            out.d = load_u16(raw);
            std::memcpy(out.q, raw + 2, 32);
            break;
        }
        default: TORCH_CHECK(false, "unsupported GGUF block type ", qtype);
    }
}

// Writes column c (0..15) of one tile block. Layouts (bytes; [a][b] is row-major):
//  Q4_K: d u16[16] | dmin u16[16] | scale[8][16] | min[4][16][2] | qs[p<4][g<8][c][t<4] nibbles:
//        low = q(64p+4g+t), high = q(64p+32+4g+t)
//  Q6_K: d u16[16] | scale[8][16][2] int8 | per pair p<8: N[h<4][c][t] (low nibble q(32p+4h+t),
//        high nibble q(32p+16+4h+t)), H[e<2][c][t] (bits 2h..2h+1 = q(32p+16e+4h+t) >> 4)
//  Q4_0, IQ4_NL: d u16[16] | N[h<4][c][t] (low q(4h+t), high q(16+4h+t))
//  Q5_0: d u16[16] | N[h<4][c][t] (low q(4h+t), high q(16+4h+t)) | H[c][t] (bit g = q(4g+t) >> 4)
//  Q8_0: d u16[16] | W[g<8][c][t] int8 = q(4g+t)
void write_column(int64_t qtype, const Decoded& b, uint8_t* tile, int c) {
    switch (qtype) {
        case Q4_K: {
            std::memcpy(tile + 2 * c, &b.d, 2);
            std::memcpy(tile + 32 + 2 * c, &b.dmin, 2);
      for (int j = 0; j < 8; ++j) tile[64 + 16 * j + c] = b.scale[j];
      for (int p = 0; p < 4; ++p) {
                tile[192 + 32 * p + 2 * c] = b.min[2 * p];
                tile[192 + 32 * p + 2 * c + 1] = b.min[2 * p + 1];
            }
      for (int p = 0; p < 4; ++p)
        for (int g = 0; g < 8; ++g)
                    for (int t = 0; t < 4; ++t)
                        tile[320 + (p * 8 + g) * 64 + 4 * c + t] =
                            (uint8_t)(b.q[64 * p + 4 * g + t] | (b.q[64 * p + 32 + 4 * g + t] << 4));
            break;
        }
        case Q6_K: {
            std::memcpy(tile + 2 * c, &b.d, 2);
      for (int p = 0; p < 8; ++p) {
                tile[32 + 32 * p + 2 * c] = b.scale[2 * p];
                tile[32 + 32 * p + 2 * c + 1] = b.scale[2 * p + 1];
                uint8_t* n = tile + 288 + 384 * p;
        for (int h = 0; h < 4; ++h)
                    for (int t = 0; t < 4; ++t)
                        n[64 * h + 4 * c + t] =
                            (uint8_t)((b.q[32 * p + 4 * h + t] & 0xF) | ((b.q[32 * p + 16 + 4 * h + t] & 0xF) << 4));
                for (int e = 0; e < 2; ++e)
                    for (int t = 0; t < 4; ++t) {
                        uint8_t bits = 0;
            for (int h = 0; h < 4; ++h) bits |= (uint8_t)(((b.q[32 * p + 16 * e + 4 * h + t] >> 4) & 3) << (2 * h));
                        n[256 + 64 * e + 4 * c + t] = bits;
                    }
            }
            break;
        }
        case Q4_0:
        case IQ4_NL:
        case Q5_0: {
            std::memcpy(tile + 2 * c, &b.d, 2);
      for (int h = 0; h < 4; ++h)
                for (int t = 0; t < 4; ++t)
                    tile[32 + 64 * h + 4 * c + t] = (uint8_t)((b.q[4 * h + t] & 0xF) | ((b.q[16 + 4 * h + t] & 0xF) << 4));
            if (qtype != Q5_0) break;
            for (int t = 0; t < 4; ++t) {
                uint8_t bits = 0;
        for (int g = 0; g < 8; ++g) bits |= (uint8_t)(((b.q[4 * g + t] >> 4) & 1) << g);
                tile[288 + 4 * c + t] = bits;
            }
            break;
        }
        case Q8_0: {
            std::memcpy(tile + 2 * c, &b.d, 2);
      for (int g = 0; g < 8; ++g)
                for (int t = 0; t < 4; ++t) tile[32 + 64 * g + 4 * c + t] = b.q[4 * g + t];
            break;
        }
        default: break;
    }
}

// ---------------------------------------------------------------------------------------------
// Activations, quantized per row and per block (row-local: no value depends on another row).

struct Activations {
    int64_t rows = 0, in = 0;
    int block_k = 256;
    std::vector<int8_t> q;     // [rows][in]; Q8_0 weights: the bits of q + 128 (as uint8)
    std::vector<float> d;      // [rows][in / block_k]
    std::vector<int16_t> s16;  // [rows][in / 16] sums of q over 16 values
    std::vector<int16_t> s32;  // [rows][in / 32] sums of q over 32 values
};

constexpr int ROW_TILE = 8;  // rows per register tile

#define VS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

bool cpu_has_avx512_vnni() {
    static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                            __builtin_cpu_supports("avx512vnni");
    return has;
}

// One block of one row: d = max |x| / 127, q = clamp(nearbyint(x / d), -127, 127) (x * (1 / d)).
void quantize_block(const float* xb, int block_k, int8_t* qb, float* d_out) {
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

// quantize_block with 16 lanes: the same values bit for bit (max is exact and order-free; the
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

void quantize_rows(const float* x, int64_t rows, int64_t in, int block_k, bool offset, bool vector, Activations& a) {
    a.rows = rows;
    a.in = in;
    a.block_k = block_k;
    a.q.resize(rows * in);
    a.d.resize(rows * (in / block_k));
    a.s16.resize(rows * (in / 16));
    a.s32.resize(rows * (in / 32));
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float* xr = x + r * in;
            int8_t* qr = a.q.data() + r * in;
            for (int64_t b = 0; b < in / block_k; ++b) {
                float* d = a.d.data() + r * (in / block_k) + b;
                if (vector) quantize_block_avx512(xr + b * block_k, block_k, qr + b * block_k, d);
                else quantize_block(xr + b * block_k, block_k, qr + b * block_k, d);
            }
            for (int64_t j = 0; j < in / 16; ++j) {
                int s = 0;
                for (int i = 0; i < 16; ++i) s += qr[16 * j + i];
                a.s16[r * (in / 16) + j] = (int16_t)s;
            }
            for (int64_t j = 0; j < in / 32; ++j)
                a.s32[r * (in / 32) + j] = (int16_t)(a.s16[r * (in / 16) + 2 * j] + a.s16[r * (in / 16) + 2 * j + 1]);
            if (offset)
                for (int64_t i = 0; i < in; ++i) qr[i] = (int8_t)((uint8_t)qr[i] ^ 0x80);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Portable path: the reference arithmetic, one (row, column) at a time, from the tile layout.

struct TileArgs {
    const uint8_t* tile;  // the tile's first block; blocks follow at stride tile_bytes
    int64_t nblocks;
    const Activations* act;
    int64_t row0;
    int rows;
    float* out;  // out[row * ldo + c] for the tile's 16 columns
    int64_t ldo;
};

void tile_portable(int64_t qtype, const TileArgs& a) {
    const Format f = format_of(qtype);
    const Activations& x = *a.act;
  for (int r = 0; r < a.rows; ++r) {
        const int64_t row = a.row0 + r;
        const int8_t* xq = x.q.data() + row * x.in;
        for (int c = 0; c < TILE; ++c) {
            float acc = 0.0f;
            for (int64_t b = 0; b < a.nblocks; ++b) {
                const uint8_t* t = a.tile + b * f.tile_bytes;
                const int8_t* xb = xq + b * f.block_k;
                const float dx = x.d[row * (x.in / f.block_k) + b];
                switch (qtype) {
                    case Q4_K: {
                        int32_t isum = 0, imin = 0;
            for (int p = 0; p < 4; ++p) {
                            int32_t lo = 0, hi = 0;
              for (int g = 0; g < 8; ++g)
                                for (int u = 0; u < 4; ++u) {
                                    const uint8_t v = t[320 + (p * 8 + g) * 64 + 4 * c + u];
                                    lo += (v & 0xF) * xb[64 * p + 4 * g + u];
                                    hi += (v >> 4) * xb[64 * p + 32 + 4 * g + u];
                                }
                            isum += lo * t[64 + 16 * (2 * p) + c] + hi * t[64 + 16 * (2 * p + 1) + c];
                            const int16_t* s32 = x.s32.data() + row * (x.in / 32) + b * 8;
                            imin += t[192 + 32 * p + 2 * c] * s32[2 * p] + t[192 + 32 * p + 2 * c + 1] * s32[2 * p + 1];
                        }
                        const float d = half_to_float(load_u16(t + 2 * c)), dmin = half_to_float(load_u16(t + 32 + 2 * c));
                        const float dd = dx * d, dm = dx * dmin;
                        const float fi = (float)isum, fm = (float)imin;
                        const float pd = fi * dd;
                        acc = acc + pd;
                        const float pm = fm * dm;
                        acc = acc - pm;
                        break;
                    }
                    case Q6_K: {
                        int32_t isum = 0, ioff = 0;
                        const int16_t* s16 = x.s16.data() + row * (x.in / 16) + b * 16;
            for (int p = 0; p < 8; ++p) {
                            const uint8_t* n = t + 288 + 384 * p;
                            int32_t lo = 0, hi = 0;
              for (int h = 0; h < 4; ++h)
                                for (int u = 0; u < 4; ++u) {
                                    const uint8_t nib = n[64 * h + 4 * c + u];
                                    const int q0 = (nib & 0xF) | (((n[256 + 4 * c + u] >> (2 * h)) & 3) << 4);
                                    const int q1 = (nib >> 4) | (((n[256 + 64 + 4 * c + u] >> (2 * h)) & 3) << 4);
                                    lo += q0 * xb[32 * p + 4 * h + u];
                                    hi += q1 * xb[32 * p + 16 + 4 * h + u];
                                }
                            const int s0 = (int8_t)t[32 + 32 * p + 2 * c], s1 = (int8_t)t[32 + 32 * p + 2 * c + 1];
                            isum += lo * s0 + hi * s1;
                            ioff += s0 * s16[2 * p] + s1 * s16[2 * p + 1];
                        }
                        const int32_t total = isum - ioff * 32;
                        const float dd = dx * half_to_float(load_u16(t + 2 * c));
                        const float pd = (float)total * dd;
                        acc = acc + pd;
                        break;
                    }
                    case Q4_0:
                    case IQ4_NL: {  // Q4_0: q - 8; IQ4_NL: the nibble's level
                        int32_t dot = 0;
                        auto level = [qtype](int n) { return qtype == IQ4_NL ? (int)IQ4_NL_VALUES[n] : n; };
            for (int h = 0; h < 4; ++h)
                            for (int u = 0; u < 4; ++u) {
                                const uint8_t nib = t[32 + 64 * h + 4 * c + u];
                                dot += level(nib & 0xF) * xb[4 * h + u] + level(nib >> 4) * xb[16 + 4 * h + u];
                            }
                        const int32_t total = dot - (qtype == Q4_0 ? 8 * x.s32[row * (x.in / 32) + b] : 0);
                        const float dd = dx * half_to_float(load_u16(t + 2 * c));
                        const float pd = (float)total * dd;
                        acc = acc + pd;
                        break;
                    }
                    case Q5_0: {
                        int32_t dot = 0;
            for (int h = 0; h < 4; ++h)
                            for (int u = 0; u < 4; ++u) {
                                const uint8_t nib = t[32 + 64 * h + 4 * c + u], bits = t[288 + 4 * c + u];
                                const int q0 = (nib & 0xF) | (((bits >> h) & 1) << 4);
                                const int q1 = (nib >> 4) | (((bits >> (h + 4)) & 1) << 4);
                                dot += q0 * xb[4 * h + u] + q1 * xb[16 + 4 * h + u];
                            }
                        const int32_t total = dot - 16 * x.s32[row * (x.in / 32) + b];
                        const float dd = dx * half_to_float(load_u16(t + 2 * c));
                        const float pd = (float)total * dd;
                        acc = acc + pd;
                        break;
                    }
                    case Q8_0: {
                        int32_t dot = 0, wsum = 0;
            for (int g = 0; g < 8; ++g)
                            for (int u = 0; u < 4; ++u) {
                                const int w = (int8_t)t[32 + 64 * g + 4 * c + u];
                                dot += (int)(uint8_t)xb[4 * g + u] * w;  // activations stored as q + 128
                                wsum += w;
                            }
                        const int32_t total = dot - 128 * wsum;
                        const float dd = dx * half_to_float(load_u16(t + 2 * c));
                        const float pd = (float)total * dd;
                        acc = acc + pd;
                        break;
                    }
                    default: break;
                }
            }
            a.out[r * a.ldo + c] = acc;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI path: 16 columns in the lanes of a register, R rows share each unpacked weight.

VS_AVX512 inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// acc += dpbusd(w (unsigned bytes), the 4 signed bytes at p broadcast to every lane), with the
// broadcast folded into the instruction ({1to16}): one instruction per product.
VS_AVX512 inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
    asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*(const int32_t*)p));
    return acc;
}

// Prefetch distance: this many blocks ahead of the one being multiplied.
constexpr int PREFETCH_BLOCKS = 2;

VS_AVX512 inline void prefetch_block(const uint8_t* next, int bytes) {
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char*)(next + l), _MM_HINT_T0);
}

// Each kernel walks one sub-block at a time: R int32 accumulators (one per row) take the
// sub-block's dot products, are multiplied by the sub-block scale and added to R int32 sums;
// the float accumulators live in the output rows.
template <int R>
VS_AVX512 void tile_q4k(const TileArgs& a) {
    const Activations& x = *a.act;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + r * a.ldo, _mm512_setzero_ps());
    const int64_t nb = x.in / 256;
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * 2368;
        prefetch_block(t + PREFETCH_BLOCKS * 2368, 2368);
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
            __m512 acc = _mm512_loadu_ps(a.out + r * a.ldo);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dx, d)));
            acc = _mm512_sub_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(dx, dmin)));
            _mm512_storeu_ps(a.out + r * a.ldo, acc);
        }
    }
}

template <int R>
VS_AVX512 void tile_q6k(const TileArgs& a) {
    const Activations& x = *a.act;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + r * a.ldo, _mm512_setzero_ps());
    const int64_t nb = x.in / 256;
    for (int64_t b = 0; b < a.nblocks; ++b) {
        const uint8_t* t = a.tile + b * 3360;
        prefetch_block(t + PREFETCH_BLOCKS * 3360, 3360);
        const int8_t* xb = x.q.data() + a.row0 * x.in + b * 256;
        __m512i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
        for (int j = 0; j < 16; ++j) {
            const int p = j / 2, e = j & 1;
            const uint8_t* n = t + 288 + 384 * p;
            const __m512i hb = _mm512_loadu_si512(n + 256 + 64 * e);
            __m512i dot[R];
            for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
            for (int h = 0; h < 4; ++h) {
                const __m512i v = _mm512_loadu_si512(n + 64 * h);
                const __m512i lo = e ? _mm512_and_si512(_mm512_srli_epi16(v, 4), m4) : _mm512_and_si512(v, m4);
                __m512i bits;  // bits 2h..2h+1 moved to bits 4..5
                switch (h) {
                    case 0: bits = _mm512_slli_epi16(hb, 4); break;
                    case 1: bits = _mm512_slli_epi16(hb, 2); break;
                    case 2: bits = hb; break;
                    default: bits = _mm512_srli_epi16(hb, 2); break;
                }
                const __m512i w = _mm512_ternarylogic_epi32(lo, bits, m30, 0xF8);  // lo | (bits & 0x30)
                for (int r = 0; r < R; ++r) dot[r] = dpbusd_bcast(dot[r], w, xb + r * x.in + 16 * j + 4 * h);
            }
            const __m512i pairs = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(t + 32 + 32 * p)));
            const __m512i sc = e ? _mm512_srai_epi32(pairs, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16);
            for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot[r], sc));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)t));
        for (int r = 0; r < R; ++r) {
            const int16_t* s16 = x.s16.data() + (a.row0 + r) * (x.in / 16) + b * 16;
            __m512i ioff = _mm512_setzero_si512();
            for (int p = 0; p < 8; ++p) {
                const __m512i pairs = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(t + 32 + 32 * p)));
                ioff = _mm512_dpwssd_epi32(ioff, pairs, _mm512_set1_epi32(load_i32(s16 + 2 * p)));
            }
            const __m512i total = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(ioff, 5));
            const __m512 dx = _mm512_set1_ps(x.d[(a.row0 + r) * nb + b]);
            __m512 acc = _mm512_loadu_ps(a.out + r * a.ldo);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dx, d)));
            _mm512_storeu_ps(a.out + r * a.ldo, acc);
        }
    }
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
        prefetch_block(t + 8 * BYTES, BYTES);
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
        prefetch_block(t + 6 * 544, 544);
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

constexpr int MAX_ROWS = ROW_TILE;

template <int R>
void tile_avx512_rows(int64_t qtype, const TileArgs& a) {
    switch (qtype) {
        case Q4_K: tile_q4k<R>(a); break;
        case Q6_K: tile_q6k<R>(a); break;
        case Q4_0: tile_nibbles<R, Q4_0>(a); break;
        case IQ4_NL: tile_nibbles<R, IQ4_NL>(a); break;
        case Q5_0: tile_nibbles<R, Q5_0>(a); break;
        case Q8_0: tile_q8_0<R>(a); break;
        default: break;
    }
}

void tile_avx512(int64_t qtype, const TileArgs& a) {
    switch (a.rows) {
        case 1: tile_avx512_rows<1>(qtype, a); break;
        case 2: tile_avx512_rows<2>(qtype, a); break;
        case 3: tile_avx512_rows<3>(qtype, a); break;
        case 4: tile_avx512_rows<4>(qtype, a); break;
        case 5: tile_avx512_rows<5>(qtype, a); break;
        case 6: tile_avx512_rows<6>(qtype, a); break;
        case 7: tile_avx512_rows<7>(qtype, a); break;
        default: tile_avx512_rows<8>(qtype, a); break;
    }
}


// ---------------------------------------------------------------------------------------------
// Entry points.

// The checks repack and dequantize share: raw holds out_features rows of whole blocks.
int64_t check_raw_blocks(const torch::Tensor& raw, const Format& f, int64_t out_features, int64_t in_features) {
    TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous(), "raw blocks must be contiguous uint8");
    TORCH_CHECK(in_features % f.block_k == 0, "in_features ", in_features, " is not a multiple of ", f.block_k);
    const int64_t nblocks = in_features / f.block_k;
    TORCH_CHECK(raw.numel() == out_features * nblocks * f.raw_bytes, "raw size ", raw.numel(), " != ",
                out_features * nblocks * f.raw_bytes);
    return nblocks;
}

torch::Tensor repack(torch::Tensor raw, int64_t qtype, int64_t out_features, int64_t in_features) {
    const Format f = format_of(qtype);
    const int64_t nblocks = check_raw_blocks(raw, f, out_features, in_features);
    const int64_t ntiles = (out_features + TILE - 1) / TILE;
    auto packed = torch::zeros({ntiles * nblocks * f.tile_bytes}, torch::kUInt8);
    const uint8_t* src = raw.data_ptr<uint8_t>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
        Decoded block;
        for (int64_t t = t0; t < t1; ++t)
            for (int c = 0; c < TILE; ++c) {
                const int64_t col = t * TILE + c;
                if (col >= out_features) continue;  // padding columns stay zero (d = 0)
                for (int64_t b = 0; b < nblocks; ++b) {
                    std::memset(&block, 0, sizeof block);
                    decode_block(qtype, src + (col * nblocks + b) * f.raw_bytes, block);
                    write_column(qtype, block, dst + (t * nblocks + b) * f.tile_bytes, c);
                }
            }
    });
    return packed;
}

// raw [out * row_bytes] uint8 -> float32 [out, in]: the GGUF blocks de-quantized with ggml's formulas
// (dequantize_row_q4_K and friends), for runners that re-quantize (int8) without a float model.
// One row of blocks -> in_features floats, ggml's formulas.
void dequantize_row(int64_t qtype, const Format& f, const uint8_t* src, int64_t nblocks, float* dst) {
    Decoded b;
    for (int64_t blk = 0; blk < nblocks; ++blk) {
        decode_block(qtype, src + blk * f.raw_bytes, b);
        float* y = dst + blk * f.block_k;
        const float d = half_to_float(b.d);
        switch (qtype) {
            case Q4_K: {
                const float dmin = half_to_float(b.dmin);
                for (int j = 0; j < 8; ++j) {
                    const float scale = d * (float)b.scale[j], mins = dmin * (float)b.min[j];
                    for (int i = 0; i < 32; ++i) y[32 * j + i] = scale * (float)b.q[32 * j + i] - mins;
                }
                break;
            }
            case Q6_K:
                for (int j = 0; j < 16; ++j) {
                    const float scale = d * (float)(int8_t)b.scale[j];
                    for (int i = 0; i < 16; ++i) y[16 * j + i] = scale * (float)((int)b.q[16 * j + i] - 32);
                }
                break;
            case Q4_0:
                for (int i = 0; i < 32; ++i) y[i] = d * (float)((int)b.q[i] - 8);
                break;
            case IQ4_NL:
                for (int i = 0; i < 32; ++i) y[i] = d * (float)IQ4_NL_VALUES[b.q[i]];
                break;
            case Q5_0:
                for (int i = 0; i < 32; ++i) y[i] = d * (float)((int)b.q[i] - 16);
                break;
            default:  // Q8_0
                for (int i = 0; i < 32; ++i) y[i] = (float)(int8_t)b.q[i] * d;
                break;
        }
    }
}

torch::Tensor dequantize(torch::Tensor raw, int64_t qtype, int64_t out_features, int64_t in_features) {
    const Format f = format_of(qtype);
    const int64_t nblocks = check_raw_blocks(raw, f, out_features, in_features);
    auto out = torch::empty({out_features, in_features}, torch::kFloat32);
    const uint8_t* src = raw.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, out_features, 64, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            dequantize_row(qtype, f, src + r * nblocks * f.raw_bytes, nblocks, dst + r * in_features);
    });
    return out;
}

// Calls row_fn(r, w) with each row r of raw de-quantized (as dequantize), rows in parallel.
template <typename RowFn>
void for_dequantized_rows(const torch::Tensor& raw, int64_t qtype, int64_t out_features, int64_t in_features, RowFn row_fn) {
    const Format f = format_of(qtype);
    const int64_t nblocks = check_raw_blocks(raw, f, out_features, in_features);
    const int64_t row_bytes = nblocks * f.raw_bytes;
    const uint8_t* src = raw.data_ptr<uint8_t>();
    at::parallel_for(0, out_features, 16, [&](int64_t r0, int64_t r1) {
        std::vector<float> row(in_features);
        for (int64_t r = r0; r < r1; ++r) {
            dequantize_row(qtype, f, src + r * row_bytes, nblocks, row.data());
            row_fn(r, row.data());
        }
    });
}

// raw [out * row_bytes] uint8 -> (int8 [out, in], scales [out] float32): each row de-quantized
// (as dequantize) and re-quantized symmetric per row, in one pass: scale = max |row| / 127 (1 for
// an all-zero row), q = clamp(round-half-even(w / scale), -127, 127) -- exactly
// verispec.runners.int8_ops.quantize_weight_rows of the de-quantized row.
std::vector<torch::Tensor> requantize_int8(torch::Tensor raw, int64_t qtype, int64_t out_features, int64_t in_features) {
    auto q = torch::empty({out_features, in_features}, torch::kInt8);
    auto scales = torch::empty({out_features}, torch::kFloat32);
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scales.data_ptr<float>();
    for_dequantized_rows(raw, qtype, out_features, in_features, [&](int64_t r, const float* w) {
        float amax = 0.0f;
        for (int64_t i = 0; i < in_features; ++i) amax = std::max(amax, std::fabs(w[i]));
        float scale = amax / 127.0f;
        if (!(scale > 0.0f)) scale = 1.0f;
        sp[r] = scale;
        for (int64_t i = 0; i < in_features; ++i) {
            float v = std::nearbyint(w[i] / scale);
            qp[r * in_features + i] = (int8_t)std::min(127.0f, std::max(-127.0f, v));
        }
    });
    return {q, scales};
}

// One block of 32 values -> Q4_0 as ggml's quantize_row_q4_0_ref and gguf-py's
// Q4_0.quantize_blocks do, in float32: m = the value of largest magnitude (the first such),
// d = m / -8, q = min(15, trunc(x * (1 / d) + 8.5)), d stored as fp16 (nearest even).
void quantize_block_q4_0(const float* x, uint8_t* o) {
    float m = x[0], amax = std::fabs(x[0]);  // the first such value, signed zero included
    for (int i = 1; i < 32; ++i)
        if (std::fabs(x[i]) > amax) { amax = std::fabs(x[i]); m = x[i]; }
    const float d = m / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = c10::Half(d).x;
    std::memcpy(o, &dh, 2);
    uint8_t qv[32];
    for (int i = 0; i < 32; ++i) {
        const float v = std::trunc(x[i] * id + 8.5f);  // separate product and sum (no FMA)
        qv[i] = (uint8_t)std::min(15.0f, std::max(0.0f, v));
    }
    for (int i = 0; i < 16; ++i) o[2 + i] = (uint8_t)(qv[i] | (qv[16 + i] << 4));
}

// The level of IQ4_NL_VALUES nearest to v (the lower one on a tie), by table: every midpoint
// between two levels is a multiple of 1/2, so j = ceil(2 v) (v in (j/2 - 1/2, j/2]) decides it
// exactly: the whole interval lies on one side of each midpoint, a midpoint itself going low.
struct NearestIQ4NL {
    uint8_t table[2 * 256 + 1];  // index j + 256 for j in -256 .. 256
    NearestIQ4NL() {
        for (int j = -256; j <= 256; ++j) {
            const float v = 0.5f * (float)j;  // the interval's top: the same answer as all of it
            int best = 0;
            for (int l = 1; l < 16; ++l)
                if (std::fabs(v - IQ4_NL_VALUES[l]) < std::fabs(v - IQ4_NL_VALUES[best])) best = l;
            table[j + 256] = (uint8_t)best;
        }
    }
};
const NearestIQ4NL NEAREST_IQ4_NL;

inline int nearest_iq4_nl(float v) {
    if (!(v > -128.0f)) return 0;  // below every level (and NaN)
    if (v >= 128.0f) return 15;
    const float v2 = 2.0f * v;  // exact; |v2| < 256
    int j = (int)v2;            // toward zero, then up to ceil(v2) (no libm call)
    j += (float)j < v2;
    return NEAREST_IQ4_NL.table[j + 256];
}

// sum(a[i] * b[i]) over 32 values in the order both IQ4_NL fits use: lane l = (0 + a_l b_l) +
// a_(l+16) b_(l+16), then lanes folded l += l + 8, l + 4, l + 2, l + 1 (lane 0 is the sum).
inline float fold16(float* lane) {
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) lane[l] = lane[l] + lane[l + width];
    return lane[0];
}

// One fit of an IQ4_NL block for the scale 1 / inv: levels nearest to inv * x, then sum(w q x) and
// sum(w q^2). Portable arithmetic; fit_iq4_nl_avx512 gives the same bits.
void fit_iq4_nl(const float* x, const float* w, float inv, float& sumqx, float& sumq2) {
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

// The nearest level as the number of midpoints between levels strictly below v (ties go low,
// NaN to 0: the same index as nearest_iq4_nl), 16 values per register.
VS_AVX512 inline __m512 nearest_levels_avx512(__m512 v) {
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

VS_AVX512 inline float fold16_avx512(__m512 a) {
    a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(3, 2, 3, 2)));  // lane l += lane l + 8
    a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(1, 1, 1, 1)));  // l += l + 4
    a = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));        // l += l + 2
    a = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));        // l += l + 1
    return _mm512_cvtss_f32(a);
}

VS_AVX512 void fit_iq4_nl_avx512(const float* x, const float* w, float inv, float& sumqx, float& sumq2) {
    const __m512 xa = _mm512_loadu_ps(x), xb = _mm512_loadu_ps(x + 16);
    const __m512 wa = _mm512_loadu_ps(w), wb = _mm512_loadu_ps(w + 16), s = _mm512_set1_ps(inv);
    const __m512 qa = nearest_levels_avx512(_mm512_mul_ps(s, xa)), qb = nearest_levels_avx512(_mm512_mul_ps(s, xb));
    const __m512 wqa = _mm512_mul_ps(wa, qa), wqb = _mm512_mul_ps(wb, qb), zero = _mm512_setzero_ps();
    sumqx = fold16_avx512(_mm512_add_ps(_mm512_add_ps(zero, _mm512_mul_ps(wqa, xa)), _mm512_mul_ps(wqb, xb)));
    sumq2 = fold16_avx512(_mm512_add_ps(_mm512_add_ps(zero, _mm512_mul_ps(wqa, qa)), _mm512_mul_ps(wqb, qb)));
}

// One block of 32 values -> IQ4_NL, the search of llama.cpp's IQ4_NL quantizer without an
// importance matrix (ggml-quants.c): weights w = x^2; for the scale m / 127 and the 15 scales
// m / (t - 127), t in -7..7 (m, the first value of largest magnitude, near the level -127), pick
// levels nearest to x / scale and keep the least-squares scale sum(w q x) / sum(w q^2) with the
// largest sum(w q x)^2 / sum(w q^2) (float sums in fit_iq4_nl's order); the levels are then chosen
// again for the kept scale, which is stored as fp16. vector: the AVX-512 fit (the same bits).
void quantize_block_iq4_nl(const float* x, uint8_t* o, bool vector) {
    float amax = 0.0f, m = 0.0f;
    for (int i = 0; i < 32; ++i)
        if (std::fabs(x[i]) > amax) { amax = std::fabs(x[i]); m = x[i]; }
    uint8_t levels[32] = {0};
    float d = 0.0f;
    if (amax >= 1e-15f) {
        float w[32];
        for (int i = 0; i < 32; ++i) w[i] = x[i] * x[i];
        auto fit = [&](float inv, float& sumqx, float& sumq2) {
            if (vector) fit_iq4_nl_avx512(x, w, inv, sumqx, sumq2);
            else fit_iq4_nl(x, w, inv, sumqx, sumq2);
        };
        float sumqx, sumq2;
        fit(-(float)IQ4_NL_VALUES[0] / m, sumqx, sumq2);  // m near the top level, 113 (clamped)
        d = sumq2 > 0.0f ? sumqx / sumq2 : 0.0f;
        float best = d * sumqx;
        for (int t = -7; t <= 7; ++t) {
            fit((float)(t + IQ4_NL_VALUES[0]) / m, sumqx, sumq2);
            if (sumq2 > 0.0f && sumqx * sumqx > best * sumq2) {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        const float inv = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; ++i) levels[i] = (uint8_t)nearest_iq4_nl(inv * x[i]);
    }
    const uint16_t dh = c10::Half(d).x;
    std::memcpy(o, &dh, 2);
    for (int i = 0; i < 16; ++i) o[2 + i] = (uint8_t)(levels[i] | (levels[16 + i] << 4));
}

// raw [out * row_bytes] uint8 of any supported type -> Q4_0 or IQ4_NL blocks [out * in / 32 * 18]
// uint8: each row de-quantized (as dequantize) and quantized 32 values at a time (above).
// impl: 0 = best for this CPU, 1 = portable, 2 = AVX-512 (the IQ4_NL fit; the same bits).
torch::Tensor requantize_4bit(torch::Tensor raw, int64_t qtype, int64_t out_features, int64_t in_features, int64_t to_qtype,
                              int64_t impl) {
    TORCH_CHECK(to_qtype == Q4_0 || to_qtype == IQ4_NL, "re-quantizing to GGUF block type ", to_qtype, " is not supported");
    TORCH_CHECK(in_features % 32 == 0, "in_features ", in_features, " is not a multiple of 32");
    TORCH_CHECK(!(impl == 2 && !cpu_has_avx512_vnni()), "this CPU has no AVX-512 VNNI");
    const bool vector = impl == 2 || (impl == 0 && cpu_has_avx512_vnni());
    const int64_t out_blocks = in_features / 32;
    auto q = torch::empty({out_features * out_blocks * 18}, torch::kUInt8);
    uint8_t* dst = q.data_ptr<uint8_t>();
    for_dequantized_rows(raw, qtype, out_features, in_features, [&](int64_t r, const float* w) {
        for (int64_t blk = 0; blk < out_blocks; ++blk) {
            uint8_t* o = dst + (r * out_blocks + blk) * 18;
            if (to_qtype == Q4_0) quantize_block_q4_0(w + blk * 32, o);
            else quantize_block_iq4_nl(w + blk * 32, o, vector);
        }
    });
    return q;
}

// x [rows, in] float32, packed from repack() -> [rows, ceil(out / 16) * 16] float32.
// impl: 0 = best for this CPU, 1 = portable, 2 = AVX-512 (error when the CPU lacks it).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t out_features, int64_t impl) {
    TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32, "x must be [rows, in] float32");
    x = x.contiguous();
    const Format f = format_of(qtype);
    const int64_t rows = x.size(0), in = x.size(1);
    TORCH_CHECK(in % f.block_k == 0, "in_features ", in, " is not a multiple of ", f.block_k);
    const int64_t nblocks = in / f.block_k, ntiles = (out_features + TILE - 1) / TILE;
    TORCH_CHECK(packed.numel() == ntiles * nblocks * f.tile_bytes, "packed weight does not match the shapes");
    const bool vector = impl == 2 || (impl == 0 && cpu_has_avx512_vnni());
    TORCH_CHECK(!(impl == 2 && !cpu_has_avx512_vnni()), "this CPU has no AVX-512 VNNI");
    auto out = torch::empty({rows, ntiles * TILE}, torch::kFloat32);
    Activations act;
    quantize_rows(x.data_ptr<float>(), rows, in, f.k_quant ? 256 : 32, qtype == Q8_0, vector, act);
    const uint8_t* w = packed.data_ptr<uint8_t>();
    float* o = out.data_ptr<float>();
    const int64_t ldo = ntiles * TILE;
    constexpr int64_t ROW_BLOCK = 64;  // rows whose activations stay in cache while a tile is reused
    for (int64_t rb = 0; rb < rows; rb += ROW_BLOCK) {
        const int64_t rend = std::min(rows, rb + ROW_BLOCK);
        at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t)
                for (int64_t r = rb; r < rend; r += MAX_ROWS) {
                    TileArgs args{w + t * nblocks * f.tile_bytes, nblocks, &act, r,
                                  (int)std::min<int64_t>(MAX_ROWS, rend - r), o + r * ldo + t * TILE, ldo};
                    if (vector) tile_avx512(qtype, args);
                    else tile_portable(qtype, args);
                }
        });
    }
    return out;
}


// ---------------------------------------------------------------------------------------------
// Attention over a static KV cache, one (query row, head) at a time.
//
// Row i attends slots 0 .. start + i (causal) or the slots listed in visible[i] (a token tree),
// in increasing order; both cases run the same loop over a list of slots, so a tree node's
// result equals the chain position's with the same keys. Dot products keep 16 partial lanes reduced
// in one fixed tree; the softmax uses exp_clamped below; weighted sums run over the slots in
// order. The query heads sharing a KV head (GQA) go through the keys together, each with exactly
// its one-query operations. Nothing depends on the other rows, the thread or the number of rows.

constexpr int LANES = 16;
constexpr int MAX_GROUP = 16;  // query heads per KV head handled in one pass over the keys

// exp(x) in plain float operations the compiler can vectorise (no libm call): Cody-Waite range
// reduction and Cephes' expf polynomial (about 1 ulp). x is clamped to [-87, 88] first (exp(88) <
// FLT_MAX): inputs below -87 give exp(-87).
inline float exp_clamped(float x) {
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.0f ? -87.0f : x;
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float r2 = r * r;
    p = p * r2;
    p = p + r;
    p = p + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

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

// weighted_sum_portable with the sums in registers: two queries x NC * 16 columns at a time,
// the same operations per element in the same order.
template <int NC>
VS_AVX512 void weighted_sum_tile(const float* p, int nq, const float* values, int64_t head_dim, const int64_t* slots,
                                 int64_t count, int64_t c0, float* out) {
    for (int a = 0; a < nq; a += 2) {
        const bool two = a + 1 < nq;
        __m512 s0[NC], s1[NC];
        for (int i = 0; i < NC; ++i) s0[i] = s1[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < count; ++j) {
            const float* v = values + (slots ? slots[j] : j) * head_dim + c0;
            const __m512 p0 = _mm512_set1_ps(p[a * count + j]);
            const __m512 p1 = _mm512_set1_ps(two ? p[(a + 1) * count + j] : 0.0f);
            for (int i = 0; i < NC; ++i) {
                const __m512 vi = _mm512_loadu_ps(v + 16 * i);
                s0[i] = _mm512_add_ps(s0[i], _mm512_mul_ps(p0, vi));
                s1[i] = _mm512_add_ps(s1[i], _mm512_mul_ps(p1, vi));
            }
        }
        for (int i = 0; i < NC; ++i) {
            _mm512_storeu_ps(out + a * head_dim + c0 + 16 * i, s0[i]);
            if (two) _mm512_storeu_ps(out + (a + 1) * head_dim + c0 + 16 * i, s1[i]);
        }
    }
}

void weighted_sum_avx512(const float* p, int nq, const float* values, int64_t head_dim, const int64_t* slots,
                         int64_t count, float* out) {
    for (int64_t c0 = 0; c0 < head_dim; c0 += 8 * LANES) {
        switch (std::min<int64_t>(8, (head_dim - c0) / LANES)) {
            case 1: weighted_sum_tile<1>(p, nq, values, head_dim, slots, count, c0, out); break;
            case 2: weighted_sum_tile<2>(p, nq, values, head_dim, slots, count, c0, out); break;
            case 3: weighted_sum_tile<3>(p, nq, values, head_dim, slots, count, c0, out); break;
            case 4: weighted_sum_tile<4>(p, nq, values, head_dim, slots, count, c0, out); break;
            case 5: weighted_sum_tile<5>(p, nq, values, head_dim, slots, count, c0, out); break;
            case 6: weighted_sum_tile<6>(p, nq, values, head_dim, slots, count, c0, out); break;
            case 7: weighted_sum_tile<7>(p, nq, values, head_dim, slots, count, c0, out); break;
            default: weighted_sum_tile<8>(p, nq, values, head_dim, slots, count, c0, out); break;
        }
    }
}

// The query heads of one group (GQA: nq heads sharing one KV head) of one row, over the same
// `count` slots: each key and value row is loaded once for all nq queries. For every query the
// operations and their order are exactly those of a one-query pass (16-lane partial dot products
// reduced in one fixed tree, running max, exp, sequential sums over the slots in order), so a
// head's result does not depend on nq. scores: [nq][count] scratch.
__attribute__((target_clones("avx512f", "avx2", "default")))
void attend_group(const float* q, int nq, const float* keys, const float* values, int64_t head_dim, const int64_t* slots,
                  int64_t count, float scale, bool vector, float* scores, float* out) {
    float best[MAX_GROUP], total[MAX_GROUP];
    if (vector) scores_avx512(q, nq, keys, head_dim, slots, count, scale, scores);
    else scores_portable(q, nq, keys, head_dim, slots, count, scale, scores);
    for (int a = 0; a < nq; ++a) {
        best[a] = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < count; ++j) best[a] = std::max(best[a], scores[a * count + j]);
    }
    for (int a = 0; a < nq; ++a) {
        float* sa = scores + a * count;
        for (int64_t j = 0; j < count; ++j) sa[j] = exp_clamped(sa[j] - best[a]);  // vectorised
        float t = 0.0f;
        for (int64_t j = 0; j < count; ++j) t = t + sa[j];
        total[a] = t;
    }
    if (vector) weighted_sum_avx512(scores, nq, values, head_dim, slots, count, out);
    else weighted_sum_portable(scores, nq, values, head_dim, slots, count, out);
    for (int a = 0; a < nq; ++a) {
        const float inv = 1.0f / total[a];
        for (int64_t c = 0; c < head_dim; ++c) out[a * head_dim + c] = out[a * head_dim + c] * inv;
    }
}

// q [rows, heads, head_dim], keys / values [kv_heads, capacity, head_dim] (float32, contiguous);
// visible: empty (causal from `start`) or int64 [rows, width] with lengths [rows]; impl as linear().
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start,
                        torch::Tensor visible, torch::Tensor lengths, double scale, int64_t impl) {
    TORCH_CHECK(!(impl == 2 && !cpu_has_avx512_vnni()), "this CPU has no AVX-512 VNNI");
    const bool vector = impl == 2 || (impl == 0 && cpu_has_avx512_vnni());
    TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "attention expects 3-D q, keys, values");
    TORCH_CHECK(q.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32 && values.dtype() == torch::kFloat32,
                "attention expects float32");
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "keys and values must be contiguous");
    q = q.contiguous();
    const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
    const int64_t kv_heads = keys.size(0), capacity = keys.size(1);
    TORCH_CHECK(head_dim % LANES == 0, "head_dim must be a multiple of 16, got ", head_dim);
    TORCH_CHECK(heads % kv_heads == 0 && keys.size(2) == head_dim, "query and key heads do not match");
    const bool tree = visible.numel() > 0;
    if (tree) {
        TORCH_CHECK(visible.dtype() == torch::kInt64 && lengths.dtype() == torch::kInt64 && visible.size(0) == rows,
                    "visible must be int64 [rows, width] with int64 lengths [rows]");
        visible = visible.contiguous();
        lengths = lengths.contiguous();
    } else {
        TORCH_CHECK(start + rows <= capacity, "the rows do not fit the cache");
    }
    auto out = torch::empty({rows, heads * head_dim}, torch::kFloat32);
    const float* qp = q.data_ptr<float>();
    const float* kp = keys.data_ptr<float>();
    const float* vp = values.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t* vis = tree ? visible.data_ptr<int64_t>() : nullptr;
    const int64_t* len = tree ? lengths.data_ptr<int64_t>() : nullptr;
    const int64_t width = tree ? visible.size(1) : 0, group = heads / kv_heads;
    for (int64_t i = 0; tree && i < rows; ++i)
        for (int64_t j = 0; j < len[i]; ++j)
            TORCH_CHECK(vis[i * width + j] >= 0 && vis[i * width + j] < capacity, "a visible slot is outside the cache");
    // work items: (row, KV head); the group's query heads are contiguous in q and out
    at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t index = begin; index < end; ++index) {
            const int64_t i = index / kv_heads, kvh = index % kv_heads;
            const int64_t count = tree ? len[i] : start + i + 1;
            for (int64_t h0 = 0; h0 < group; h0 += MAX_GROUP) {
                const int nq = (int)std::min<int64_t>(MAX_GROUP, group - h0);
                const int64_t h = kvh * group + h0;
                scores.resize(std::max<int64_t>(count, 1) * nq);
                attend_group(qp + (i * heads + h) * head_dim, nq, kp + kvh * capacity * head_dim, vp + kvh * capacity * head_dim,
                             head_dim, tree ? vis + i * width : nullptr, count, (float)scale, vector, scores.data(),
                             op + (i * heads + h) * head_dim);
            }
        }
    });
    return out;
}

// ---------------------------------------------------------------------------------------------
// Small row-local ops fused to save the per-op overhead of a 1..16-row decoder step.

// qkv [rows, (heads + 2 kv_heads) * head_dim]: rotates q and k by RoPE (half-split layout, Su et
// al. 2021) at `positions` [rows], writes k and v into cache slots start .. start + rows - 1 of
// keys / values [kv_heads, capacity, head_dim]; returns rotated q [rows, heads, head_dim].
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                         torch::Tensor keys, torch::Tensor values, int64_t start, int64_t heads) {
    TORCH_CHECK(qkv.dim() == 2 && qkv.dtype() == torch::kFloat32, "qkv must be [rows, width] float32");
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
                "cache and tables must be contiguous");
    qkv = qkv.contiguous();
    positions = positions.to(torch::kInt64).contiguous();
    const int64_t rows = qkv.size(0), kv_heads = keys.size(0), capacity = keys.size(1), dim = keys.size(2);
    TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv width does not match the heads");
    TORCH_CHECK(start + rows <= capacity, "the rows do not fit the cache");
    TORCH_CHECK(positions.numel() == rows, "one position per row");
    const int64_t half = dim / 2, width = qkv.size(1), table = cos.size(0);
    auto q = torch::empty({rows, heads, dim}, torch::kFloat32);
    const float* x = qkv.data_ptr<float>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < table, "position outside the RoPE table");
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    float* qo = q.data_ptr<float>();
    float* ko = keys.data_ptr<float>();
    float* vo = values.data_ptr<float>();
    for (int64_t i = 0; i < rows; ++i) {
        const float* ci = c + pos[i] * dim;
        const float* si = s + pos[i] * dim;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            const float* in = x + i * width + h * dim;
            float* out = h < heads ? qo + (i * heads + h) * dim : ko + ((h - heads) * capacity + start + i) * dim;
            for (int64_t d = 0; d < half; ++d) {
                const float a = in[d] * ci[d], b = (-in[d + half]) * si[d];
                out[d] = a + b;
                const float e = in[d + half] * ci[d + half], f = in[d] * si[d + half];
                out[d + half] = e + f;
            }
        }
        for (int64_t h = 0; h < kv_heads; ++h)
            std::memcpy(vo + (h * capacity + start + i) * dim, x + i * width + (heads + kv_heads + h) * dim, dim * sizeof(float));
    }
    return q;
}

// gate_up [rows, 2 * ffn] -> silu(gate) * up [rows, ffn] (SwiGLU, Shazeer 2020).
// One row: out[j] = gate[j] / (1 + exp(-gate[j])) * up[j], element by element.
__attribute__((target_clones("avx512f", "avx2", "default")))
void silu_mul_row(const float* gate, const float* up, int64_t n, float* out) {
    for (int64_t j = 0; j < n; ++j) {
        const float v = gate[j];
        out[j] = (v / (1.0f + exp_clamped(-v))) * up[j];
    }
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.dtype() == torch::kFloat32 && gate_up.size(1) % 2 == 0,
                "gate_up must be [rows, 2 * ffn] float32");
    gate_up = gate_up.contiguous();
    const int64_t rows = gate_up.size(0), ffn = gate_up.size(1) / 2;
    auto out = torch::empty({rows, ffn}, torch::kFloat32);
    const float* g = gate_up.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) silu_mul_row(g + r * 2 * ffn, g + r * 2 * ffn + ffn, ffn, o + r * ffn);
    });
    return out;
}

bool has_avx512_vnni() { return cpu_has_avx512_vnni(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("repack", &repack, "GGUF blocks [out, in / block] -> 16-column interleaved tiles");
    m.def("requantize_4bit", &requantize_4bit, "GGUF blocks -> Q4_0 or IQ4_NL blocks (a draft model at 4.5 bits per weight)");
    m.def("requantize_int8", &requantize_int8, "GGUF blocks -> per-row int8 weights and scales (the int8 runner)");
    m.def("dequantize", &dequantize, "GGUF blocks [out, in / block] -> float32 [out, in]");
    m.def("linear", &linear, "x [rows, in] float32 times repacked GGUF weights -> [rows, padded out]");
    m.def("attention", &attention, "causal or tree attention over a static KV cache, one (row, head) at a time");
    m.def("rope_store", &rope_store, "RoPE on q and k, k and v into the KV cache; returns rotated q");
    m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up row block");
    m.def("has_avx512_vnni", &has_avx512_vnni, "whether this CPU runs the AVX-512 VNNI path");
}
