// Bit-identity harness for verispec's kernel core, torch-free (built by run_harness.sh, natively
// and for AArch64 under qemu): every instruction-set path the CPU runs is compared with the
// portable path (portable.cpp, the oracle) byte for byte (memcmp, NaN payloads and signed zeros
// included) on
//   - tile products of every block type (random raw blocks with finite fp16 scales, as
//     tests/gguf_reference.py's random_blocks; blocks of any finite scale; saturated and zero
//     blocks), several shapes (out_features not a multiple of 16, several blocks), k = 1..16
//     activation rows: random, exact .5 ties, all zero, one huge block, negative zeros, NaN,
//     infinities, subnormals, values at the int8 clamp;
//   - activation quantization (quantize_activation_rows: q, d and the 16/32-value sums);
//   - attention chains (causal, several starts, sliding windows) and trees (slot lists, short and empty rows), head_dim
//     16..128, GQA groups (14/2, 12/2, 3/1, 34/2: one group above MAX_GROUP), NaN payloads; and the
//     scores / weighted sums directly for many key counts;
//   - the IQ4_NL fit (fit_iq4_nl_*) and quantize_block_iq4_nl over random and edge blocks.
// It also checks quantize_block_q4_0 (one implementation) against ggml's formula, and prints a
// digest of every oracle result (NaNs folded to one pattern) so that the portable path's results
// on two architectures can be compared. One line per (ISA, check); exit status 1 on any mismatch,
// 2 on a usage error (an unknown ISA, or a requested one this CPU cannot run).
//
// Usage: harness [--isas portable,avx512,avx2,avxvnni,neon] [--digests]   (default: all of them,
// those this CPU cannot run are skipped and named; portable in the list compares the oracle with a
// second run; --digests prints each check's oracle digest)

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core.h"

using namespace vsk;

