// Torch bindings of the kernels' core: tensor checks, at::parallel_for over the core's work
// ranges, and the Python module. Every computation lives in the torch-free core (core.h).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "core.h"

namespace {

using vsk::Isa;

// The checks repack and dequantize share: raw holds out_features rows of whole blocks.
int64_t check_raw_blocks(const torch::Tensor& raw, const vsk::BlockTraits& f, int64_t out_features, int64_t in_features) {
    TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous(), "raw blocks must be contiguous uint8");
    TORCH_CHECK(in_features % f.block_k == 0, "in_features ", in_features, " is not a multiple of ", f.block_k);
    const int64_t nblocks = in_features / f.block_k;
    TORCH_CHECK(raw.numel() == out_features * nblocks * f.raw_bytes, "raw size ", raw.numel(), " != ",
                out_features * nblocks * f.raw_bytes);
    return nblocks;
}

// n zero bytes for packed weights, in 2 MB transparent huge pages where Linux grants them (THP
// "madvise" or "always"): every pass streams all the weights, and with 4 KB pages each 4 KB of
// them costs a TLB miss and stops the hardware prefetcher at the page's end (measured:
// docs/kernel-measurements.md). The memory is allocated 2 MB-aligned
// and advised before its first touch (the zeroing faults it in); the size is not rounded up, so
// nothing is wasted (a matrix's last partial 2 MB stays in 4 KB pages). Elsewhere, or when the
// advice is refused, ordinary pages: the same bytes, so the same results.
torch::Tensor zeroed_weight_bytes(int64_t n) {
#if defined(__linux__)
    constexpr size_t HUGE_PAGE = size_t(2) << 20;
    void* p = nullptr;
    if (n >= (int64_t)HUGE_PAGE && posix_memalign(&p, HUGE_PAGE, (size_t)n) == 0) {
        (void)madvise(p, (size_t)n, MADV_HUGEPAGE);  // advice: refused (THP off), the pages are 4 KB ones
        std::memset(p, 0, (size_t)n);
        return torch::from_blob(p, {n}, [](void* q) { std::free(q); }, torch::kUInt8);
    }
#endif
    return torch::zeros({n}, torch::kUInt8);
}

torch::Tensor repack(torch::Tensor raw, int64_t qtype, int64_t out_features, int64_t in_features) {
    const vsk::BlockTraits& f = vsk::block_traits(qtype);
    const int64_t nblocks = check_raw_blocks(raw, f, out_features, in_features);
    const int64_t ntiles = (out_features + vsk::TILE - 1) / vsk::TILE;
    auto packed = zeroed_weight_bytes(ntiles * nblocks * f.tile_bytes);
    const uint8_t* src = raw.data_ptr<uint8_t>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) { vsk::repack_tiles(qtype, src, out_features, nblocks, dst, t0, t1); });
    return packed;
}

// Calls row_fn(r, w) with each row r of raw de-quantized (ggml's formulas), rows in parallel.
template <typename RowFn>
void for_dequantized_rows(const torch::Tensor& raw, int64_t qtype, int64_t out_features, int64_t in_features, RowFn row_fn) {
    const vsk::BlockTraits& f = vsk::block_traits(qtype);
    const int64_t nblocks = check_raw_blocks(raw, f, out_features, in_features);
    const int64_t row_bytes = nblocks * f.raw_bytes;
    const uint8_t* src = raw.data_ptr<uint8_t>();
    at::parallel_for(0, out_features, 16, [&](int64_t r0, int64_t r1) {
        std::vector<float> row(in_features);
        for (int64_t r = r0; r < r1; ++r) {
            vsk::dequantize_row(qtype, src + r * row_bytes, nblocks, row.data());
            row_fn(r, row.data());
        }
    });
}

