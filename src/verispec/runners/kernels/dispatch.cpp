// Which path runs: the CPU's features, the ISA names, forcing one, each ISA's kernel table, and the
// product loop that hands tiles and row blocks to the chosen ISA. Knows nothing about torch.

#include <algorithm>

#include "core.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

namespace vsk {

namespace {

struct Features {
    bool avx2 = false, fma = false, f16c = false, avxvnni = false, avx512 = false, neon_dotprod = false, i8mm = false;
};

Features detect() {
    Features f;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx)) f.f16c = (ecx & bit_F16C) != 0;
    if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) f.avxvnni = f.avx2 && ((eax >> 4) & 1);  // EAX[4]: AVX-VNNI
#ifdef VSK_EMULATE_AVXVNNI  // the harness's emulated AVX-VNNI build (x86_avx2.cpp dot4)
    f.avxvnni = f.avx2;
#endif
    f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni");
#elif defined(__aarch64__)
#if defined(__linux__)
    f.neon_dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
    f.i8mm = f.neon_dotprod && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#else
#if defined(__ARM_FEATURE_DOTPROD)
    f.neon_dotprod = true;
#endif
#if defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_MATMUL_INT8)
    f.i8mm = true;
#endif
#endif
#endif
    return f;
}

const Features& features() {
    static const Features f = detect();
    return f;
}

}  // namespace

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::Auto: return "auto";
        case Isa::Portable: return "portable";
        case Isa::Avx512: return "avx512";
        case Isa::Avx2: return "avx2";
        case Isa::AvxVnni: return "avxvnni";
        case Isa::Neon: return "neon";
    }
    return "?";
}

std::string cpu_features() {
    const Features& f = features();
    std::string s;
    auto add = [&](bool has, const char* name) {
        if (has) s += (s.empty() ? "" : " ") + std::string(name);
    };
    add(f.avx2, "avx2");
    add(f.fma, "fma");
    add(f.f16c, "f16c");
#ifdef VSK_EMULATE_AVXVNNI
    add(f.avxvnni, "avxvnni(emulated)");
#else
    add(f.avxvnni, "avxvnni");
#endif
    add(f.avx512, "avx512f+bw+vl+dq+vnni");
    add(f.neon_dotprod, "neon+dotprod");
    add(f.i8mm, "i8mm");
    return s.empty() ? "none of avx2, avx512, neon dotprod" : s;
}

bool neon_has_i8mm() { return features().i8mm; }

bool isa_supported(Isa isa) {
    const Features& f = features();
    switch (isa) {
        case Isa::Portable: return true;
        case Isa::Avx512: return f.avx512 && f.f16c && f.fma;
        case Isa::Avx2: return f.avx2 && f.fma && f.f16c;
        case Isa::AvxVnni: return f.avx2 && f.fma && f.f16c && f.avxvnni;
        case Isa::Neon: return f.neon_dotprod;
        default: return false;
    }
}

Isa best_isa() {
    for (Isa isa : {Isa::Avx512, Isa::AvxVnni, Isa::Avx2, Isa::Neon})
        if (isa_supported(isa)) return isa;
    return Isa::Portable;
}

Isa resolve_isa(int64_t impl) {
    VSK_CHECK(impl >= 0 && impl < NUM_ISAS, "unknown kernel ISA number " + std::to_string(impl));
    const Isa isa = (Isa)impl;
    if (isa == Isa::Auto) return best_isa();
    VSK_CHECK(isa_supported(isa), std::string("this CPU cannot run the ") + isa_name(isa) + " kernels (it has: " +
                                      cpu_features() + ")");
    return isa;
}

const KernelTable& kernel_table(Isa isa) {
    static const KernelTable tables[NUM_ISAS] = {
        {},  // Auto: resolved below
        {quantize_block_portable, tile_portable, scores_portable, weighted_sum_portable, softmax_numerators_portable,
         silu_mul_row_portable, gelu_mul_row_portable, fit_iq4_nl_portable},
        // AVX-512: the portable row ops, which GCC vectorises for AVX-512 (row_ops.cpp)
        {quantize_block_avx512, tile_avx512, scores_avx512, weighted_sum_avx512, softmax_numerators_portable,
         silu_mul_row_portable, gelu_mul_row_portable, fit_iq4_nl_avx512},
        {quantize_block_avx2, tile_avx2, scores_avx2, weighted_sum_avx2, softmax_numerators_avx2, silu_mul_row_avx2,
         gelu_mul_row_avx2, fit_iq4_nl_avx2},
        {quantize_block_avx2, tile_avxvnni, scores_avx2, weighted_sum_avx2, softmax_numerators_avx2, silu_mul_row_avx2,
         gelu_mul_row_avx2, fit_iq4_nl_avx2},
        {quantize_block_neon, tile_neon, scores_neon, weighted_sum_neon, softmax_numerators_neon, silu_mul_row_neon,
         gelu_mul_row_neon, fit_iq4_nl_neon},
    };
    return tables[(int)resolve_isa((int64_t)isa)];
}

void prepare_activations(Activations& a, int64_t rows, int64_t in, int block_k, bool offset) {
    a.rows = rows;
    a.in = in;
    a.block_k = block_k;
    a.offset = offset;
    a.q.resize(rows * in);
    a.d.resize(rows * (in / block_k));
    a.s16.resize(rows * (in / 16));
    a.s32.resize(rows * (in / 32));
}

void quantize_activation_rows(const float* x, Activations& a, int64_t r0, int64_t r1, Isa isa) {
    const int64_t in = a.in, nb = in / a.block_k;
    const auto quantize_block = kernel_table(isa).quantize_block;
    for (int64_t r = r0; r < r1; ++r) {
        const float* xr = x + r * in;
        int8_t* qr = a.q.data() + r * in;
        for (int64_t b = 0; b < nb; ++b) {
            float* d = a.d.data() + r * nb + b;
            const float* xb = xr + b * a.block_k;
            int8_t* qb = qr + b * a.block_k;
            quantize_block(xb, a.block_k, qb, d);
        }
        for (int64_t j = 0; j < in / 16; ++j) {
            int s = 0;
            for (int i = 0; i < 16; ++i) s += qr[16 * j + i];
            a.s16[r * (in / 16) + j] = (int16_t)s;
        }
        for (int64_t j = 0; j < in / 32; ++j)
            a.s32[r * (in / 32) + j] = (int16_t)(a.s16[r * (in / 16) + 2 * j] + a.s16[r * (in / 16) + 2 * j + 1]);
        if (a.offset)
            for (int64_t i = 0; i < in; ++i) qr[i] = (int8_t)((uint8_t)qr[i] ^ 0x80);
    }
}

void linear_tiles(int64_t qtype, const uint8_t* packed, int64_t nblocks, const Activations& act, float* out, int64_t ldo,
                  int64_t row_begin, int64_t row_end, int64_t t0, int64_t t1, Isa isa) {
    const BlockTraits& f = block_traits(qtype);  // the format's row, once per call (fails for an unknown type)
    const int format = format_index(qtype);
    const auto tile = kernel_table(isa).tile;
    for (int64_t t = t0; t < t1; ++t)
        for (int64_t r = row_begin; r < row_end; r += MAX_TILE_ROWS) {
            const TileArgs args{packed + t * nblocks * f.tile_bytes, nblocks, &act, r,
                                (int)std::min<int64_t>(MAX_TILE_ROWS, row_end - r), out + r * ldo + t * TILE, ldo};
            tile(format, args);
        }
}

}  // namespace vsk