namespace {

// ---------------------------------------------------------------------------------------------
// Inputs: a deterministic generator in plain integer and float arithmetic (no libm), so both
// architectures draw the same inputs.

struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
    uint64_t next() {  // splitmix64
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    double unit() { return (double)(next() >> 11) * 0x1.0p-53; }  // [0, 1)
    float uniform(float lo, float hi) { return (float)(lo + (hi - lo) * unit()); }
    float normal() { return (float)((unit() + unit() + unit() + unit() - 2.0) * 1.7320508075688772); }  // mean 0, sd 1
    int below(int n) { return (int)(next() % (uint64_t)n); }
};

float bits_float(uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}

const int64_t TYPES[] = {Q4_K, Q6_K, Q4_0, IQ4_NL, Q5_0, Q8_0};

const char* type_name(int64_t qtype) { return block_traits(qtype).name; }

// Block kinds: SANE as random_blocks (random bits, positive fp16 scales of about 1e-3); ANY_SCALE
// random bits with any finite fp16 scales (negative, subnormal, up to 65504); FULL and EMPTY every
// quant byte 0xFF / 0x00 with scales 1 (Q6_K's int8 scales -128, Q8_0 FULL weights -128): the
// largest integer sums.
enum Blocks { SANE, ANY_SCALE, FULL, EMPTY };
const char* blocks_name(Blocks kind) {
    switch (kind) {
        case SANE: return "random";
        case ANY_SCALE: return "any-scale";
        case FULL: return "full";
        default: return "empty";
    }
}

std::vector<uint8_t> random_blocks(int64_t qtype, int64_t out, int64_t in, Rng& rng, Blocks kind) {
    const BlockTraits& f = block_traits(qtype);
    const int64_t nblocks = out * (in / f.block_k);
    std::vector<uint8_t> raw(nblocks * f.raw_bytes);
    for (auto& byte : raw) byte = kind == FULL ? 0xFF : kind == EMPTY ? 0x00 : (uint8_t)rng.next();
    auto put = [](uint8_t* p, uint16_t h) { std::memcpy(p, &h, 2); };
    for (int64_t b = 0; b < nblocks; ++b) {
        uint8_t* blk = raw.data() + b * f.raw_bytes;
        const int d_at = qtype == Q6_K ? 208 : 0;
        if (qtype == Q6_K && (kind == FULL || kind == EMPTY)) std::memset(blk + 192, 0x80, 16);
        if (qtype == Q8_0 && kind == FULL) std::memset(blk + 2, 0x80, 32);
        for (int field = 0; field < (qtype == Q4_K ? 2 : 1); ++field) {
            uint16_t h;
            if (kind == SANE) {
                const float unit = qtype == Q6_K ? 1e-3f / 16 : qtype == IQ4_NL ? 1e-3f / 1.5f : 1e-3f;
                h = float_to_half(rng.uniform(0.2f, 1.0f) * unit);
            } else if (kind == ANY_SCALE) {
                h = (uint16_t)rng.next();
                if (((h >> 10) & 0x1F) == 0x1F) h &= 0xBFFF;  // infinity / NaN exponent -> finite
            } else {
                h = 0x3C00;  // 1.0
            }
            put(blk + d_at + 2 * field, h);
        }
    }
    return raw;
}

// 16 activation rows of `in` values, the interesting ones first (a k-row product sees rows 0..k-1).
std::vector<float> activation_rows(int64_t in, Rng& rng) {
    constexpr int ROWS = 16;
    std::vector<float> x(ROWS * in);
    for (auto& v : x) v = rng.normal();
    auto row = [&](int r) { return x.data() + r * in; };
    for (int64_t i = 0; i < in; ++i) {
        row(1)[i] = (float)(rng.below(252) - 126) + 0.5f;  // exact ties: scale 1 (127 in every block), q = round half even
        if (i % 32 == 0) row(1)[i] = 127.0f;
        row(2)[i] = 0.0f;                                         // all zero: d = 0
        if (i < 32) row(3)[i] *= 1000.0f;                         // one huge block
        if (i % 2 == 0) row(4)[i] = -0.0f;                        // negative zeros beside ordinary values
        row(6)[i] = 1.0f;                                         // q = 127 everywhere
        row(7)[i] = -1.0f;                                        // q = -127 everywhere
        row(8)[i] *= 1e-39f;                                      // subnormal values: 1 / d overflows
        row(9)[i] *= 1e36f;                                       // huge values: the float steps overflow
        row(10)[i] = (float)(rng.below(255) - 127);               // integers, exact at scale 1
        row(12)[i] *= 1e-3f;
        row(13)[i] *= 100.0f;
        row(15)[i] = (i % 2 ? -1.0f : 1.0f) * std::numeric_limits<float>::max();
    }
    row(5)[7] = std::numeric_limits<float>::quiet_NaN();  // NaN in one row
    row(11)[in / 3] = std::numeric_limits<float>::infinity();
    row(11)[1] = -std::numeric_limits<float>::infinity();
    row(14)[3] = bits_float(0x7F800001u);  // signalling NaNs, also last in a block (a lane's last value)
    row(14)[31] = bits_float(0x7F800001u);
    row(14)[in - 1] = bits_float(0x7F800002u);
    row(14)[9] = bits_float(0xFFC00123u);  // a negative quiet NaN with a payload
    return x;
}

// ---------------------------------------------------------------------------------------------
// Results: each check computes a Blob of named segments (output bytes) for one ISA; the oracle's
// blob and every ISA's must be byte-identical.

struct Segment {
    std::string name;
    std::vector<uint8_t> bytes;
    int elem;       // element size
    bool is_float;  // float32 elements (else integers, or 18-byte 4-bit blocks: fp16 scale first)
};

struct Blob {
    std::vector<Segment> segs;
    int cases = 0;
    void floats(const std::string& name, const float* p, size_t n) {
        segs.push_back({name, std::vector<uint8_t>((const uint8_t*)p, (const uint8_t*)(p + n)), 4, true});
    }
    template <typename T>
    void ints(const std::string& name, const T* p, size_t n) {
        segs.push_back({name, std::vector<uint8_t>((const uint8_t*)p, (const uint8_t*)(p + n)), (int)sizeof(T), false});
    }
    void blocks18(const std::string& name, const uint8_t* p, size_t n) {  // n Q4_0 / IQ4_NL blocks
        segs.push_back({name, std::vector<uint8_t>(p, p + 18 * n), 18, false});
    }
};

// FNV-1a over the oracle's results, every NaN folded to one pattern, fp16 scales of 18-byte blocks
// included (architectures differ in the default NaN's sign and in which operand's NaN an
// operation returns).
struct Digest {
    uint64_t h = 0xCBF29CE484222325ull;
    void byte(uint8_t b) { h = (h ^ b) * 0x100000001B3ull; }
    void add(const Blob& blob) {
        for (const Segment& s : blob.segs)
            for (size_t i = 0; i < s.bytes.size(); i += s.elem) {
                if (s.is_float) {
                    uint32_t b;
                    std::memcpy(&b, s.bytes.data() + i, 4);
                    if (std::isnan(bits_float(b))) b = 0x7FC00000u;
                    for (int k = 0; k < 4; ++k) byte((uint8_t)(b >> (8 * k)));
                } else if (s.elem == 18) {
                    uint16_t h;
                    std::memcpy(&h, s.bytes.data() + i, 2);
                    if ((h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0) h = 0x7E00;
                    byte((uint8_t)h);
                    byte((uint8_t)(h >> 8));
                    for (int k = 2; k < 18; ++k) byte(s.bytes[i + k]);
                } else {
                    for (int k = 0; k < s.elem; ++k) byte(s.bytes[i + k]);
                }
            }
    }
};

// The first difference between two blobs, in words ("" when identical).
std::string difference(const Blob& want, const Blob& got) {
    if (want.segs.size() != got.segs.size()) return "different segment counts";
    for (size_t s = 0; s < want.segs.size(); ++s) {
        const Segment &a = want.segs[s], &b = got.segs[s];
        if (a.bytes.size() != b.bytes.size()) return a.name + ": different sizes";
        if (std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0) continue;
        size_t i = 0;
        while (std::memcmp(a.bytes.data() + i, b.bytes.data() + i, a.elem) == 0) i += a.elem;
        size_t count = 0;
        for (size_t j = 0; j < a.bytes.size(); j += a.elem) count += std::memcmp(a.bytes.data() + j, b.bytes.data() + j, a.elem) != 0;
        char text[256];
        if (a.is_float) {
            uint32_t x, y;
            std::memcpy(&x, a.bytes.data() + i, 4);
            std::memcpy(&y, b.bytes.data() + i, 4);
            std::snprintf(text, sizeof text, "%s: %zu of %zu differ, first [%zu] portable %.9g (0x%08x) vs %.9g (0x%08x)",
                          a.name.c_str(), count, a.bytes.size() / 4, i / 4, bits_float(x), x, bits_float(y), y);
        } else if (a.elem > 8) {  // a block: its bytes in hex
            std::string x, y;
            char hex[3];
            for (int k = 0; k < a.elem; ++k) {
                std::snprintf(hex, sizeof hex, "%02x", a.bytes[i + k]);
                x += hex;
                std::snprintf(hex, sizeof hex, "%02x", b.bytes[i + k]);
                y += hex;
            }
            std::snprintf(text, sizeof text, "%s: %zu of %zu differ, first [%zu] portable %s vs %s", a.name.c_str(), count,
                          a.bytes.size() / a.elem, i / a.elem, x.c_str(), y.c_str());
        } else {
            int64_t x = 0, y = 0;
            std::memcpy(&x, a.bytes.data() + i, a.elem);
            std::memcpy(&y, b.bytes.data() + i, b.elem);
            std::snprintf(text, sizeof text, "%s: %zu of %zu differ, first [%zu] portable 0x%" PRIx64 " vs 0x%" PRIx64,
                          a.name.c_str(), count, a.bytes.size() / a.elem, i / a.elem, x, y);
        }
        return text;
    }
    return "";
}

// Output buffers start filled with a pattern that depends on the run, so that an element a path
// forgets to write differs from the oracle's.
uint8_t fill_byte(bool oracle) { return oracle ? 0xA5 : 0x5A; }

// ---------------------------------------------------------------------------------------------
// The per-ISA entry points, from the ISA's kernel table (dispatch.cpp).

ScoresFn scores_of(Isa isa) { return kernel_table(isa).scores; }
WeightedSumFn weighted_sum_of(Isa isa) { return kernel_table(isa).weighted_sum; }
using FitFn = void (*)(const float*, const float*, float, float&, float&);
FitFn fit_of(Isa isa) { return kernel_table(isa).fit_iq4_nl; }

// ---------------------------------------------------------------------------------------------

struct Harness {
    std::vector<Isa> isas;  // compared with the oracle
    int checks = 0, failures = 0;
    long cases = 0;
    Digest digest;
    bool print_digests = false;  // --digests: each check's oracle digest (to find where two builds differ)

