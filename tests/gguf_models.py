"""Tiny GGUF models written with ``gguf``, in each block type the gguf runner multiplies.

Weights are random raw blocks (Q4_K, Q6_K) or random floats quantized by ``gguf`` (Q4_0, Q5_0, Q8_0);
the tokenizer is a 96-token byte-level BPE vocabulary, EOS 1 (``<|im_end|>``). Shapes keep every
row a whole number of 256-value super-blocks (hidden 256, ffn 512).
"""

from __future__ import annotations

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
) -> Path:
    """Write a random ``arch`` (qwen2 with q/k/v biases, or llama) model to ``path``.

    ``types`` maps a weight role to its block type; ``layer_types`` overrides it per layer;
    ``tokens``: the vocabulary (``VOCAB`` strings).
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = HIDDEN // heads
    for add, value in [
        (writer.add_context_length, 512),
        (writer.add_embedding_length, HIDDEN),
        (writer.add_block_count, num_layers),
        (writer.add_feed_forward_length, FFN),
        (writer.add_head_count, heads),
        (writer.add_head_count_kv, kv_heads),
        (writer.add_rope_freq_base, 10000.0),
        (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_rope_dimension_count, head_dim),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_tokenizer_pre, "qwen2"),
        (writer.add_token_list, tokens),
        (writer.add_token_types, [3, 3] + [1] * (VOCAB - 2)),
        (writer.add_token_merges, ["a b"]),
        (writer.add_eos_token_id, 1),
        (writer.add_bos_token_id, 0),
        (writer.add_pad_token_id, 0),
    ]:
        add(value)

    def matrix(name: str, qtype: T, rows: int, cols: int, scale: float = 2e-4) -> None:
        if qtype == T.F32:
            writer.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32))
            return
        raw = random_blocks(qtype, rows, cols, rng, scale=scale, centred=True)  # 2e-4: weights of about 0.05
        writer.add_tensor(name, raw.reshape(rows, -1), raw_dtype=qtype)

    def vector(name: str, size: int, scale: float, offset: float = 0.0) -> None:
        writer.add_tensor(name, (offset + rng.standard_normal(size) * scale).astype(np.float32))

    kv = kv_heads * head_dim
    matrix("token_embd.weight", types["token_embd"], VOCAB, HIDDEN, 3e-3)  # the current token matters
    for i in range(num_layers):
        t = (layer_types or [types] * num_layers)[i]
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", HIDDEN, 0.1, 1.0)
        matrix(p + "attn_q.weight", t["attn_q"], HIDDEN, HIDDEN, 2e-3)  # peaked attention: RoPE matters
        matrix(p + "attn_k.weight", t["attn_k"], kv, HIDDEN, 2e-3)
        matrix(p + "attn_v.weight", t["attn_v"], kv, HIDDEN)
        if arch == "qwen2":
            vector(p + "attn_q.bias", HIDDEN, 0.1)
            vector(p + "attn_k.bias", kv, 0.1)
            vector(p + "attn_v.bias", kv, 0.1)
        matrix(p + "attn_output.weight", t["attn_output"], HIDDEN, HIDDEN)
        vector(p + "ffn_norm.weight", HIDDEN, 0.1, 1.0)
        matrix(p + "ffn_gate.weight", t["ffn_gate"], FFN, HIDDEN)
        matrix(p + "ffn_up.weight", t["ffn_up"], FFN, HIDDEN)
        matrix(p + "ffn_down.weight", t["ffn_down"], HIDDEN, FFN)
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
