// Block formats: decoding one GGUF block into integer weights, the repacked 16-column tile
// layout every ISA reads, and ggml's de-quantization formulas. Knows nothing about products.

#include "core.h"

#include <cmath>

namespace vsk {

void fail(const std::string& message) { throw std::runtime_error(message); }

float half_to_float(uint16_t h) {
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

// Round to nearest even by letting the float adder do it: |f| is scaled so that adding a power of
// two whose last mantissa bit weighs one half-precision ulp of f leaves f's half mantissa in the
// low bits (Maratea's trick, as the FP16 library that c10::Half uses); NaN becomes 0x7E00.
uint16_t float_to_half(float f) {
    uint32_t w;
    std::memcpy(&w, &f, 4);
    const uint32_t twice = w + w, sign = w & 0x80000000u;
    float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;  // overflow to infinity, subnormals kept
    uint32_t bias = twice & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float shift;
    std::memcpy(&shift, &bias_bits, 4);
    base = shift + base;
    uint32_t bits;
    std::memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (twice > 0xFF000000u ? 0x7E00u : nonsign));
}

namespace {

// The per-block steps of each format, explicit specializations of three templates (inlined into
// the format's row loops below, instantiated per format by FORMATS):
//   decode<QT>: one GGUF block -> integer weights (IQ4_NL: q is the index of the level);
//   write_column<QT>: column c (0..15) of one tile block;
//   dequantize<QT>: one decoded block -> block_k floats, ggml's formulas.
// Tile block layouts (bytes; [a][b] is row-major):
//  Q4_K: d u16[16] | dmin u16[16] | scale[8][16] | min[4][16][2] | qs[p<4][g<8][c][t<4] nibbles:
//        low = q(64p+4g+t), high = q(64p+32+4g+t)
//  Q6_K: d u16[16] | scale[8][16][2] int8 | per pair p<8: N[h<4][c][t] (low nibble q(32p+4h+t),
//        high nibble q(32p+16+4h+t)), H[e<2][c][t] (bits 2h..2h+1 = q(32p+16e+4h+t) >> 4)
//  Q4_0, IQ4_NL: d u16[16] | N[h<4][c][t] (low q(4h+t), high q(16+4h+t))
//  Q5_0: d u16[16] | N[h<4][c][t] (low q(4h+t), high q(16+4h+t)) | H[c][t] (bit g = q(4g+t) >> 4)
//  Q8_0: d u16[16] | W[g<8][c][t] int8 = q(4g+t)
// Every 64-byte run [..][c][t] holds 4 consecutive values of each of the 16 columns: one 512-bit
// register, two 256-bit ones (columns 0-7, 8-15) or four 128-bit ones.
template <int64_t QT> void decode(const uint8_t* raw, Decoded& out);
template <int64_t QT> void write_column(const Decoded& b, uint8_t* tile, int c);
template <int64_t QT> void dequantize(const Decoded& b, float* y);

// Q4_K
template <> inline void decode<Q4_K>(const uint8_t* raw, Decoded& out) {
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
}

template <> inline void write_column<Q4_K>(const Decoded& b, uint8_t* tile, int c) {
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
}

template <> inline void dequantize<Q4_K>(const Decoded& b, float* y) {
    const float d = half_to_float(b.d), dmin = half_to_float(b.dmin);
    for (int j = 0; j < 8; ++j) {
        const float scale = d * (float)b.scale[j], mins = dmin * (float)b.min[j];
        for (int i = 0; i < 32; ++i) y[32 * j + i] = scale * (float)b.q[32 * j + i] - mins;
    }
}

// Q6_K
template <> inline void decode<Q6_K>(const uint8_t* raw, Decoded& out) {
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
}

template <> inline void write_column<Q6_K>(const Decoded& b, uint8_t* tile, int c) {
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
}

template <> inline void dequantize<Q6_K>(const Decoded& b, float* y) {
    const float d = half_to_float(b.d);
    for (int j = 0; j < 16; ++j) {
        const float scale = d * (float)(int8_t)b.scale[j];
        for (int i = 0; i < 16; ++i) y[16 * j + i] = scale * (float)((int)b.q[16 * j + i] - 32);
    }
}

// The 32-value formats: Q4_0 and IQ4_NL share the nibbles, Q5_0 adds a fifth bit, Q8_0 is int8.
inline void decode_nibbles(const uint8_t* raw, Decoded& out) {
    out.d = load_u16(raw);
    const uint8_t* qs = raw + 2;
    for (int i = 0; i < 16; ++i) {
        out.q[i] = qs[i] & 0xF;
        out.q[16 + i] = qs[i] >> 4;
    }
}

inline void write_nibbles(const Decoded& b, uint8_t* tile, int c) {
    std::memcpy(tile + 2 * c, &b.d, 2);
    for (int h = 0; h < 4; ++h)
        for (int t = 0; t < 4; ++t)
            tile[32 + 64 * h + 4 * c + t] = (uint8_t)((b.q[4 * h + t] & 0xF) | ((b.q[16 + 4 * h + t] & 0xF) << 4));
}

template <> inline void decode<Q4_0>(const uint8_t* raw, Decoded& out) { decode_nibbles(raw, out); }
template <> inline void write_column<Q4_0>(const Decoded& b, uint8_t* tile, int c) { write_nibbles(b, tile, c); }
template <> inline void dequantize<Q4_0>(const Decoded& b, float* y) {
    const float d = half_to_float(b.d);
    for (int i = 0; i < 32; ++i) y[i] = d * (float)((int)b.q[i] - 8);
}

template <> inline void decode<IQ4_NL>(const uint8_t* raw, Decoded& out) { decode_nibbles(raw, out); }
template <> inline void write_column<IQ4_NL>(const Decoded& b, uint8_t* tile, int c) { write_nibbles(b, tile, c); }
template <> inline void dequantize<IQ4_NL>(const Decoded& b, float* y) {
    const float d = half_to_float(b.d);
    for (int i = 0; i < 32; ++i) y[i] = d * (float)IQ4_NL_VALUES[b.q[i]];
}

template <> inline void decode<Q5_0>(const uint8_t* raw, Decoded& out) {
    out.d = load_u16(raw);
    uint32_t qh;
    std::memcpy(&qh, raw + 2, 4);
    const uint8_t* qs = raw + 6;
    for (int i = 0; i < 32; ++i) {
        const int lo = i < 16 ? (qs[i] & 0xF) : (qs[i - 16] >> 4);
        out.q[i] = (uint8_t)(lo | (((qh >> i) & 1) << 4));
    }
}

template <> inline void write_column<Q5_0>(const Decoded& b, uint8_t* tile, int c) {
    write_nibbles(b, tile, c);
    for (int t = 0; t < 4; ++t) {
        uint8_t bits = 0;
        for (int g = 0; g < 8; ++g) bits |= (uint8_t)(((b.q[4 * g + t] >> 4) & 1) << g);
        tile[288 + 4 * c + t] = bits;
    }
}

template <> inline void dequantize<Q5_0>(const Decoded& b, float* y) {
    const float d = half_to_float(b.d);
    for (int i = 0; i < 32; ++i) y[i] = d * (float)((int)b.q[i] - 16);
}

template <> inline void decode<Q8_0>(const uint8_t* raw, Decoded& out) {
    out.d = load_u16(raw);
    std::memcpy(out.q, raw + 2, 32);
}

template <> inline void write_column<Q8_0>(const Decoded& b, uint8_t* tile, int c) {
    std::memcpy(tile + 2 * c, &b.d, 2);
    for (int g = 0; g < 8; ++g)
        for (int t = 0; t < 4; ++t) tile[32 + 64 * g + 4 * c + t] = b.q[4 * g + t];
}

template <> inline void dequantize<Q8_0>(const Decoded& b, float* y) {
    const float d = half_to_float(b.d);
    for (int i = 0; i < 32; ++i) y[i] = (float)(int8_t)b.q[i] * d;
}

// The row loops every format shares, one instantiation per format (BlockTraits::repack_tiles,
// ::dequantize_row): the format is fixed before the loops, its per-block steps inlined.
template <int64_t QT>
void repack_format(const uint8_t* raw, int64_t out_features, int64_t nblocks, uint8_t* packed, int64_t t0, int64_t t1) {
    const BlockTraits& f = block_traits(QT);
    Decoded block;
    for (int64_t t = t0; t < t1; ++t)
        for (int c = 0; c < TILE; ++c) {
            const int64_t col = t * TILE + c;
            if (col >= out_features) continue;  // padding columns stay zero (d = 0)
            for (int64_t b = 0; b < nblocks; ++b) {
                std::memset(&block, 0, sizeof block);
                decode<QT>(raw + (col * nblocks + b) * f.raw_bytes, block);
                write_column<QT>(block, packed + (t * nblocks + b) * f.tile_bytes, c);
            }
        }
}

template <int64_t QT>
void dequantize_format(const uint8_t* raw, int64_t nblocks, float* out) {
    const BlockTraits& f = block_traits(QT);
    Decoded b;
    for (int64_t blk = 0; blk < nblocks; ++blk) {
        decode<QT>(raw + blk * f.raw_bytes, b);
        dequantize<QT>(b, out + blk * f.block_k);
    }
}

void quantize_q4_0(const float* x, uint8_t* out, Isa) { quantize_block_q4_0(x, out); }  // one path for every ISA

// The traits table: one row per block format, in QTYPES order (ggml's type_traits). It owns what
// the format-independent code asks about a format: sizes, activation layout, and the row-level
// repack / de-quantize / re-quantize functions. The tile products are not here: each ISA file owns
// its per-format table of tile kernels.
constexpr BlockTraits FORMATS[] = {
    // qtype, name, block_k, raw_bytes, tile_bytes, k_quant, offset, repack_tiles, dequantize_row, quantize_block
    {Q4_K, "Q4_K", 256, 144, 2368, true, false, repack_format<Q4_K>, dequantize_format<Q4_K>, nullptr},
    {Q6_K, "Q6_K", 256, 210, 3360, true, false, repack_format<Q6_K>, dequantize_format<Q6_K>, nullptr},
    {Q4_0, "Q4_0", 32, 18, 288, false, false, repack_format<Q4_0>, dequantize_format<Q4_0>, quantize_q4_0},
    {IQ4_NL, "IQ4_NL", 32, 18, 288, false, false, repack_format<IQ4_NL>, dequantize_format<IQ4_NL>,
     quantize_block_iq4_nl},
    {Q5_0, "Q5_0", 32, 22, 352, false, false, repack_format<Q5_0>, dequantize_format<Q5_0>, nullptr},
    {Q8_0, "Q8_0", 32, 34, 544, false, true, repack_format<Q8_0>, dequantize_format<Q8_0>, nullptr},
};
static_assert(in_format_order(FORMATS), "FORMATS: one row per format, in QTYPES order");

}  // namespace

const BlockTraits* find_block_traits(int64_t qtype) {
    for (int i = 0; i < NUM_FORMATS; ++i)
        if (QTYPES[i] == qtype) return &FORMATS[i];
    return nullptr;
}

int format_index(int64_t qtype) {
    const BlockTraits* f = find_block_traits(qtype);
    if (f == nullptr) fail("unsupported GGUF block type " + std::to_string(qtype));
    return (int)(f - FORMATS);
}

const BlockTraits& block_traits(int64_t qtype) { return FORMATS[format_index(qtype)]; }

void repack_tiles(int64_t qtype, const uint8_t* raw, int64_t out_features, int64_t nblocks, uint8_t* packed, int64_t t0,
                  int64_t t1) {
    block_traits(qtype).repack_tiles(raw, out_features, nblocks, packed, t0, t1);
}

void dequantize_row(int64_t qtype, const uint8_t* raw, int64_t nblocks, float* out) {
    block_traits(qtype).dequantize_row(raw, nblocks, out);
}

}  // namespace vsk