    // One check: the oracle's blob, then each ISA's, compared; one line per ISA.
    void check(const std::string& what, const std::function<Blob(Isa, bool)>& compute) {
        Blob oracle;
        std::string oracle_error;
        try {
            oracle = compute(Isa::Portable, true);
        } catch (const std::exception& e) {
            oracle_error = e.what();
        }
        digest.add(oracle);
        if (print_digests) {
            Digest own;
            own.add(oracle);
            std::printf("digest    %-52s %016" PRIx64 "\n", what.c_str(), own.h);
        }
        for (Isa isa : isas) {
            ++checks;
            std::string result;
            int n = oracle.cases;
            if (!oracle_error.empty()) {
                result = "FAIL (the portable oracle threw: " + oracle_error + ")";
            } else {
                try {
                    const Blob got = compute(isa, false);
                    n = got.cases;
                    const std::string diff = difference(oracle, got);
                    result = diff.empty() ? "OK" : "MISMATCH " + diff;
                } catch (const std::exception& e) {
                    result = std::string("FAIL (threw: ") + e.what() + ")";
                }
            }
            if (result != "OK") ++failures;
            cases += n;
            std::printf("%-9s %-52s %6d cases  %s\n", isa_name(isa), what.c_str(), n, result.c_str());
            std::fflush(stdout);
        }
    }

    // Tile products: k = 1..16 rows (or a few row counts) of activations quantized by the portable
    // path (the quantization is checked on its own), all tiles of the matrix, padding included.
    void tiles(int64_t qtype, int64_t out, int64_t in, Blocks kind, bool every_k, uint64_t seed) {
        const BlockTraits& f = block_traits(qtype);
        Rng rng(seed);
        const std::vector<uint8_t> raw = random_blocks(qtype, out, in, rng, kind);
        const int64_t nblocks = in / f.block_k, ntiles = (out + TILE - 1) / TILE, ldo = ntiles * TILE;
        std::vector<uint8_t> packed(ntiles * nblocks * f.tile_bytes, 0);
        repack_tiles(qtype, raw.data(), out, nblocks, packed.data(), 0, ntiles);
        const std::vector<float> x = activation_rows(in, rng);
        Activations act;
        prepare_activations(act, 16, in, f.k_quant ? 256 : 32, qtype == Q8_0);
        quantize_activation_rows(x.data(), act, 0, 16, Isa::Portable);
        std::vector<int> ks;
        for (int k = 1; k <= 16; ++k)
            if (every_k || k == 1 || k == 3 || k == 8 || k == 11 || k == 16) ks.push_back(k);
        char what[96];
        std::snprintf(what, sizeof what, "tile %s %s out=%lld in=%lld k=%s", type_name(qtype), blocks_name(kind),
                      (long long)out, (long long)in, every_k ? "1..16" : "1,3,8,11,16");
        check(what, [&](Isa isa, bool oracle) {
            Blob blob;
            std::vector<float> y(16 * ldo);
            for (int k : ks) {
                std::memset(y.data(), fill_byte(oracle), y.size() * 4);
                linear_tiles(qtype, packed.data(), nblocks, act, y.data(), ldo, 0, k, 0, ntiles, isa);
                blob.floats("k=" + std::to_string(k), y.data(), k * ldo);
                ++blob.cases;
            }
            return blob;
        });
    }

