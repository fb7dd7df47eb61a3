// The torch-free core of verispec's CPU kernels: block formats, activation rows, tile products,
// attention and re-quantization, with one implementation per instruction set.
//
// Exactness (the argument every ISA file relies on). For output element (row, col) a product
// computes, block after block in increasing k, an exact int32 dot product of the row's int8
// activations with the column's integer weights (integer sums: exact in any order, so each ISA
// may group them as its instructions like, as long as no intermediate saturates), converts it to
// float and adds `isum * (x_scale * w_scale)` (and, for Q4_K, subtracts the mins term) to a float
// accumulator that starts at 0. No other rows, no other columns and no tile or thread choice
// enter that sequence, and the compiler may not contract it (-ffp-contract=off; separate mul/add
// intrinsics), so every row of a k-row call is bit-identical to a 1-row call, and every ISA path
// equals the portable one (portable.cpp: the oracle) bit for bit. Attention and the IQ4_NL scale
// search reduce floats in one fixed tree written down next to the portable code; the vector paths
// add the same pairs in the same order.
//
// Block formats: ggml's Q4_K, Q6_K, Q4_0, IQ4_NL, Q5_0 and Q8_0 (ggml-common.h, ggml-quants.c).
// Activation quantization follows llama.cpp's Q8_K (256 values per scale, K-quants) and Q8_0 (32).
//
// Files: formats.cpp (FORMATS, one row per block format: decoding, the repacked tile layout),
// portable.cpp (reference), x86_avx512.cpp, x86_avx2.cpp (AVX2, with AVX-VNNI where present),
// arm_neon.cpp (ARMv8.2 dotprod tile products), arm_neon_float.cpp (NEON activation rows,
// attention, IQ4_NL scale search), attention.cpp, row_ops.cpp (SwiGLU, RMSNorm, softmax
// numerators), requantize.cpp, dispatch.cpp (which path runs: the kernel tables; the product
// loop), bindings.cpp (torch). Each tile ISA file keeps its own per-format table of tile kernels.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace vsk {

// ---------------------------------------------------------------------------------------------
// Errors: the core throws std::runtime_error (Python sees RuntimeError with the message).

[[noreturn]] void fail(const std::string& message);
#define VSK_CHECK(cond, message) \
    do {                         \
        if (!(cond)) ::vsk::fail(message); \
    } while (0)

// ---------------------------------------------------------------------------------------------
// Instruction sets. The numbers are the `impl` argument of the bindings (0: the best one).

enum class Isa : int { Auto = 0, Portable = 1, Avx512 = 2, Avx2 = 3, AvxVnni = 4, Neon = 5 };
constexpr int NUM_ISAS = 6;

const char* isa_name(Isa isa);
bool isa_supported(Isa isa);   // compiled in and the CPU has every instruction it uses
Isa best_isa();                // the fastest supported path (never Auto)
Isa resolve_isa(int64_t impl); // Auto -> best_isa(); an unsupported one fails naming the CPU's features
std::string cpu_features();    // the features the dispatch looks at, e.g. "avx2 fma f16c avx512vnni"
bool neon_has_i8mm();          // AArch64 with FEAT_I8MM: the NEON path multiplies pairs of rows by smmla

// ---------------------------------------------------------------------------------------------
// Block formats and the 16-column tile layout (formats.cpp).

constexpr int TILE = 16;          // output columns per interleaved tile
constexpr int MAX_TILE_ROWS = 8;  // rows handed to one tile call (each ISA splits them further)

enum QType : int64_t { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, IQ4_NL = 20 };

// The block formats the kernels know (ggml's type numbers), in the order of the rows of every
// per-format table: FORMATS (formats.cpp) and each ISA's tile kernels (portable.cpp, x86_avx512.cpp,
// x86_avx2.cpp, arm_neon.cpp). A format's row number there is its `format` (format_index).
constexpr int NUM_FORMATS = 6;
constexpr int64_t QTYPES[NUM_FORMATS] = {Q4_K, Q6_K, Q4_0, IQ4_NL, Q5_0, Q8_0};

// Whether a per-format table has one row per format in QTYPES order (rows name their qtype); each
// table static_asserts it, so a row cannot go missing or land under another format.
template <typename Row, size_t N>
constexpr bool in_format_order(const Row (&rows)[N]) {
    if (N != NUM_FORMATS) return false;
    for (size_t i = 0; i < N; ++i)
        if (rows[i].qtype != QTYPES[i]) return false;
    return true;
}

