// One-core time of the gguf kernels' tile products on random blocks, torch-free: the way to compare
// two builds of the kernel core (run them alternately, alone; this kind of host drifts by up to 2x
// within an hour, so only alternated pairs compare).
//
//   K=src/verispec/runners/kernels
//   g++ -O3 -std=c++17 -ffp-contract=off -fno-math-errno -I$K scripts/tile_bench.cpp $K/formats.cpp \
//       $K/portable.cpp $K/dispatch.cpp $K/attention.cpp $K/row_ops.cpp $K/requantize.cpp $K/x86_avx512.cpp \
//       $K/x86_avx2.cpp $K/arm_neon.cpp $K/arm_neon_float.cpp -o tile_bench
//   ../shared/tools/alone ./tile_bench QTYPE ISA OUT ROWS [REPS]     (from the repo root)
//   ../shared/tools/alone ./tile_bench peak    one core's vpmaddubsw + vpaddw chain (x86): the
//       ceiling of the AVX2 products without VNNI, and a reading of how busy the host's cores are
//
// QTYPE: the GGUF type number (Q4_0 2, Q5_0 6, Q8_0 8, Q4_K 12, Q6_K 14, IQ4_NL 20); ISA: the
// kernels' path number (1 portable, 2 avx512, 3 avx2, 4 avxvnni, 5 neon); a matrix of OUT x 1536;
// prints "k=ROWS <best ms of REPS> ms <GMAC/s> GMAC/s" (GMAC/s: int8 multiply-adds per second).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core.h"

using namespace vsk;

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

#if defined(__x86_64__)
// 8 independent vpmaddubsw + vpaddw chains: 32 multiply-adds per vpmaddubsw.
__attribute__((target("avx2"))) static double peak_gmacs(long iterations) {
    __m256i acc[8];
    const __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
    for (auto& a : acc) a = _mm256_setzero_si256();
    const double t = now();
    for (long i = 0; i < iterations; ++i) {
        for (auto& a : acc) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x));
        asm volatile("" : : "x"(w), "x"(x));
    }
    const double seconds = now() - t;
    int sink = 0;
    for (auto& a : acc) sink += _mm256_extract_epi16(a, 0);
    if (sink == 12345) std::printf(" ");
    return iterations * 8.0 * 32 / seconds / 1e9;
}
#endif

static int run(int argc, char** argv) {
#if defined(__x86_64__)
    if (argc == 2 && std::strcmp(argv[1], "peak") == 0) {
        std::printf("peak vpmaddubsw + vpaddw: %.1f GMAC/s (one core)\n", peak_gmacs(50000000));
        return 0;
    }
#endif
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s QTYPE ISA OUT ROWS [REPS]\n", argv[0]);
        return 2;
    }
    const int64_t qt = std::atoll(argv[1]), out = std::atoll(argv[3]), k = std::atoll(argv[4]), in = 1536;
    const Isa isa = resolve_isa(std::atoi(argv[2]));
    const int reps = argc > 5 ? std::atoi(argv[5]) : 200;
    const Format f = format_of(qt);
    const int64_t nb = in / f.block_k, ntiles = (out + TILE - 1) / TILE;
    std::mt19937 rng(1);
    std::vector<uint8_t> raw(out * nb * f.raw_bytes);
    for (auto& b : raw) b = (uint8_t)rng();
    const uint16_t scale = float_to_half(0.01f);  // finite scales where the format keeps them
    const int scale_at = qt == Q6_K ? 208 : 0;
    for (int64_t i = 0; i < out * nb; ++i) {
        std::memcpy(&raw[i * f.raw_bytes + scale_at], &scale, 2);
        if (qt == Q4_K) std::memcpy(&raw[i * f.raw_bytes + 2], &scale, 2);
    }
    std::vector<uint8_t> packed(ntiles * nb * f.tile_bytes, 0);
    repack_tiles(qt, raw.data(), out, nb, packed.data(), 0, ntiles);
    std::vector<float> x(k * in);
    std::normal_distribution<float> normal;
    for (auto& v : x) v = normal(rng);
    Activations a;
    prepare_activations(a, k, in, f.block_k, qt == Q8_0);
    quantize_activation_rows(x.data(), a, 0, k, isa);
    std::vector<float> y(k * ntiles * TILE);
    double best = 1e9;
    for (int r = 0; r < reps; ++r) {
        const double t = now();
        linear_tiles(qt, packed.data(), nb, a, y.data(), ntiles * TILE, 0, k, 0, ntiles, isa);
        best = std::min(best, now() - t);
    }
    std::printf("k=%lld %.5f ms %.1f GMAC/s\n", (long long)k, best * 1e3, (double)k * in * out / best / 1e9);
    return 0;
}

int main(int argc, char** argv) {
    try {
        return run(argc, argv);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
}