    void quantization(int block_k, bool offset) {
        Rng rng(100 + block_k + offset);
        constexpr int64_t IN = 512;
        std::vector<float> x = activation_rows(IN, rng);
        std::vector<float> more = activation_rows(IN, rng);  // a second draw, scaled per row
        for (int r = 0; r < 16; ++r)
            for (int64_t i = 0; i < IN; ++i) more[r * IN + i] *= bits_float(0x3F800000u + (uint32_t)r * 0x01200000u);
        x.insert(x.end(), more.begin(), more.end());
        const int rows = 32;
        char what[96];
        std::snprintf(what, sizeof what, "quantize activations block_k=%d%s", block_k, offset ? " offset" : "");
        check(what, [&](Isa isa, bool oracle) {
            Activations a;
            prepare_activations(a, rows, IN, block_k, offset);
            std::memset(a.q.data(), fill_byte(oracle), a.q.size());
            std::memset(a.d.data(), fill_byte(oracle), a.d.size() * 4);
            quantize_activation_rows(x.data(), a, 0, rows, isa);
            Blob blob;
            blob.ints("q", a.q.data(), a.q.size());
            blob.floats("d", a.d.data(), a.d.size());
            blob.ints("s16", a.s16.data(), a.s16.size());
            blob.ints("s32", a.s32.data(), a.s32.size());
            blob.cases = rows;
            return blob;
        });
    }

    // attention_items over every (row, KV head): a chain (causal from `start`) or a tree (slot
    // lists of the given lengths).
    void attention(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t start, const std::vector<int64_t>& lengths,
                   bool nans, uint64_t seed, int64_t window = 0) {
        Rng rng(seed);
        const bool tree = !lengths.empty();
        const int64_t rows = tree ? (int64_t)lengths.size() : 5;
        const int64_t capacity = tree ? 40 : start + rows + 3;
        std::vector<float> q(rows * heads * head_dim), keys(kv_heads * capacity * head_dim), values(keys.size());
        for (auto& v : q) v = rng.normal();
        for (auto& v : keys) v = 3.0f * rng.normal();
        for (auto& v : values) v = rng.normal();
        if (nans) {  // NaNs with different payloads in a key and a query: the operand order shows
            keys[2 * head_dim + 5] = bits_float(0x7FC00011u);
            q[1 * heads * head_dim + 7] = bits_float(0xFFC00022u);
            values[((kv_heads - 1) * capacity + 1) * head_dim + 3] = bits_float(0x7FC00033u);  // last KV head, slot 1
        }
        int64_t width = 0;
        std::vector<int64_t> visible;
        if (tree) {
            width = *std::max_element(lengths.begin(), lengths.end());
            visible.assign(rows * width, 0);
            for (int64_t i = 0; i < rows; ++i) {
                std::vector<int64_t> slots(capacity);
                for (int64_t s = 0; s < capacity; ++s) slots[s] = s;
                for (int64_t s = 0; s < lengths[i]; ++s) std::swap(slots[s], slots[s + rng.below((int)(capacity - s))]);
                std::sort(slots.begin(), slots.begin() + lengths[i]);
                std::copy(slots.begin(), slots.begin() + lengths[i], visible.begin() + i * width);
            }
        }
        char what[96];
        if (tree)
            std::snprintf(what, sizeof what, "attention tree heads=%lld/%lld dim=%lld rows=%lld%s", (long long)heads,
                          (long long)kv_heads, (long long)head_dim, (long long)rows, nans ? " NaN" : "");
        else
            std::snprintf(what, sizeof what, "attention chain heads=%lld/%lld dim=%lld start=%lld window=%lld%s",
                          (long long)heads, (long long)kv_heads, (long long)head_dim, (long long)start, (long long)window,
                          nans ? " NaN" : "");
        check(what, [&](Isa isa, bool oracle) {
            std::vector<float> out(rows * heads * head_dim);
            std::memset(out.data(), fill_byte(oracle), out.size() * 4);
            AttentionArgs a{q.data(), keys.data(), values.data(), rows, heads, kv_heads, capacity, head_dim, start,
                            tree ? visible.data() : nullptr, tree ? lengths.data() : nullptr, width,
                            1.0f / std::sqrt((float)head_dim), out.data(), window};
            check_attention(a);
            attention_items(a, 0, attention_item_count(a), isa);
            Blob blob;
            blob.floats("out", out.data(), out.size());
            blob.cases = (int)(rows * kv_heads);
            return blob;
        });
    }