// IQ4_NL's 16 levels (ggml-common.h kvalues_iq4nl).
constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// One row of FORMATS per block format (ggml's type_traits): its sizes and the functions for whole
// rows of its blocks, each instantiated for the format so that its per-block code is inlined (the
// choice of format is made once per call, by the row). ISA-independent: the tile products of
// each ISA are in that ISA's own per-format table (KernelTable::tile).
struct BlockTraits {
    int64_t qtype;
    const char* name;  // ggml's, e.g. "Q4_K"
    int block_k;       // weights per block along the input dimension
    int raw_bytes;     // bytes of one block in the GGUF file
    int tile_bytes;    // bytes of one block of a 16-column tile after repacking
    bool k_quant;      // activations in 256-value blocks (else 32)
    bool offset;       // activations stored as the bits of q + 128 (Q8_0: signed weights; Activations)
    // Tiles t0 .. t1 - 1 of a matrix of out_features rows of nblocks raw blocks into `packed`
    // (ntiles * nblocks * tile_bytes bytes, zeroed by the caller: padding columns keep d = 0).
    void (*repack_tiles)(const uint8_t* raw, int64_t out_features, int64_t nblocks, uint8_t* packed, int64_t t0,
                         int64_t t1);
    // One row of nblocks raw blocks -> nblocks * block_k floats, ggml's de-quantization formulas.
    void (*dequantize_row)(const uint8_t* raw, int64_t nblocks, float* out);
    // block_k floats -> one raw block (requantize.cpp; isa: the path of any float search); null
    // where the format is not a re-quantization target.
    void (*quantize_block)(const float* x, uint8_t* out, Isa isa);
};

int format_index(int64_t qtype);                   // qtype's row; fails for a type the kernels do not multiply
const BlockTraits& block_traits(int64_t qtype);    // FORMATS[format_index(qtype)]
const BlockTraits* find_block_traits(int64_t qtype);  // null for a type the kernels do not know

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);  // IEEE binary16, round to nearest even (as c10::Half)

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline int32_t load_i32(const void* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// One GGUF block decoded into integer weights.
struct Decoded {
    uint8_t q[256];     // unsigned integer weights (Q8_0: int8 bits; IQ4_NL: level index)
    uint8_t scale[16];  // Q4_K: 8 sub-block scales; Q6_K: 16 int8 scales (bits)
    uint8_t min[8];     // Q4_K: 8 sub-block mins
    uint16_t d, dmin;   // fp16 bits
};

// block_traits(qtype).repack_tiles and .dequantize_row (above).
void repack_tiles(int64_t qtype, const uint8_t* raw, int64_t out_features, int64_t nblocks, uint8_t* packed, int64_t t0,
                  int64_t t1);
void dequantize_row(int64_t qtype, const uint8_t* raw, int64_t nblocks, float* out);

// ---------------------------------------------------------------------------------------------
// Activations, quantized per row and per block (row-local: no value depends on another row).

struct Activations {
    int64_t rows = 0, in = 0;
    int block_k = 256;
    bool offset = false;       // Q8_0 weights: q stored as the bits of q + 128 (as uint8)
    std::vector<int8_t> q;     // [rows][in]
    std::vector<float> d;      // [rows][in / block_k]
    std::vector<int16_t> s16;  // [rows][in / 16] sums of q over 16 values
    std::vector<int16_t> s32;  // [rows][in / 32] sums of q over 32 values
};

void prepare_activations(Activations& a, int64_t rows, int64_t in, int block_k, bool offset);
// Rows r0 .. r1 - 1 of x [rows][in]: one block of one row is d = max |x| / 127, q = clamp(
// nearbyint(x * (1 / d)), -127, 127), the same bits on every ISA.
void quantize_activation_rows(const float* x, Activations& a, int64_t r0, int64_t r1, Isa isa);

// One block of one row, per ISA (the same values bit for bit).
void quantize_block_portable(const float* xb, int block_k, int8_t* qb, float* d_out);
void quantize_block_avx512(const float* xb, int block_k, int8_t* qb, float* d_out);
void quantize_block_avx2(const float* xb, int block_k, int8_t* qb, float* d_out);
void quantize_block_neon(const float* xb, int block_k, int8_t* qb, float* d_out);

// ---------------------------------------------------------------------------------------------
// Tile products: rows row0 .. row0 + rows - 1 (rows <= MAX_TILE_ROWS) times the 16 columns of one
// tile, written to out[r * ldo + c].

struct TileArgs {
    const uint8_t* tile;  // the tile's first block; blocks follow at stride tile_bytes
    int64_t nblocks;
    const Activations* act;
    int64_t row0;
    int rows;
    float* out;
    int64_t ldo;
};

// One ISA's tile product for one block format (and, where the ISA makes the row count a
// compile-time one, for one row count): a kernel of the ISA's per-format table.
using TileFn = void (*)(const TileArgs& a);
// A row of an ISA's per-format table of tile kernels (in QTYPES order: in_format_order).
struct TileKernel {
    int64_t qtype;
    TileFn run;
};

// Each ISA's entry: `format` is the block format's row (format_index, looked up and checked once
// per linear_tiles call, not again here); each picks its kernel from its own per-format table, one
// lookup per tile call (AVX2, NEON: per group of rows, as the row-count switch did before).
void tile_portable(int format, const TileArgs& a);
void tile_avx512(int format, const TileArgs& a);
void tile_avx2(int format, const TileArgs& a);     // vpmaddubsw + vpmaddwd
void tile_avxvnni(int format, const TileArgs& a);  // vpdpbusd (VEX)
void tile_neon(int format, const TileArgs& a);

// The whole product for tiles t0 .. t1 - 1 and every row of `act` (rows in blocks of 64, whose
// activations stay in cache while a tile is reused): out [rows][ntiles * 16].
void linear_tiles(int64_t qtype, const uint8_t* packed, int64_t nblocks, const Activations& act, float* out,
                  int64_t ldo, int64_t row_begin, int64_t row_end, int64_t t0, int64_t t1, Isa isa);
constexpr int64_t ROW_BLOCK = 64;

// ---------------------------------------------------------------------------------------------
// Attention over a static KV cache (attention.cpp), one (row, KV head) work item at a time.

constexpr int LANES = 16;      // partial sums of a dot product (the reduction tree's width)
constexpr int MAX_GROUP = 16;  // query heads per KV head handled in one pass over the keys

// f(std::integral_constant<int, n>{}) for n = 1 .. 6 (above 6: 6): the queries of one weighted-sum
// tile as a compile-time count, so its accumulators stay in registers (the AVX2 and NEON paths).
template <typename F>
inline void with_group_size(int n, F&& f) {
    switch (n) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        default: f(std::integral_constant<int, 6>{}); break;
    }
}

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