// raw [out * row_bytes] uint8 -> float32 [out, in]: the GGUF blocks de-quantized with ggml's formulas
// (dequantize_row_q4_K and friends), for the embedding and for runners that re-quantize.
torch::Tensor dequantize(torch::Tensor raw, int64_t qtype, int64_t out_features, int64_t in_features) {
    auto out = torch::empty({out_features, in_features}, torch::kFloat32);
    float* dst = out.data_ptr<float>();
    for_dequantized_rows(raw, qtype, out_features, in_features,
                         [&](int64_t r, const float* w) { std::copy(w, w + in_features, dst + r * in_features); });
    return out;
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

// raw [out * row_bytes] uint8 of any supported type -> Q4_0 or IQ4_NL blocks [out * in / 32 * 18]
// uint8: each row de-quantized (as dequantize) and quantized 32 values at a time. impl: as linear.
torch::Tensor requantize_4bit(torch::Tensor raw, int64_t qtype, int64_t out_features, int64_t in_features, int64_t to_qtype,
                              int64_t impl) {
    const vsk::BlockTraits* to = vsk::find_block_traits(to_qtype);  // the target's row: its quantize_block
    TORCH_CHECK(to != nullptr && to->quantize_block != nullptr, "re-quantizing to GGUF block type ", to_qtype,
                " is not supported");
    TORCH_CHECK(in_features % to->block_k == 0, "in_features ", in_features, " is not a multiple of ", to->block_k);
    const Isa isa = vsk::resolve_isa(impl);
    const int64_t out_blocks = in_features / to->block_k;
    auto q = torch::empty({out_features * out_blocks * to->raw_bytes}, torch::kUInt8);
    uint8_t* dst = q.data_ptr<uint8_t>();
    const auto quantize_block = to->quantize_block;
    for_dequantized_rows(raw, qtype, out_features, in_features, [&](int64_t r, const float* w) {
        for (int64_t blk = 0; blk < out_blocks; ++blk)
            quantize_block(w + blk * to->block_k, dst + (r * out_blocks + blk) * to->raw_bytes, isa);
    });
    return q;
}

// x [rows, in] float32, packed from repack() -> [rows, ceil(out / 16) * 16] float32.
// impl: 0 = the best path for this CPU, else an vsk::Isa number (an error when the CPU lacks it).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t out_features, int64_t impl) {
    TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32, "x must be [rows, in] float32");
    x = x.contiguous();
    const vsk::BlockTraits& f = vsk::block_traits(qtype);
    const int64_t rows = x.size(0), in = x.size(1);
    TORCH_CHECK(in % f.block_k == 0, "in_features ", in, " is not a multiple of ", f.block_k);
    const int64_t nblocks = in / f.block_k, ntiles = (out_features + vsk::TILE - 1) / vsk::TILE;
    TORCH_CHECK(packed.numel() == ntiles * nblocks * f.tile_bytes, "packed weight does not match the shapes");
    const Isa isa = vsk::resolve_isa(impl);
    auto out = torch::empty({rows, ntiles * vsk::TILE}, torch::kFloat32);
    vsk::Activations act;
    vsk::prepare_activations(act, rows, in, f.k_quant ? 256 : 32, f.offset);
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) { vsk::quantize_activation_rows(xp, act, r0, r1, isa); });
    const uint8_t* w = packed.data_ptr<uint8_t>();
    float* o = out.data_ptr<float>();
    const int64_t ldo = ntiles * vsk::TILE;
    for (int64_t rb = 0; rb < rows; rb += vsk::ROW_BLOCK) {
        const int64_t rend = std::min(rows, rb + vsk::ROW_BLOCK);
        at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
            vsk::linear_tiles(qtype, w, nblocks, act, o, ldo, rb, rend, t0, t1, isa);
        });
    }
    return out;
}