    // scores_* and weighted_sum_* directly: every key-count remainder, several query counts.
    void scores_and_sums(int64_t head_dim, bool use_slots) {
        Rng rng(200 + head_dim + use_slots);
        constexpr int64_t CAPACITY = 40;
        const int MAX_NQ = 7;
        std::vector<float> q(MAX_NQ * head_dim), keys(CAPACITY * head_dim), values(CAPACITY * head_dim), p(MAX_NQ * CAPACITY);
        for (auto& v : q) v = rng.normal();
        for (auto& v : keys) v = rng.normal();
        for (auto& v : values) v = rng.normal();
        for (auto& v : p) v = rng.uniform(0.0f, 1.0f);
        // Signed zeros: query 2 is all -0 and keys 0 and 5 (the first slot with and without the slot
        // list) all positive, so its products with them are all -0; its weights p are all 0 (below)
        // and values 0 and 5 all negative: the sums are +0 only because they start from 0 (0 + -0).
        for (int64_t c = 0; c < head_dim; ++c) {
            q[2 * head_dim + c] = -0.0f;
            for (int64_t s : {0, 5}) {
                keys[s * head_dim + c] = std::fabs(keys[s * head_dim + c]);
                values[s * head_dim + c] = -std::fabs(values[s * head_dim + c]);
            }
        }
        std::vector<int64_t> slots(CAPACITY);
        for (int64_t s = 0; s < CAPACITY; ++s) slots[s] = (s * 17 + 5) % CAPACITY;
        const int counts[] = {1, 2, 3, 4, 5, 7, 15, 16, 17, 33};
        const int nqs[] = {1, 2, 3, 7};
        char what[96];
        std::snprintf(what, sizeof what, "scores + weighted sums dim=%lld%s", (long long)head_dim, use_slots ? " slots" : "");
        check(what, [&](Isa isa, bool oracle) {
            Blob blob;
            for (int count : counts)
                for (int nq : nqs) {
                    std::vector<float> s(nq * count), o(nq * head_dim), pw(nq * count);  // pw: [nq][count]
                    for (int a = 0; a < nq; ++a)
                        for (int j = 0; j < count; ++j) pw[a * count + j] = a == 2 ? 0.0f : p[a * CAPACITY + j];
                    std::memset(s.data(), fill_byte(oracle), s.size() * 4);
                    std::memset(o.data(), fill_byte(oracle), o.size() * 4);
                    scores_of(isa)(q.data(), nq, keys.data(), head_dim, use_slots ? slots.data() : nullptr, count, 0.125f, s.data());
                    weighted_sum_of(isa)(pw.data(), nq, values.data(), head_dim, use_slots ? slots.data() : nullptr, count, o.data());
                    const std::string tag = "count=" + std::to_string(count) + " nq=" + std::to_string(nq);
                    blob.floats("scores " + tag, s.data(), s.size());
                    blob.floats("weighted " + tag, o.data(), o.size());
                    ++blob.cases;
                }
            return blob;
        });
    }

    // Blocks of 32 values for the re-quantizers: random at several scales, then edge blocks.
    static std::vector<std::vector<float>> requant_blocks() {
        Rng rng(300);
        std::vector<std::vector<float>> blocks;
        const float scales[] = {1.0f, 1e-3f, 37.5f, 1e-20f, 3e4f};
        for (int i = 0; i < 150; ++i) {
            std::vector<float> b(32);
            for (auto& v : b) v = rng.normal() * scales[i % 5];
            blocks.push_back(b);
        }
        auto add = [&](std::function<float(int)> f) {
            std::vector<float> b(32);
            for (int i = 0; i < 32; ++i) b[i] = f(i);
            blocks.push_back(b);
        };
        add([](int) { return 0.0f; });
        add([](int) { return -0.0f; });
        add([](int i) { return i == 9 ? 0.75f : 0.0f; });
        add([](int i) { return i == 9 ? -2.5f : 0.0f; });
        add([](int) { return 0.3f; });
        add([](int i) { return i % 2 ? -1.0f : 1.0f; });      // equal magnitudes: the first one is m
        add([](int i) { return i % 2 ? 1.0f : -1.0f; });
        add([](int i) { return (float)IQ4_NL_VALUES[i % 16] * 0.01f; });  // exactly on the levels
        add([](int i) {  // m = -127 (scale 1): the other values exactly on the midpoints between levels
            return i == 0 ? -127.0f : 0.5f * (float)(IQ4_NL_VALUES[i % 15] + IQ4_NL_VALUES[i % 15 + 1]);
        });
        add([](int i) { return i == 0 ? 127.0f : (float)(i * 8 - 128) + 0.5f; });  // Q4_0 ties at x * id + 8.5
        add([](int i) { return (float)(i - 16) * 1e-16f; });  // below IQ4_NL's 1e-15 threshold
        add([](int i) { return (float)(i - 16) * 1e-14f; });
        add([](int i) { return (float)(i - 16) * 1e-40f; });  // subnormal
        add([](int i) { return (float)(i - 16) * 7e4f; });    // the fp16 scale overflows
        add([](int i) { return (float)(i - 16) * 1e37f; });
        add([](int i) { return i == 4 ? std::numeric_limits<float>::quiet_NaN() : (float)(i - 16); });
        add([](int i) { return i == 4 ? std::numeric_limits<float>::infinity() : (float)(i - 16); });
        add([](int i) { return i == 4 ? -std::numeric_limits<float>::infinity() : (float)(i - 16); });
        return blocks;
    }