// scores[a][j] = (q_a . k_slot(j)) * scale, 16 partial lanes reduced by the tree l + 8, l + 4,
// l + 2, l + 1; out[a][c] = sum over j in order of p[a][j] * v_slot(j)[c], from 0.
using ScoresFn = void (*)(const float* q, int nq, const float* keys, int64_t head_dim, const int64_t* slots,
                          int64_t count, float scale, float* scores);
using WeightedSumFn = void (*)(const float* p, int nq, const float* values, int64_t head_dim, const int64_t* slots,
                               int64_t count, float* out);
void scores_portable(const float*, int, const float*, int64_t, const int64_t*, int64_t, float, float*);
void scores_avx512(const float*, int, const float*, int64_t, const int64_t*, int64_t, float, float*);
void scores_avx2(const float*, int, const float*, int64_t, const int64_t*, int64_t, float, float*);
void scores_neon(const float*, int, const float*, int64_t, const int64_t*, int64_t, float, float*);
void weighted_sum_portable(const float*, int, const float*, int64_t, const int64_t*, int64_t, float*);
void weighted_sum_avx512(const float*, int, const float*, int64_t, const int64_t*, int64_t, float*);
void weighted_sum_avx2(const float*, int, const float*, int64_t, const int64_t*, int64_t, float*);
void weighted_sum_neon(const float*, int, const float*, int64_t, const int64_t*, int64_t, float*);

struct AttentionArgs {
    const float* q;       // [rows][heads][head_dim]
    const float* keys;    // [kv_heads][capacity][head_dim]
    const float* values;  // [kv_heads][capacity][head_dim]
    int64_t rows, heads, kv_heads, capacity, head_dim;
    int64_t start;         // causal: row i sees slots 0 .. start + i
    const int64_t* visible;  // tree: row i sees visible[i * width + j], j < lengths[i] (else null)
    const int64_t* lengths;
    int64_t width;
    float scale;
    float* out;  // [rows][heads * head_dim]
    int64_t window = 0;  // causal with a sliding window: row i sees slots start + i - window + 1 .. start + i (0: from 0)
};

// Validates the shapes and slots (fails with a message); call once before the work items.
void check_attention(const AttentionArgs& a);
// Work items begin .. end - 1 of attention_item_count(a): item = row * kv_heads + kv_head, or for
// causal rows without a window, (block of ATTENTION_ROWS rows) * kv_heads + kv_head.
constexpr int64_t ATTENTION_ROWS = 4;
int64_t attention_item_count(const AttentionArgs& a);
void attention_items(const AttentionArgs& a, int64_t begin, int64_t end, Isa isa);