// q [rows, heads, head_dim], keys / values [kv_heads, capacity, head_dim] (float32, contiguous);
// visible: empty (causal from `start`) or int64 [rows, width] with lengths [rows]; impl as linear();
// window: a causal row's sliding window in positions (0: none; a tree's slot lists come windowed).
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start, torch::Tensor visible,
                        torch::Tensor lengths, double scale, int64_t impl, int64_t window) {
    const Isa isa = vsk::resolve_isa(impl);
    TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "attention expects 3-D q, keys, values");
    TORCH_CHECK(q.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32 && values.dtype() == torch::kFloat32,
                "attention expects float32");
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "keys and values must be contiguous");
    TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(2) == q.size(2), "query, key and value shapes do not match");
    q = q.contiguous();
    const bool tree = visible.numel() > 0;
    if (tree) {
        TORCH_CHECK(visible.dim() == 2 && visible.dtype() == torch::kInt64 && lengths.dtype() == torch::kInt64 &&
                        visible.size(0) == q.size(0) && lengths.numel() == q.size(0),
                    "visible must be int64 [rows, width] with int64 lengths [rows]");
        visible = visible.contiguous();
        lengths = lengths.contiguous();
    }
    auto out = torch::empty({q.size(0), q.size(1) * q.size(2)}, torch::kFloat32);
    const vsk::AttentionArgs args{q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), q.size(0), q.size(1),
                                  keys.size(0), keys.size(1), q.size(2), start, tree ? visible.data_ptr<int64_t>() : nullptr,
                                  tree ? lengths.data_ptr<int64_t>() : nullptr, tree ? visible.size(1) : 0, (float)scale,
                                  out.data_ptr<float>(), window};
    vsk::check_attention(args);
    at::parallel_for(0, vsk::attention_item_count(args), 1, [&](int64_t b, int64_t e) { vsk::attention_items(args, b, e, isa); });
    return out;
}

// ---------------------------------------------------------------------------------------------
// Small row-local ops fused to save the per-op overhead of a 1..16-row decoder step.

// qkv [rows, (heads + 2 kv_heads) * head_dim]: rotates q and k by RoPE (half-split layout, Su et
// al. 2021) at `positions` [rows], writes k and v into cache slots start .. start + rows - 1 of
// keys / values [kv_heads, capacity, head_dim]; returns rotated q [rows, heads, head_dim]. The
// tables cos / sin [positions, rot] rotate each head's first rot dimensions (partial rotary when
// rot < head_dim: the others are copied).
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
    const int64_t rot = cos.size(1), half = rot / 2, width = qkv.size(1), table = cos.size(0);
    TORCH_CHECK(rot % 2 == 0 && rot <= dim && sin.sizes() == cos.sizes(), "the RoPE tables do not match head_dim");
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
        const float* ci = c + pos[i] * rot;
        const float* si = s + pos[i] * rot;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            const float* in = x + i * width + h * dim;
            float* out = h < heads ? qo + (i * heads + h) * dim : ko + ((h - heads) * capacity + start + i) * dim;
            for (int64_t d = 0; d < half; ++d) {
                const float a = in[d] * ci[d], b = (-in[d + half]) * si[d];
                out[d] = a + b;
                const float e = in[d + half] * ci[d + half], f = in[d] * si[d + half];
                out[d + half] = e + f;
            }
            for (int64_t d = rot; d < dim; ++d) out[d] = in[d];
        }
        for (int64_t h = 0; h < kv_heads; ++h)
            std::memcpy(vo + (h * capacity + start + i) * dim, x + i * width + (heads + kv_heads + h) * dim, dim * sizeof(float));
    }
    return q;
}

// gate_up [rows, 2 * ffn] -> act(gate) * up [rows, ffn], one row at a time by `row` (a vsk::*_mul_row).
template <typename RowOp>
torch::Tensor gated_rows(torch::Tensor gate_up, int64_t impl, RowOp row) {
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.dtype() == torch::kFloat32 && gate_up.size(1) % 2 == 0,
                "gate_up must be [rows, 2 * ffn] float32");
    const Isa isa = vsk::resolve_isa(impl);
    gate_up = gate_up.contiguous();
    const int64_t rows = gate_up.size(0), ffn = gate_up.size(1) / 2;
    auto out = torch::empty({rows, ffn}, torch::kFloat32);
    const float* g = gate_up.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) row(g + r * 2 * ffn, g + r * 2 * ffn + ffn, ffn, o + r * ffn, isa);
    });
    return out;
}

// gate_up [rows, 2 * ffn] -> silu(gate) * up [rows, ffn] (SwiGLU, Shazeer 2020). impl: as linear.
torch::Tensor silu_mul(torch::Tensor gate_up, int64_t impl) { return gated_rows(gate_up, impl, vsk::silu_mul_row); }

// gate_up [rows, 2 * ffn] -> gelu_tanh(gate) * up [rows, ffn] (GeGLU: Gemma's MLP). impl: as linear.
torch::Tensor gelu_mul(torch::Tensor gate_up, int64_t impl) { return gated_rows(gate_up, impl, vsk::gelu_mul_row); }