    void iq4_nl() {
        const auto blocks = requant_blocks();
        check("fit_iq4_nl (" + std::to_string(blocks.size()) + " blocks x 20 scales)", [&](Isa isa, bool) {
            std::vector<float> sums;
            for (const auto& x : blocks) {
                float w[32], m = 0.0f, amax = 0.0f;
                for (int i = 0; i < 32; ++i) {
                    w[i] = x[i] * x[i];
                    if (std::fabs(x[i]) > amax) { amax = std::fabs(x[i]); m = x[i]; }
                }
                std::vector<float> invs = {m != 0.0f ? 127.0f / m : 1.0f, 0.0f, 1.0f, -3.25f,
                                           std::numeric_limits<float>::infinity()};
                for (int t = -7; t <= 7; ++t) invs.push_back(m != 0.0f ? (float)(t - 127) / m : (float)t);
                for (float inv : invs) {
                    float qx, q2;
                    fit_of(isa)(x.data(), w, inv, qx, q2);
                    sums.push_back(qx);
                    sums.push_back(q2);
                }
            }
            Blob blob;
            blob.floats("sumqx, sumq2", sums.data(), sums.size());
            blob.cases = (int)(sums.size() / 2);
            return blob;
        });
        check("quantize_block_iq4_nl (" + std::to_string(blocks.size()) + " blocks)", [&](Isa isa, bool oracle) {
            std::vector<uint8_t> out(blocks.size() * 18, fill_byte(oracle));
            for (size_t b = 0; b < blocks.size(); ++b) quantize_block_iq4_nl(blocks[b].data(), out.data() + 18 * b, isa);
            Blob blob;
            blob.blocks18("blocks", out.data(), blocks.size());
            blob.cases = (int)blocks.size();
            return blob;
        });
    }

    // The row ops of a decoder step: silu_mul_row and gelu_mul_row (AVX2 and NEON versions of their own) on normal values and
    // the edges of exp_clamped (the clamps, infinities, NaN, signed zeros, subnormals), n = 1..40
    // and 8960 (tails of every length); rms_norm_row (one function, every CPU) of several widths.
    void row_ops(uint64_t seed) {
        Rng rng(seed);
        std::vector<float> gate = {0.0f, -0.0f, 87.0f, -87.0f, 88.0f, -88.0f, 88.5f, -88.5f, 1e30f, -1e30f,
                                   INFINITY, -INFINITY, NAN, -NAN, 1e-40f, -1e-40f, 0.5f, -0.5f};
        while (gate.size() < 8960) gate.push_back(rng.normal() * (rng.below(4) == 0 ? 60.0f : 6.0f));
        std::vector<float> up(gate.size());
        for (float& u : up) u = rng.normal();
        check("silu_mul_row (n = 1..40 and 8960)", [&](Isa isa, bool oracle) {
            std::vector<float> out;
            for (int64_t n = 1; n <= 40; ++n) {
                std::vector<float> row(n);
                std::memset(row.data(), fill_byte(oracle), n * 4);
                silu_mul_row(gate.data() + 7 * n % 64, up.data() + n, n, row.data(), isa);
                out.insert(out.end(), row.begin(), row.end());
            }
            std::vector<float> row(gate.size());
            silu_mul_row(gate.data(), up.data(), (int64_t)gate.size(), row.data(), isa);
            out.insert(out.end(), row.begin(), row.end());
            Blob blob;
            blob.floats("silu(gate) * up", out.data(), out.size());
            blob.cases = 41;
            return blob;
        });
        check("gelu_mul_row (n = 1..40 and 8960)", [&](Isa isa, bool oracle) {
            std::vector<float> out;
            for (int64_t n = 1; n <= 40; ++n) {
                std::vector<float> row(n);
                std::memset(row.data(), fill_byte(oracle), n * 4);
                gelu_mul_row(gate.data() + 7 * n % 64, up.data() + n, n, row.data(), isa);
                out.insert(out.end(), row.begin(), row.end());
            }
            std::vector<float> row(gate.size());
            gelu_mul_row(gate.data(), up.data(), (int64_t)gate.size(), row.data(), isa);
            out.insert(out.end(), row.begin(), row.end());
            Blob blob;
            blob.floats("gelu_tanh(gate) * up", out.data(), out.size());
            blob.cases = 41;
            return blob;
        });
        // softmax_numerators (attention's, an AVX2 and a NEON version of its own): rows of every
        // length 1..40 and 1500, and rows with NaN (first, inside, last), infinities, only -inf,
        // zeros of both signs first and the clamps' edges (the maximum must skip NaN as std::max does).
        std::vector<std::vector<float>> rows;
        for (int64_t n = 1; n <= 40; ++n) {
            rows.emplace_back(n);
            for (float& v : rows.back()) v = rng.normal() * 8.0f;
        }
        rows.emplace_back(1500);
        for (float& v : rows.back()) v = rng.normal() * 8.0f;
        const float inf = INFINITY;
        for (std::vector<float> edge : std::vector<std::vector<float>>{
                 {NAN, 1.0f, 2.0f, 3.0f, -4.0f, 0.5f, 7.0f, 1.0f, 2.0f},
                 {NAN, 1.0f, 2.0f, 3.0f, 9.0f, 1.0f, 1.0f, 1.0f, 10.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.5f}, 
                 {9.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, NAN, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.5f}, {1.0f, 2.0f, NAN, 3.0f, 1.0f, 2.0f, 0.0f, 1.0f, -1.0f, 5.0f},
                 {1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f, NAN}, {-inf, -inf, -inf, -inf, -inf}, {1.0f, inf, 2.0f, 3.0f, 4.0f, -inf},
                 {-0.0f, 0.0f, -1.0f, -2.0f, -0.0f, -3.0f, -4.0f, -5.0f}, {0.0f, -0.0f, -1.0f, -2.0f, 0.0f, -3.0f, -4.0f, -5.0f, -6.0f},
                 {1e30f, -1e30f, 100.0f, -100.0f, 88.0f, -87.0f, 1e-40f, -1e-40f, 0.0f}, {NAN, NAN, NAN, NAN, NAN}})
            rows.push_back(edge);
        check("softmax_numerators (n = 1..40, 1500, edges)", [&](Isa isa, bool) {
            std::vector<float> out;
            for (const std::vector<float>& row : rows) {
                std::vector<float> s = row;
                softmax_numerators(s.data(), (int64_t)s.size(), isa);
                out.insert(out.end(), s.begin(), s.end());
            }
            Blob blob;
            blob.floats("exp(s - max s)", out.data(), out.size());
            blob.cases = (int)rows.size();
            return blob;
        });
        std::vector<float> x(1536), w(1536);
        for (size_t j = 0; j < x.size(); ++j) x[j] = rng.normal() * 3.0f, w[j] = rng.normal();
        check("rms_norm_row (n = 1, 15, 16, 17, 33, 1536)", [&](Isa, bool oracle) {
            std::vector<float> out;
            for (int64_t n : {1, 15, 16, 17, 33, 1536}) {
                std::vector<float> row(n);
                std::memset(row.data(), fill_byte(oracle), n * 4);
                rms_norm_row(x.data() + (1536 - n) / 3, w.data(), n, 1e-6f, row.data());
                out.insert(out.end(), row.begin(), row.end());
            }
            Blob blob;
            blob.floats("rms_norm", out.data(), out.size());
            blob.cases = 6;
            return blob;
        });
    }