// One row: out[j] = gate[j] / (1 + exp_clamped(-gate[j])) * up[j] (SwiGLU, Shazeer 2020), the
// same bits on every path (row_ops.cpp; silu_mul_row: the path of `isa`).
void silu_mul_row(const float* gate, const float* up, int64_t n, float* out, Isa isa);
void silu_mul_row_portable(const float* gate, const float* up, int64_t n, float* out);
void silu_mul_row_avx2(const float* gate, const float* up, int64_t n, float* out);
void silu_mul_row_neon(const float* gate, const float* up, int64_t n, float* out);
// One row: out[j] = gelu_tanh(gate[j]) * up[j] (GeGLU, Shazeer 2020; Gemma's MLP), gelu_tanh(v) =
// v / (1 + exp_clamped(-t)), t = ((v + ((v * v) * v) * GELU_CUBIC) * GELU_TWO_SQRT_2_OVER_PI), in
// that order on every path (row_ops.cpp; gelu_mul_row: the path of `isa`).
constexpr float GELU_CUBIC = 0.044715f;
constexpr float GELU_TWO_SQRT_2_OVER_PI = 1.5957691216057308f;  // 2 sqrt(2 / pi): tanh(u) = 2 sigmoid(2u) - 1
void gelu_mul_row(const float* gate, const float* up, int64_t n, float* out, Isa isa);
void gelu_mul_row_portable(const float* gate, const float* up, int64_t n, float* out);
void gelu_mul_row_avx2(const float* gate, const float* up, int64_t n, float* out);
void gelu_mul_row_neon(const float* gate, const float* up, int64_t n, float* out);
// s[j] = exp_clamped(s[j] - max s) in place, the scalar operations lane by lane (the maximum is
// the same value whatever the order: NaNs are skipped, and a zero's sign does not change s - max).
// softmax_numerators: the path of `isa`.
void softmax_numerators(float* s, int64_t count, Isa isa);
void softmax_numerators_portable(float* s, int64_t count);
void softmax_numerators_avx2(float* s, int64_t count);
void softmax_numerators_neon(float* s, int64_t count);

// One row: out[j] = (x[j] * inv) * weight[j], inv = 1 / sqrt(sum(x^2) / n + eps) (RMSNorm, Zhang &
// Sennrich 2019), the squares summed in 16 lanes (lane l: x[l], x[l + 16], ... in order) folded
// l + 8, l + 4, l + 2, l + 1: a fixed order, so a row's bits depend on the row alone.
void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* out);

// ---------------------------------------------------------------------------------------------
// Re-quantization (requantize.cpp): 32 de-quantized values -> one 18-byte block.

void quantize_block_q4_0(const float* x, uint8_t* out);
void quantize_block_iq4_nl(const float* x, uint8_t* out, Isa isa);
int nearest_iq4_nl(float v);

// One fit of an IQ4_NL block for the scale 1 / inv (levels nearest to inv * x, then sum(w q x) and
// sum(w q^2), lanes l and l + 16 summed, then folded l + 8, l + 4, l + 2, l + 1), per ISA.
void fit_iq4_nl_portable(const float* x, const float* w, float inv, float& sumqx, float& sumq2);
void fit_iq4_nl_avx512(const float* x, const float* w, float inv, float& sumqx, float& sumq2);
void fit_iq4_nl_avx2(const float* x, const float* w, float inv, float& sumqx, float& sumq2);
void fit_iq4_nl_neon(const float* x, const float* w, float inv, float& sumqx, float& sumq2);

// ---------------------------------------------------------------------------------------------
// One instruction set's kernels in one table, chosen once per call instead of a switch at every
// block (ggml's type_traits_cpu; its tile entry looks up the ISA's own per-format table). Every
// entry gives the portable entry's bits (the argument above).

struct KernelTable {
    void (*quantize_block)(const float* xb, int block_k, int8_t* qb, float* d_out);
    void (*tile)(int format, const TileArgs& a);  // format: format_index(qtype)
    ScoresFn scores;
    WeightedSumFn weighted_sum;
    void (*softmax_numerators)(float* s, int64_t count);
    void (*silu_mul_row)(const float* gate, const float* up, int64_t n, float* out);
    void (*gelu_mul_row)(const float* gate, const float* up, int64_t n, float* out);
    void (*fit_iq4_nl)(const float* x, const float* w, float inv, float& sumqx, float& sumq2);
};

// The table of `isa` (Auto: the best this CPU runs); fails as resolve_isa for an unsupported one.
const KernelTable& kernel_table(Isa isa);

}  // namespace vsk