// x [rows, n] float32, weight [n] -> RMSNorm of each row (vsk::rms_norm_row).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
    TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32 &&
                    weight.numel() == x.size(1),
                "rms_norm expects x [rows, n] and weight [n], float32");
    x = x.contiguous();
    weight = weight.contiguous();
    const int64_t rows = x.size(0), n = x.size(1);
    auto out = torch::empty({rows, n}, torch::kFloat32);
    const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) vsk::rms_norm_row(xp + r * n, w, n, (float)eps, o + r * n);
    return out;
}

// The residual step of a decoder layer: (x + delta, rms_norm(x + delta, weight)), one pass over
// the rows; the sum is torch's x + delta bit for bit (one IEEE add per element).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
    TORCH_CHECK(x.dim() == 2 && x.sizes() == delta.sizes() && x.dtype() == torch::kFloat32 &&
                    delta.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32 && weight.numel() == x.size(1),
                "add_rms_norm expects x and delta [rows, n] and weight [n], float32");
    x = x.contiguous();
    delta = delta.contiguous();
    weight = weight.contiguous();
    const int64_t rows = x.size(0), n = x.size(1);
    auto sum = torch::empty({rows, n}, torch::kFloat32), out = torch::empty({rows, n}, torch::kFloat32);
    const float *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>(), *w = weight.data_ptr<float>();
    float *s = sum.data_ptr<float>(), *o = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < n; ++j) s[r * n + j] = xp[r * n + j] + dp[r * n + j];
        vsk::rms_norm_row(s + r * n, w, n, (float)eps, o + r * n);
    }
    return {sum, out};
}

// ---------------------------------------------------------------------------------------------
// A decoder's layers in one call for causal rows: the ops above, in the order and with the
// arguments verispec.runners.cpu.decoder runs them one Python call at a time, so the same bits.
// It saves the Python between the ~10 kernel calls of a layer (cProfile, 0.5B draft, one-row
// passes on a Zen 4 core pair: ~1 of 9.4 ms a pass outside the kernels).

// A linear layer: row ranges of W, each repacked in one block type (GGUFLinear.parts), and a bias.
struct PackedLinear {
    std::vector<torch::Tensor> packed;
    std::vector<int64_t> qtypes, rows;
    c10::optional<torch::Tensor> bias;
};

torch::Tensor apply_linear(const PackedLinear& l, const torch::Tensor& x, int64_t impl) {
    std::vector<torch::Tensor> outs;
    for (size_t i = 0; i < l.packed.size(); ++i)
        outs.push_back(linear(x, l.packed[i], l.qtypes[i], l.rows[i], impl).slice(1, 0, l.rows[i]));
    torch::Tensor y = outs.size() == 1 ? outs[0] : torch::cat(outs, 1);
    return l.bias.has_value() ? y + *l.bias : y;
}

struct DecoderLayer {
    PackedLinear qkv, o, gate_up, down;
    torch::Tensor input_norm, post_norm;
};

class LayerStack {
   public:
    LayerStack(int64_t heads, double eps, double scale, bool gelu, torch::Tensor cos, torch::Tensor sin)
        : heads_(heads), eps_(eps), scale_(scale), gelu_(gelu), cos_(cos), sin_(sin) {}

    void add_layer(PackedLinear qkv, PackedLinear o, PackedLinear gate_up, PackedLinear down, torch::Tensor input_norm,
                   torch::Tensor post_norm) {
        layers_.push_back({qkv, o, gate_up, down, input_norm, post_norm});
    }