    // quantize_block_q4_0 has one implementation: compared with the formula of gguf-py's
    // Q4_0.quantize_blocks and ggml's quantize_row_q4_0_ref written out here (finite blocks with a
    // finite 1 / d; m = the
    // first value of largest magnitude, signed zero included, d = m / -8, q = min(15, trunc(x * id +
    // 8.5)), nibbles packed low = value i, high = value 16 + i), reported once.
    void q4_0() {
        const auto blocks = requant_blocks();
        ++checks;
        int bad = -1, n = 0;
        for (size_t b = 0; b < blocks.size(); ++b) {
            const float* x = blocks[b].data();
            bool finite = true;
            for (int i = 0; i < 32; ++i) finite = finite && std::isfinite(x[i]);
            if (!finite) continue;
            int first = 0;
            for (int i = 1; i < 32; ++i)
                if (std::fabs(x[i]) > std::fabs(x[first])) first = i;
            const float d = x[first] / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            if (!std::isfinite(id)) continue;  // a subnormal d: the formula's int conversion of inf is undefined
            uint8_t want[18], got[18];
            const uint16_t dh = float_to_half(d);
            std::memcpy(want, &dh, 2);
            for (int i = 0; i < 16; ++i) {
                const float x0 = x[i] * id, x1 = x[16 + i] * id;
                const int q0 = std::min(15, (int)(x0 + 8.5f)), q1 = std::min(15, (int)(x1 + 8.5f));
                want[2 + i] = (uint8_t)(q0 | (q1 << 4));
            }
            quantize_block_q4_0(x, got);
            Blob blob;
            blob.blocks18("q4_0", got, 1);
            digest.add(blob);
            ++n;
            if (std::memcmp(want, got, 18) != 0 && bad < 0) bad = (int)b;
        }
        if (bad >= 0) ++failures;
        cases += n;
        std::printf("%-9s %-52s %6d cases  %s\n", "(any)", "quantize_block_q4_0 vs ggml's formula", n,
                    bad < 0 ? "OK" : ("MISMATCH block " + std::to_string(bad)).c_str());
    }
};

bool parse_isa(const std::string& name, Isa& isa) {
    for (int i = 1; i < NUM_ISAS; ++i)
        if (name == isa_name((Isa)i)) {
            isa = (Isa)i;
            return true;
        }
    return false;
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<Isa> wanted;
    bool explicit_list = false, print_digests = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        std::string list;
        if (arg == "--digests") {
            print_digests = true;
            continue;
        }
        if (arg == "--isas" && i + 1 < argc) list = argv[++i];
        else if (arg.rfind("--isas=", 0) == 0) list = arg.substr(7);
        else {
            std::fprintf(stderr, "usage: %s [--isas portable,avx512,avx2,avxvnni,neon] [--digests]\n", argv[0]);
            return 2;
        }
        explicit_list = true;
        size_t at = 0;
        while (at <= list.size()) {
            const size_t comma = std::min(list.find(',', at), list.size());
            const std::string name = list.substr(at, comma - at);
            Isa isa;
            if (!parse_isa(name, isa)) {
                std::fprintf(stderr, "unknown ISA '%s' (known: portable, avx512, avx2, avxvnni, neon)\n", name.c_str());
                return 2;
            }
            if (std::find(wanted.begin(), wanted.end(), isa) == wanted.end()) wanted.push_back(isa);
            at = comma + 1;
        }
    }
    if (!explicit_list)
        for (int i = 1; i < NUM_ISAS; ++i) wanted.push_back((Isa)i);

#if defined(__aarch64__)
    const char* arch = "aarch64";
#elif defined(__x86_64__)
    const char* arch = "x86-64";
#else
    const char* arch = "other";
#endif
    Harness h;
    h.print_digests = print_digests;
    std::string skipped;
    for (Isa isa : wanted) {
        if (isa_supported(isa)) {
            h.isas.push_back(isa);
        } else if (explicit_list) {
            std::fprintf(stderr, "this CPU cannot run the requested %s path (it has: %s)\n", isa_name(isa), cpu_features().c_str());
            return 2;
        } else {
            skipped += std::string(skipped.empty() ? "" : ", ") + isa_name(isa);
        }
    }
    std::string compared;
    for (Isa isa : h.isas) compared += std::string(compared.empty() ? "" : ", ") + isa_name(isa);
    std::printf("verispec kernel harness on %s (cpu features: %s)\n", arch, cpu_features().c_str());
    std::printf("comparing with the portable oracle: %s%s%s\n", compared.empty() ? "(nothing)" : compared.c_str(),
                skipped.empty() ? "" : "; not run on this CPU: ", skipped.c_str());

