"""The gguf kernels: repacked GGUF blocks times int8 activations, bit-exact against a numpy oracle.

Each block type the runner uses (Q4_K, Q6_K, Q4_0, IQ4_NL, Q5_0, Q8_0): the oracle's integer decoding equals
gguf's own de-quantization; the kernel equals the oracle's arithmetic bit for bit on both the
AVX-512 and the portable path; every row of a k-row product equals the 1-row product; the
result is close to the float product; re-quantizing any of them to Q4_0 equals gguf's own Q4_0
quantizer on the de-quantized values, and to IQ4_NL the oracle's scale search (with less error
than Q4_0); attention rows equal their one-query computation.
"""

import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from gguf_reference import TYPES, dequantize, quantize_iq4_nl, random_blocks, reference_linear
from helpers import single_thread
from verispec.runners.kernels import ISA_NUMBERS, gguf_kernels

# every path this CPU runs (portable first: the oracle of the others), as the kernels' impl numbers
IMPLS = [ISA_NUMBERS[name] for name in gguf_kernels().supported_isas()]


def packed(qtype, raw, out_features, in_features):
    return gguf_kernels().repack(
        torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1), int(qtype), out_features, in_features
    )


@pytest.mark.parametrize("qtype", TYPES)
def test_oracle_decoding_equals_gguf_dequantize(qtype):
    raw = random_blocks(qtype, 24, 512, np.random.default_rng(1))
    expected = quants.dequantize(raw, qtype).reshape(24, 512)
    assert np.array_equal(dequantize(qtype, raw, 512), expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "qtype, out_features, in_features",
    [
        (T.Q4_K, 48, 512),  # two super-blocks, three tiles
        (T.Q6_K, 40, 768),  # 40 columns: the last tile is half padding
        (T.Q4_0, 24, 160),  # five 32-blocks, two tiles (the second half padding)
        (T.IQ4_NL, 20, 96),  # three 32-blocks, two tiles
        (T.Q5_0, 16, 96),  # three 32-blocks, one tile
        (T.Q8_0, 33, 64),  # 33 columns: one real column in the last tile
    ],
)
def test_kernel_equals_oracle_bit_for_bit(qtype, out_features, in_features, impl):
    rng = np.random.default_rng(2)
    raw = random_blocks(qtype, out_features, in_features, rng)
    x = rng.standard_normal((11, in_features)).astype(np.float32)
    x[3] = 0.0  # an all-zero row: scale 0, output 0
    x[4, :32] *= 1000.0  # one large block
    x[5] = rng.integers(-126, 126, in_features) + 0.5  # exact ties: scale 1, so q rounds half to even
    x[5, ::32] = 127.0
    x[6, ::2] = -0.0  # negative zeros beside ordinary values
    y = gguf_kernels().linear(
        torch.from_numpy(x), packed(qtype, raw, out_features, in_features), int(qtype), out_features, impl
    )
    assert y.shape == (11, -(-out_features // 16) * 16)
    assert np.array_equal(y[:, :out_features].numpy(), reference_linear(qtype, raw, x))
    assert torch.all(y[:, out_features:] == 0)  # padding columns
    assert torch.all(y[3] == 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qtype", TYPES)
def test_every_row_of_a_k_row_product_equals_the_one_row_product(qtype, impl):
    rng = np.random.default_rng(3)
    raw = random_blocks(qtype, 64, 512, rng)
    weight = packed(qtype, raw, 64, 512)
    x = torch.from_numpy(rng.standard_normal((17, 512)).astype(np.float32))
    singles = torch.cat([gguf_kernels().linear(x[i : i + 1], weight, int(qtype), 64, impl) for i in range(17)])
    for k in range(1, 18):  # every register-tile remainder, up to 17 rows
        assert torch.equal(gguf_kernels().linear(x[:k], weight, int(qtype), 64, impl), singles[:k]), k


@pytest.mark.parametrize("qtype", TYPES)
def test_every_path_equals_the_portable_one_bit_for_bit_for_1_to_16_rows(qtype):
    """Same bits, NaN payloads and signed zeros included: rows with a NaN, an infinity, an
    all-zero block and values at the int8 clamp, for every row count of a verify pass."""
    rng = np.random.default_rng(9)
    in_features = 768 if qtype in (T.Q4_K, T.Q6_K) else 224  # 3 super-blocks / 7 blocks
    raw = random_blocks(qtype, 40, in_features, rng)  # 40 columns: a half-padded last tile
    weight = packed(qtype, raw, 40, in_features)
    x = rng.standard_normal((16, in_features)).astype(np.float32) * rng.uniform(0.01, 100, (16, 1)).astype(np.float32)
    x[1, 7] = np.nan
    x[2, 40] = np.inf
    x[3, :256] = 0.0
    x[4, ::3] = -0.0
    x = torch.from_numpy(x)
    for k in range(1, 17):
        portable = gguf_kernels().linear(x[:k], weight, int(qtype), 40, ISA_NUMBERS["portable"]).view(torch.int32)
        for impl in IMPLS[1:]:
            assert torch.equal(
                gguf_kernels().linear(x[:k], weight, int(qtype), 40, impl).view(torch.int32), portable
            ), (k, impl)


def test_rows_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(4)
    raw = random_blocks(T.Q4_K, 256, 512, rng)
    weight = packed(T.Q4_K, raw, 256, 512)
    x = torch.from_numpy(rng.standard_normal((9, 512)).astype(np.float32))
    one = gguf_kernels().linear(x, weight, int(T.Q4_K), 256, 0)
    torch.set_num_threads(2)
    try:
        assert torch.equal(gguf_kernels().linear(x, weight, int(T.Q4_K), 256, 0), one)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("qtype", TYPES)
def test_product_is_close_to_the_float_product(qtype):
    rng = np.random.default_rng(5)
    raw = random_blocks(qtype, 32, 512, rng)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    exact = x @ quants.dequantize(raw, qtype).reshape(32, 512).T
    y = gguf_kernels().linear(torch.from_numpy(x), packed(qtype, raw, 32, 512), int(qtype), 32, 0)[:, :32].numpy()
    assert np.abs(y - exact).max() <= 0.02 * np.abs(exact).max()  # int8 activations: ~0.5 % per value


@pytest.mark.parametrize("qtype", TYPES)
def test_requantize_q4_0_equals_gguf_quantizing_the_dequantized_weights(qtype):
    rng = np.random.default_rng(6)
    raw = random_blocks(qtype, 37, 512, rng)
    raw[5] = 0  # an all-zero row (Q4_K/Q6_K: d = 0): d = 0 and every q = 8, as gguf writes it
    expected = quants.quantize(quants.dequantize(raw, qtype).reshape(37, 512).astype(np.float32), T.Q4_0)
    ours = gguf_kernels().requantize_4bit(
        torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1), int(qtype), 37, 512, int(T.Q4_0), 0
    )
    assert ours.dtype == torch.uint8 and np.array_equal(ours.numpy().reshape(expected.shape), expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qtype", TYPES)
def test_requantize_iq4_nl_equals_the_oracle_and_beats_q4_0(qtype, impl):
    rng = np.random.default_rng(7)
    raw = random_blocks(qtype, 6, 256, rng)
    raw[2] = 0  # an all-zero row: d = 0
    values = quants.dequantize(raw, qtype).reshape(6, 256).astype(np.float32)
    flat = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1)
    ours = gguf_kernels().requantize_4bit(flat, int(qtype), 6, 256, int(T.IQ4_NL), impl).numpy().reshape(6, -1)
    assert np.array_equal(ours, quantize_iq4_nl(values))
    if qtype in (T.Q5_0, T.Q8_0):  # normal weights (K-quant blocks here are uniform noise; Q4_0 to Q4_0 is exact)
        iq4_error = np.square(quants.dequantize(ours, T.IQ4_NL).reshape(6, 256) - values).mean()
        q4_0_error = np.square(
            quants.dequantize(quants.quantize(values, T.Q4_0), T.Q4_0).reshape(6, 256) - values
        ).mean()
        assert iq4_error < 0.8 * q4_0_error


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda k: k.repack(torch.zeros(10, dtype=torch.uint8), int(T.Q4_K), 1, 256), "raw size"),  # wrong byte count
        (lambda k: k.repack(torch.zeros(144, dtype=torch.uint8), int(T.Q4_K), 1, 100), "multiple of 256"),  # ragged row
        (lambda k: k.repack(torch.zeros(18, dtype=torch.uint8), int(T.Q4_1), 1, 32), "unsupported GGUF block type"),
        (
            lambda k: k.linear(torch.zeros(1, 64), torch.zeros(544, dtype=torch.uint8), int(T.Q8_0), 16, 0),
            "does not match",
        ),
    ],
)
def test_bad_shapes_and_types_are_refused(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(gguf_kernels())


def attention_by_hand(q, keys, values, slots):
    """One query ``q`` [heads, head_dim] over ``slots`` of keys/values [kv_heads, capacity, head_dim]."""
    group = q.shape[0] // keys.shape[0]
    k = keys[:, slots].repeat_interleave(group, 0)
    v = values[:, slots].repeat_interleave(group, 0)
    weights = torch.softmax((q[:, None, :] * k).sum(-1) * q.shape[-1] ** -0.5, dim=-1)
    return (weights[..., None] * v).sum(1).reshape(-1)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_rows_are_their_one_query_results(impl):
    generator = torch.Generator().manual_seed(6)
    keys, values = torch.randn(2, 64, 32, generator=generator), torch.randn(2, 64, 32, generator=generator)
    q = torch.randn(9, 6, 32, generator=generator)
    empty = torch.empty(0, dtype=torch.int64)
    causal = gguf_kernels().attention(q, keys, values, 20, empty, empty, 32**-0.5, impl, 0)
    for i in range(9):
        one = gguf_kernels().attention(q[i : i + 1], keys, values, 20 + i, empty, empty, 32**-0.5, impl, 0)
        assert torch.equal(causal[i], one[0])  # same op, same keys: bit-identical
        torch.testing.assert_close(causal[i], attention_by_hand(q[i], keys, values, list(range(21 + i))))
    # a tree row seeing slots [0..19, 22, 25] equals the causal row at the same keys, moved together
    slots = torch.tensor([list(range(20)) + [22, 25]])
    tree = gguf_kernels().attention(q[:1], keys, values, 0, slots, torch.tensor([22]), 32**-0.5, impl, 0)
    moved_k, moved_v = keys.clone(), values.clone()
    moved_k[:, 20:22], moved_v[:, 20:22] = keys[:, [22, 25]], values[:, [22, 25]]
    chain = gguf_kernels().attention(q[:1], moved_k, moved_v, 21, empty, empty, 32**-0.5, impl, 0)
    assert torch.equal(tree, chain)
    # a sliding window of 5: row i sees slots 16 + i .. 20 + i, the same bits as alone
    windowed = gguf_kernels().attention(q, keys, values, 20, empty, empty, 32**-0.5, impl, 5)
    for i in range(9):
        one = gguf_kernels().attention(q[i : i + 1], keys, values, 20 + i, empty, empty, 32**-0.5, impl, 5)
        assert torch.equal(windowed[i], one[0])
        torch.testing.assert_close(windowed[i], attention_by_hand(q[i], keys, values, list(range(16 + i, 21 + i))))
    assert not torch.equal(windowed[8], causal[8])  # the window changed what row 8 sees


def test_attention_paths_give_the_same_bits():
    """The vector paths' many-keys-at-once reductions add each key's partial sums in the portable
    tree's order: every path agrees with the portable one bit for bit (head_dim 64 and 128, GQA groups,
    a short last group)."""
    if len(IMPLS) < 2:
        pytest.skip("this CPU runs the portable path only")
    generator = torch.Generator().manual_seed(8)
    empty = torch.empty(0, dtype=torch.int64)
    for head_dim, kv_heads, heads, start in [(64, 2, 14, 37), (128, 2, 12, 0), (32, 1, 3, 70)]:
        keys = torch.randn(kv_heads, 96, head_dim, generator=generator) * 3
        values = torch.randn(kv_heads, 96, head_dim, generator=generator)
        q = torch.randn(5, heads, head_dim, generator=generator)
        got = [
            gguf_kernels().attention(q, keys, values, start, empty, empty, head_dim**-0.5, impl, 0) for impl in IMPLS
        ]
        assert all(torch.equal(got[0], other) for other in got[1:])
        slots = torch.tensor([[0, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61]] * 5)
        lengths = torch.tensor([18, 17, 16, 1, 3])
        tree = [gguf_kernels().attention(q, keys, values, 0, slots, lengths, head_dim**-0.5, impl, 0) for impl in IMPLS]
        assert all(torch.equal(tree[0], other) for other in tree[1:])


def test_python_isa_numbers_are_the_kernels_own():
    """ISA_NUMBERS (Python) and vsk::Isa (dispatch.cpp) name the same numbers: a path forced by
    name runs that path, and auto is the best one the CPU has."""
    kernels = gguf_kernels()
    assert list(ISA_NUMBERS) == kernels.isa_names()
    assert kernels.supported_isas()[0] == "portable" and kernels.best_isa() in kernels.supported_isas()


def test_silu_mul_paths_give_the_same_bits_and_silu():
    """Every path's SwiGLU (AVX2 has its own vector exp) equals the portable one bit for bit, the
    clamps and non-finite inputs included, and is torch's silu(gate) * up to float rounding."""
    generator = torch.Generator().manual_seed(3)
    gate = torch.randn(3, 1000, generator=generator) * 20
    gate[0, :12] = torch.tensor(
        [0.0, -0.0, 87.0, -87.0, 88.5, -88.5, 1e30, -1e30, float("inf"), float("-inf"), float("nan"), 1e-40]
    )
    gate_up = torch.cat([gate, torch.randn(3, 1000, generator=generator)], dim=1)
    got = [gguf_kernels().silu_mul(gate_up, impl) for impl in IMPLS]
    assert all(torch.equal(got[0].view(torch.int32), other.view(torch.int32)) for other in got[1:])
    finite = gate.abs() < 80
    expected = torch.nn.functional.silu(gate) * gate_up[:, 1000:]
    assert torch.allclose(got[0][finite], expected[finite], rtol=1e-5, atol=1e-6)


def test_rms_norm_is_row_local_and_the_residual_sum_is_torchs():
    """The kernels' RMSNorm: each row alone gives the bits it gives among 9 rows, within float
    rounding of torch's; add_rms_norm's sum is torch's x + delta bit for bit and its norm the
    same function's."""
    generator = torch.Generator().manual_seed(4)
    x, delta = torch.randn(9, 1536, generator=generator) * 4, torch.randn(9, 1536, generator=generator)
    weight = torch.randn(1536, generator=generator)
    kernels = gguf_kernels()
    rows = kernels.rms_norm(x, weight, 1e-6)
    assert all(torch.equal(kernels.rms_norm(x[i : i + 1], weight, 1e-6), rows[i : i + 1]) for i in range(9))
    assert torch.allclose(rows, torch.nn.functional.rms_norm(x, (1536,), weight, 1e-6), rtol=1e-5, atol=1e-5)
    total, normed = kernels.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, kernels.rms_norm(x + delta, weight, 1e-6))
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(x, weight[:10], 1e-6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_packed_weights_of_2_mb_or_more_start_on_a_huge_page_and_give_the_same_product():
    rng = np.random.default_rng(9)
    raw = random_blocks(T.Q4_K, 8192, 512, rng)  # 8192 x 512 Q4_K: 2.3 MiB of tiles
    big = packed(T.Q4_K, raw, 8192, 512)
    assert big.numel() >= 2 << 20 and big.data_ptr() % (2 << 20) == 0
    x = rng.standard_normal((3, 512)).astype(np.float32)
    y = gguf_kernels().linear(torch.from_numpy(x), big, int(T.Q4_K), 8192, ISA_NUMBERS["portable"])
    small = [packed(T.Q4_K, raw[i : i + 1024], 1024, 512) for i in range(0, 8192, 1024)]  # each under 2 MiB
    assert torch.equal(big, torch.cat(small))  # tiles of 16 columns, one after the other: every byte
    parts = [gguf_kernels().linear(torch.from_numpy(x), p, int(T.Q4_K), 1024, ISA_NUMBERS["portable"]) for p in small]
    assert torch.equal(y, torch.cat(parts, dim=1))


def test_a_pass_keeps_the_isa_it_started_with(monkeypatch):
    from verispec.runners.kernels import kernel_isa_number, one_isa

    monkeypatch.delenv("VERISPEC_KERNEL_ISA", raising=False)
    best = kernel_isa_number()
    with one_isa():
        monkeypatch.setenv("VERISPEC_KERNEL_ISA", "portable")  # read once, on entry
        assert kernel_isa_number() == best
        with one_isa():  # nested: the outer pass's
            assert kernel_isa_number() == best
        assert kernel_isa_number() == best
    assert kernel_isa_number() == ISA_NUMBERS["portable"]  # after the pass: the setting again