    // x [rows, hidden]: the embedded rows of every segment in order (counts[s] rows each, at cache
    // slots starts[s] .., RoPE positions[s] [counts[s]] int64, caches keys[s] / values[s]
    // [layers, kv_heads, capacity, head_dim]) -> the residual stream after the last layer.
    torch::Tensor run(torch::Tensor x, const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                      const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                      const std::vector<torch::Tensor>& positions, int64_t impl) const {
        const size_t n = layers_.size(), segments = counts.size();
        TORCH_CHECK(n > 0 && keys.size() == segments && values.size() == segments && starts.size() == segments &&
                        positions.size() == segments,
                    "one cache, start and position list per segment");
        const torch::Tensor none = torch::empty({0}, torch::kInt64);
        torch::Tensor normed = rms_norm(x, layers_[0].input_norm, eps_);
        for (size_t i = 0; i < n; ++i) {
            const DecoderLayer& layer = layers_[i];
            const torch::Tensor qkv = apply_linear(layer.qkv, normed, impl);
            std::vector<torch::Tensor> parts;
            int64_t begin = 0;
            for (size_t s = 0; s < segments; ++s) {
                const torch::Tensor k = keys[s].select(0, (int64_t)i), v = values[s].select(0, (int64_t)i);
                const torch::Tensor q =
                    rope_store(qkv.slice(0, begin, begin + counts[s]), positions[s], cos_, sin_, k, v, starts[s], heads_);
                parts.push_back(attention(q, k, v, starts[s], none, none, scale_, impl, 0));
                begin += counts[s];
            }
            const torch::Tensor attended = apply_linear(layer.o, parts.size() == 1 ? parts[0] : torch::cat(parts), impl);
            std::vector<torch::Tensor> residual = add_rms_norm(x, attended, layer.post_norm, eps_);
            const torch::Tensor gate_up = apply_linear(layer.gate_up, residual[1], impl);
            const torch::Tensor delta = apply_linear(layer.down, gelu_ ? gelu_mul(gate_up, impl) : silu_mul(gate_up, impl), impl);
            if (i + 1 < n) {
                std::vector<torch::Tensor> next = add_rms_norm(residual[0], delta, layers_[i + 1].input_norm, eps_);
                x = next[0];
                normed = next[1];
            } else {
                x = residual[0] + delta;
            }
        }
        return x;
    }

   private:
    int64_t heads_;
    double eps_, scale_;
    bool gelu_;
    torch::Tensor cos_, sin_;
    std::vector<DecoderLayer> layers_;
};

// The ISA names by number (index = the `impl` argument), and which of them this CPU runs.
std::vector<std::string> isa_names() {
    std::vector<std::string> names;
    for (int i = 0; i < vsk::NUM_ISAS; ++i) names.emplace_back(vsk::isa_name((Isa)i));
    return names;
}

std::vector<std::string> supported_isas() {
    std::vector<std::string> names;
    for (int i = 1; i < vsk::NUM_ISAS; ++i)
        if (vsk::isa_supported((Isa)i)) names.emplace_back(vsk::isa_name((Isa)i));
    return names;
}

std::string best_isa() { return vsk::isa_name(vsk::best_isa()); }

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
    m.def("gelu_mul", &gelu_mul, "gelu_tanh(gate) * up of a fused gate_up row block");
    m.def("rms_norm", &rms_norm, "RMSNorm of each row, a fixed summation order");
    m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta)): a decoder layer's residual step");
    py::class_<PackedLinear>(m, "PackedLinear", "a GGUFLinear's parts and bias, for LayerStack")
        .def(py::init([](std::vector<torch::Tensor> packed, std::vector<int64_t> qtypes, std::vector<int64_t> rows,
                         c10::optional<torch::Tensor> bias) {
            TORCH_CHECK(packed.size() == qtypes.size() && packed.size() == rows.size() && !packed.empty(),
                        "one block type and row count per packed part");
            return PackedLinear{packed, qtypes, rows, bias};
        }));
    py::class_<LayerStack>(m, "LayerStack", "a decoder's causal layers in one call (the same ops, the same bits)")
        .def(py::init<int64_t, double, double, bool, torch::Tensor, torch::Tensor>())
        .def("add_layer", &LayerStack::add_layer)
        .def("run", &LayerStack::run);
    m.def("isa_names", &isa_names, "kernel ISA names, indexed by the impl number the entry points take");
    m.def("supported_isas", &supported_isas, "the kernel ISAs this CPU runs (portable always)");
    m.def("best_isa", &best_isa, "the ISA impl 0 (auto) runs on this CPU");
    m.def("cpu_features", &vsk::cpu_features, "the CPU features the dispatch looks at");
}