    uint64_t seed = 1;
    for (int64_t qtype : TYPES) {
        const bool k_quant = block_traits(qtype).k_quant;
        const int64_t unit = k_quant ? 256 : 32;
        h.tiles(qtype, 40, k_quant ? 512 : 160, SANE, true, seed++);  // 3 tiles, the last half padding
        h.tiles(qtype, 33, 3 * unit, SANE, true, seed++);            // one real column in the last tile
        h.tiles(qtype, 50, k_quant ? 256 : 320, ANY_SCALE, true, seed++);
        h.tiles(qtype, 17, unit, FULL, true, seed++);
        h.tiles(qtype, 17, 2 * unit, EMPTY, true, seed++);
        h.tiles(qtype, 96, k_quant ? 1024 : 512, SANE, false, seed++);  // more blocks and tiles, a few row counts
    }
    for (int block_k : {32, 256})
        for (bool offset : {false, true}) h.quantization(block_k, offset);
    struct Config { int64_t heads, kv, dim; };
    const Config configs[] = {{14, 2, 64}, {12, 2, 128}, {3, 1, 64}, {3, 1, 128}, {34, 2, 16}, {4, 4, 48}};
    for (const Config& c : configs) {
        for (int64_t start : {0, 3, 17}) h.attention(c.heads, c.kv, c.dim, start, {}, false, seed++);
        h.attention(c.heads, c.kv, c.dim, 0, {1, 9, 4, 0, 5, 2, 7}, false, seed++);
    }
    h.attention(14, 2, 64, 6, {}, true, seed++);
    h.attention(3, 1, 128, 0, {3, 6, 1}, true, seed++);
    for (int64_t dim : {16, 48, 64, 80, 96, 128, 256})  // 96: Phi-3; 256: Gemma 3
        for (bool slots : {false, true}) h.scores_and_sums(dim, slots);
    h.row_ops(seed++);
    h.iq4_nl();
    h.q4_0();
    // Long rows (hundreds of slots: the vector loops' steady state, the 4-key stores) of the GQA
    // groups of Qwen2.5-1.5B (6) and 0.5B (7).
    h.attention(12, 2, 128, 300, {}, false, seed++);
    h.attention(14, 2, 64, 157, {}, false, seed++);
    // sliding windows (Gemma 3's local layers, head_dim 256; Mistral-style): shorter, equal and longer than the rows
    h.attention(4, 1, 256, 17, {}, false, seed++, 4);
    h.attention(14, 2, 64, 157, {}, false, seed++, 32);
    h.attention(3, 1, 128, 2, {}, false, seed++, 500);

    std::printf("SUMMARY: %d checks, %ld cases, %d mismatches or failures; ISAs compared: %s; oracle digest %016" PRIx64 "\n",
                h.checks, h.cases, h.failures, compared.empty() ? "none" : compared.c_str(), h.digest.h);
    return h.failures ? 1 : 0;
}
