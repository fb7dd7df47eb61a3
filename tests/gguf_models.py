"""Tiny GGUF models written with ``gguf``, in each block type the gguf runner multiplies, for each
architecture it runs (tensor and metadata names as llama.cpp's ``convert_hf_to_gguf.py`` writes them).

Weights are random raw blocks (Q4_K, Q6_K) or random floats quantized by ``gguf`` (Q4_0, Q5_0, Q8_0);
the tokenizer is a 96-token byte-level BPE vocabulary, EOS 1 (``<|im_end|>``). Shapes keep every
row a whole number of 256-value super-blocks (hidden 256, ffn 512).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from gguf_reference import random_blocks

VOCAB = 96
HIDDEN = 256
FFN = 512

# which block type each weight gets: every type appears in a linear layer of some model
MIXED = {
    "attn_q": T.Q4_K,
    "attn_k": T.Q4_K,
    "attn_v": T.Q6_K,
    "attn_output": T.Q8_0,
    "ffn_gate": T.Q5_0,
    "ffn_up": T.Q5_0,
    "ffn_down": T.Q6_K,
    "output": T.Q6_K,
    "token_embd": T.Q4_K,
}
Q4_0_MIX = {
    "attn_q": T.Q4_0,
    "attn_k": T.Q4_0,
    "attn_v": T.Q8_0,
    "attn_output": T.Q4_0,
    "ffn_gate": T.Q4_0,
    "ffn_up": T.Q4_0,
    "ffn_down": T.Q6_K,
    "output": T.Q4_0,
    "token_embd": T.Q4_0,
}  # a llama.cpp Q4_0 file
DRAFT_LIKE = {
    "attn_q": T.Q5_0,
    "attn_k": T.Q5_0,
    "attn_v": T.Q8_0,
    "attn_output": T.Q5_0,
    "ffn_gate": T.Q5_0,
    "ffn_up": T.Q5_0,
    "ffn_down": T.Q4_K,
    "output": T.Q8_0,
    "token_embd": T.Q5_0,
}
TOKENS = ["<|endoftext|>", "<|im_end|>", "ab"] + [chr(ord("!") + i) for i in range(VOCAB - 3)]


@dataclass(frozen=True)
class Shape:
    """What an architecture's tiny file declares beyond the defaults, as llama.cpp's converter writes it.

    ``head_dim``: written as ``attention.key_length`` (None: hidden / heads, not written);
    ``window``: ``attention.sliding_window``; ``rope_dims``: ``rope.dimension_count`` (None: head_dim);
    ``linear``: ``rope.scaling.type`` linear with this factor; ``llama3``: (factor, low, high,
    original context) of Llama 3.1's scaling, written as the ``rope_freqs`` tensor
    (``convert_hf_to_gguf.py``'s ``generate_extra_tensors``); ``rope_base``: ``rope.freq_base``."""

    head_dim: int | None = None
    window: int = 0
    rope_dims: int | None = None
    linear: float | None = None
    llama3: tuple[float, float, float, int] | None = None
    rope_base: float = 10000.0


def llama3_rope_factors(head_dim: int, base: float, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """``[head_dim / 2]`` float32: the frequency divisors ``convert_hf_to_gguf.py`` writes for llama3 scaling."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf_model(
    path: Path,
    types: dict = MIXED,
    *,
    arch: str = "qwen2",
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    layer_types: list[dict] | None = None,
    tokens: list[str] = TOKENS,
    shape: Shape = Shape(),
) -> Path:
    """Write a random ``arch`` model to ``path``: qwen2 (q/k/v biases), llama (q/k rows permuted by
    the converter: the random rows stand for permuted ones), qwen3 (q/k norms), gemma3 (q/k norms,
    post-attention and post-MLP norms, tied head, norms stored as 1 + w as the converter does), phi3
    (fused attn_qkv, ffn_up holding gate and up).

    ``types`` maps a weight role to its block type; ``layer_types`` overrides it per layer;
    ``tokens``: the vocabulary (``VOCAB`` strings); ``shape``: :class:`Shape`.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = shape.head_dim or HIDDEN // heads
    metadata = [
        (writer.add_context_length, 512),
        (writer.add_embedding_length, HIDDEN),
        (writer.add_block_count, num_layers),
        (writer.add_feed_forward_length, FFN),
        (writer.add_head_count, heads),
        (writer.add_head_count_kv, kv_heads),
        (writer.add_rope_freq_base, shape.rope_base),
        (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_rope_dimension_count, shape.rope_dims or head_dim),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_tokenizer_pre, "qwen2"),
        (writer.add_token_list, tokens),
        (writer.add_token_types, [3, 3] + [1] * (VOCAB - 2)),
        (writer.add_token_merges, ["a b"]),
        (writer.add_eos_token_id, 1),
        (writer.add_bos_token_id, 0),
        (writer.add_pad_token_id, 0),
    ]
    if shape.head_dim is not None:
        metadata += [(writer.add_key_length, head_dim), (writer.add_value_length, head_dim)]
    if shape.window:
        metadata.append((writer.add_sliding_window, shape.window))
    if shape.linear is not None:
        metadata += [
            (writer.add_rope_scaling_type, gguf.RopeScalingType.LINEAR),
            (writer.add_rope_scaling_factor, shape.linear),
        ]
    for add, value in metadata:
        add(value)

    def matrix(name: str, qtype: T, rows: int, cols: int, scale: float = 2e-4) -> None:
        if qtype in (T.F32, T.F16):
            values = rng.standard_normal((rows, cols)) * (0.5 if qtype == T.F32 else 50 * scale)
            writer.add_tensor(name, values.astype(np.float32 if qtype == T.F32 else np.float16))
            return
        raw = random_blocks(qtype, rows, cols, rng, scale=scale, centred=True)  # 2e-4: weights of about 0.05
        writer.add_tensor(name, raw.reshape(rows, -1), raw_dtype=qtype)

    def vector(name: str, size: int, scale: float, offset: float = 0.0) -> None:
        writer.add_tensor(name, (offset + rng.standard_normal(size) * scale).astype(np.float32))

    q, kv = heads * head_dim, kv_heads * head_dim
    if shape.llama3 is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, shape.rope_base, *shape.llama3))
    matrix("token_embd.weight", types["token_embd"], VOCAB, HIDDEN, 3e-3)  # the current token matters
    for i in range(num_layers):
        t = (layer_types or [types] * num_layers)[i]
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", HIDDEN, 0.1, 1.0)
        if arch == "phi3":
            matrix(p + "attn_qkv.weight", t["attn_q"], q + 2 * kv, HIDDEN, 2e-3)
        else:
            matrix(p + "attn_q.weight", t["attn_q"], q, HIDDEN, 2e-3)  # peaked attention: RoPE matters
            matrix(p + "attn_k.weight", t["attn_k"], kv, HIDDEN, 2e-3)
            matrix(p + "attn_v.weight", t["attn_v"], kv, HIDDEN)
        if arch == "qwen2":
            vector(p + "attn_q.bias", q, 0.1)
            vector(p + "attn_k.bias", kv, 0.1)
            vector(p + "attn_v.bias", kv, 0.1)
        if arch in ("qwen3", "gemma3"):
            vector(p + "attn_q_norm.weight", head_dim, 0.1, 1.0)
            vector(p + "attn_k_norm.weight", head_dim, 0.1, 1.0)
        matrix(p + "attn_output.weight", t["attn_output"], HIDDEN, q)
        if arch == "gemma3":
            vector(p + "post_attention_norm.weight", HIDDEN, 0.1, 1.0)
        vector(p + "ffn_norm.weight", HIDDEN, 0.1, 1.0)
        if arch == "phi3":
            matrix(p + "ffn_up.weight", t["ffn_up"], 2 * FFN, HIDDEN)
        else:
            matrix(p + "ffn_gate.weight", t["ffn_gate"], FFN, HIDDEN)
            matrix(p + "ffn_up.weight", t["ffn_up"], FFN, HIDDEN)
        matrix(p + "ffn_down.weight", t["ffn_down"], HIDDEN, FFN)
        if arch == "gemma3":
            vector(p + "post_ffw_norm.weight", HIDDEN, 0.1, 1.0)
    vector("output_norm.weight", HIDDEN, 0.1, 1.0)
    if types.get("output") is not None:
        matrix("output.weight", types["output"], VOCAB, HIDDEN, 2e-3)  # logits of a few units
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def perturbed_copy(source: Path, destination: Path, tensor: str, fraction: float, seed: int = 0) -> Path:
    """``source`` with a ``fraction`` of the bytes of ``tensor``'s data randomised: a draft that
    agrees with the source model some of the time."""
    from verispec.models.gguf_file import read_gguf_header

    info = read_gguf_header(source).tensors[tensor]
    if info.qtype != T.Q6_K:
        raise ValueError("perturbed_copy changes the 4-bit parts of Q6_K blocks only")
    data = bytearray(source.read_bytes())
    rng = np.random.default_rng(seed)
    blocks = info.n_bytes // 210
    for block in rng.choice(blocks, max(1, int(blocks * fraction)), replace=False):  # low nibbles: scales untouched
        start = info.offset + 210 * int(block)
        data[start : start + 128] = bytes(rng.integers(0, 256, 128, dtype=np.uint8))
    destination.write_bytes(bytes(data))
    return destination
