// Re-quantization of de-quantized weights into 4.5-bit blocks (Q4_0 and IQ4_NL), for a draft
// model read at 4.5 bits per weight. The IQ4_NL scale search's float sums have one order
// (fit_iq4_nl_*: lanes l and l + 16, then folded l + 8, l + 4, l + 2, l + 1) on every ISA.

#include <algorithm>
#include <cmath>

#include "core.h"

namespace vsk {

// One block of 32 values -> Q4_0 as ggml's quantize_row_q4_0_ref and gguf-py's
// Q4_0.quantize_blocks do, in float32: m = the value of largest magnitude (the first such),
// d = m / -8, q = min(15, trunc(x * (1 / d) + 8.5)), d stored as fp16 (nearest even).
void quantize_block_q4_0(const float* x, uint8_t* o) {
    float m = x[0], amax = std::fabs(x[0]);  // the first such value, signed zero included
    for (int i = 1; i < 32; ++i)
        if (std::fabs(x[i]) > amax) { amax = std::fabs(x[i]); m = x[i]; }
    const float d = m / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = float_to_half(d);
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

int nearest_iq4_nl(float v) {
    if (!(v > -128.0f)) return 0;  // below every level (and NaN)
    if (v >= 128.0f) return 15;
    const float v2 = 2.0f * v;  // exact; |v2| < 256
    int j = (int)v2;            // toward zero, then up to ceil(v2) (no libm call)
    j += (float)j < v2;
    return NEAREST_IQ4_NL.table[j + 256];
}

// One block of 32 values -> IQ4_NL, the search of llama.cpp's IQ4_NL quantizer without an
// importance matrix (ggml-quants.c): weights w = x^2; for the scale m / 127 and the 15 scales
// m / (t - 127), t in -7..7 (m, the first value of largest magnitude, near the level -127), pick
// levels nearest to x / scale and keep the least-squares scale sum(w q x) / sum(w q^2) with the
// largest sum(w q x)^2 / sum(w q^2) (float sums in fit_iq4_nl's order); the levels are then chosen
// again for the kept scale, which is stored as fp16. Every ISA's fit gives the same bits.
void quantize_block_iq4_nl(const float* x, uint8_t* o, Isa isa) {
    float amax = 0.0f, m = 0.0f;
    for (int i = 0; i < 32; ++i)
        if (std::fabs(x[i]) > amax) { amax = std::fabs(x[i]); m = x[i]; }
    uint8_t levels[32] = {0};
    float d = 0.0f;
    if (amax >= 1e-15f) {
        float w[32];
        for (int i = 0; i < 32; ++i) w[i] = x[i] * x[i];
        const auto fit_iq4_nl = kernel_table(isa).fit_iq4_nl;
        auto fit = [&](float inv, float& sumqx, float& sumq2) { fit_iq4_nl(x, w, inv, sumqx, sumq2); };
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
    const uint16_t dh = float_to_half(d);
    std::memcpy(o, &dh, 2);
    for (int i = 0; i < 16; ++i) o[2 + i] = (uint8_t)(levels[i] | (levels[16 + i] << 4));
}

// raw [out * row_bytes] uint8 of any supported type -> Q4_0 or IQ4_NL blocks [out * in / 32 * 18]
// uint8: each row de-quantized (as dequantize) and quantized 32 values at a time (above).

}  // namespace vsk
