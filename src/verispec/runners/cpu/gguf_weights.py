"""Reading a GGUF file into the decoder the gguf and int8 runners run: :class:`GGUFWeights`.

Owns turning a GGUF file of an architecture :mod:`verispec.runners.cpu.gguf_arch` describes (Llama,
Qwen2, Qwen3, Gemma 3, Phi-3) into :class:`GGUFWeights` (:class:`GGUFLoader`): each weight
matrix's blocks (:data:`verispec.runners.cpu.gguf_blocks.SUPPORTED_TYPES`: the same bits llama.cpp
runs) are memory-mapped one tensor at a time (no fp32 model; the mapping goes once the tensor is
repacked) and repacked into the kernels' 16-column tiles (a draft may be re-quantized to 4 bits on
the way: :data:`REQUANTIZATIONS`); norms, biases and RoPE tables (:func:`rope_tables`) stay float32;
the token embedding stays mapped, its rows de-quantized on lookup. Knows nothing about the pass.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from verispec.errors import InvalidParameterError, ModelIntegrityError
from verispec.models.gguf_file import GGUFHeader, TensorInfo, read_gguf_header
from verispec.runners.cpu.context_head import ContextHeadRows
from verispec.runners.cpu.gguf_arch import SUPPORTED_ARCHITECTURES, Architecture, read_architecture
from verispec.runners.cpu.gguf_blocks import (
    FLOAT_TYPES,
    FOUR_BIT_TYPES,
    IQ4_NL,
    Q4_0,
    SUPPORTED_TYPES,
    GGUFEmbedding,
    GGUFLinear,
    loaded_kernels,
)
from verispec.runners.cpu.int8_weights import Int8Layer, decoder_nbytes
from verispec.runners.cpu.rope import rope_tables, unpermute_rows
from verispec.runners.kernels import kernel_isa_number

# What ``requantize`` may ask of the loader: re-quantize every matrix stored in more than 4.5 bits
# per weight (Q5_0, Q8_0, Q6_K) to "q4_0" (ggml's quantize_row_q4_0_ref) or "iq4_nl" (16
# non-uniform levels, the scale searched as llama.cpp's IQ4_NL quantizer does: about 0.7x Q4_0's
# error); the 4.5-bit types (Q4_K, Q4_0, IQ4_NL) stay. For a draft model only: its weights decide
# what it proposes, never what the target emits.
REQUANTIZATIONS = {"q4_0": Q4_0, "iq4_nl": IQ4_NL}
REQUANTIZE_CACHE_VERSION = 2  # bump when requantize_4bit's results change
__all__ = ["SUPPORTED_ARCHITECTURES", "GGUFLoader", "GGUFWeights", "rope_tables", "unpermute_rows"]


@dataclass
class GGUFWeights:
    """A decoder as :class:`verispec.runners.cpu.int8.Int8Runner` runs it (its structure: ``arch``), with the
    embedding in the GGUF's own blocks and GGUF-block linear layers (:class:`GGUFLinear`;
    :func:`verispec.runners.cpu.int8_gguf.int8_weights_from_gguf` puts
    :class:`verispec.runners.cpu.int8_ops.Int8Weight` layers here instead).

    ``cos``/``sin``: ``[max_positions, rot]`` float32 RoPE tables (``local_cos``/``local_sin``: the
    local layers', or None). ``head_token_ids``
    ``[kept]`` int64: the rows a reduced draft head keeps (FR-Spec), None for the full head;
    ``context_head``: each sequence's own rows added to it (:mod:`verispec.runners.cpu.context_head`).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    embedding: GGUFEmbedding
    layers: list[Int8Layer]
    final_norm: Tensor
    lm_head: GGUFLinear
    cos: Tensor
    sin: Tensor
    head_token_ids: Tensor | None = None
    load_time_s: float = 0.0
    head_rows: GGUFEmbedding | None = None  # the LM head's rows as the file stores them (token_embd when tied)
    arch: Architecture = field(default_factory=Architecture)
    local_cos: Tensor | None = None
    local_sin: Tensor | None = None
    context_head: ContextHeadRows | None = None  # a reduced head's rows to add per sequence

    def output_rows(self, ids: Tensor) -> Tensor:
        """float32 ``[n, hidden]``: rows ``ids`` (int64 ``[n]``, full-vocabulary ids) of the
        target's LM head as the file holds them, de-quantized (what an EAGLE head that shares
        the target's LM head drafts with). Raises InvalidParameterError when not kept."""
        if self.head_rows is None:
            raise InvalidParameterError("these weights keep no LM-head rows to lend")
        return self.head_rows(ids)

    @property
    def vocab_size(self) -> int:
        return self.embedding.raw.shape[0] if self.head_token_ids is not None else self.lm_head.out_features

    def embed(self, ids: Tensor) -> Tensor:
        return self.embedding(ids)

    def nbytes(self) -> int:
        """Bytes held: packed blocks, the raw (mapped) embedding, norms, biases and RoPE tables."""
        return self.embedding.raw.numel() + decoder_nbytes(self)

    @classmethod
    def from_file(
        cls,
        path: Path,
        max_positions: int,
        *,
        head_token_ids: Tensor | None = None,
        context_rows: bool = False,
        requantize: str | None = None,
        cache_dir: Path | None = None,
    ) -> GGUFWeights:
        """Read and repack ``path`` (see the module docstring); ``context_rows``: a reduced head
        (``head_token_ids``) adds the rows of each sequence's tokens; ``requantize``: one of
        :data:`REQUANTIZATIONS` or None (the file's own blocks); ``cache_dir``: where re-quantized
        matrices are kept for the next load (:class:`verispec.runners.cpu.weight_cache.WeightCache`;
        None: computed every time).

        Raises:
            InvalidParameterError: what :func:`read_architecture` refuses, a weight in a block type
                the kernels do not multiply (named), or an unknown ``requantize``.
            ModelIntegrityError: a missing tensor, a truncated file, or a tensor of the wrong shape.
        """
        start = time.perf_counter()
        header = read_gguf_header(Path(path))
        loader = GGUFLoader(header, requantize=requantize, cache_dir=cache_dir)
        weights = loader.weights(max_positions, head_token_ids, context_rows)
        if loader.cache is not None:
            loader.cache.finish()
        weights.load_time_s = time.perf_counter() - start
        return weights


class GGUFLoader:
    def __init__(self, header: GGUFHeader, *, requantize: str | None = None, cache_dir: Path | None = None) -> None:
        if requantize is not None and requantize not in REQUANTIZATIONS:
            raise InvalidParameterError(
                f"unknown re-quantization {requantize!r}; choose one of {', '.join(REQUANTIZATIONS)}"
            )
        self.requantize = requantize
        self.cache = None
        if requantize is not None and cache_dir is not None:
            from verispec.runners.cpu.weight_cache import WeightCache

            self.cache = WeightCache(Path(header.path), cache_dir, requantize, REQUANTIZE_CACHE_VERSION)
            if not self.cache.hit and requantize == "iq4_nl":
                print(
                    f"verispec: re-quantizing {Path(header.path).name} to IQ4_NL (once, a few seconds; kept in "
                    f"{cache_dir})",
                    file=sys.stderr,
                    flush=True,
                )
        self.header = header
        self.path = header.path
        self.arch = read_architecture(header)  # refuses what the forward does not implement, before any tensor
        self.hidden = int(header.arch_value("embedding_length"))
        self.num_heads = int(header.arch_value("attention.head_count"))
        self.num_kv_heads = int(header.arch_value("attention.head_count_kv", self.num_heads))
        self.head_dim = int(header.arch_value("attention.key_length", self.hidden // self.num_heads))
        self.num_layers = int(header.arch_value("block_count"))
        self.eps = float(header.arch_value("attention.layer_norm_rms_epsilon", 1e-6))

    def tensor(self, name: str) -> TensorInfo:
        info = self.header.tensors.get(name)
        if info is None:
            raise ModelIntegrityError(f"{self.path} has no tensor {name!r}")
        return info

    def raw(self, info: TensorInfo, start: int = 0, length: int | None = None) -> Tensor:
        """The tensor's bytes (or ``length`` of them from ``start``), memory-mapped copy-on-write:
        file pages, resident only while used and released when the tensor is dropped (after
        repacking), so loading never holds the file twice."""
        if info.offset + info.n_bytes > self.header.file_size:
            raise ModelIntegrityError(f"{self.path} is truncated inside tensor {info.name}")
        length = info.n_bytes - start if length is None else length
        if length <= 0:
            return torch.empty(0, dtype=torch.uint8)
        mapped = np.memmap(self.path, dtype=np.uint8, mode="c", offset=info.offset + start, shape=(length,))
        return torch.from_numpy(mapped)

    def floats(self, name: str) -> Tensor:
        info = self.tensor(name)
        if info.qtype not in FLOAT_TYPES:
            raise InvalidParameterError(
                f"{name} in {self.path} is {info.type_name}; the gguf runner expects F32/F16 there"
            )
        return torch.from_numpy(self.raw(info).numpy().view(FLOAT_TYPES[info.qtype]).astype(np.float32))

    def rows(
        self, name: str, expected_in: int, *, any_type: bool = False, row_range: tuple[int, int] | None = None
    ) -> tuple[Tensor, TensorInfo]:
        """Raw blocks ``[out, row_bytes]`` uint8 of a 2-D weight with rows of ``expected_in`` values
        (``any_type``: also block types the kernels do not multiply; ``row_range``: only rows
        ``start .. stop - 1`` (clipped), mapped by themselves)."""
        info = self.tensor(name)
        if len(info.shape) != 2 or info.shape[0] != expected_in:
            raise ModelIntegrityError(
                f"{name} in {self.path} has shape {list(info.shape)}, expected rows of {expected_in}"
            )
        if info.qtype not in SUPPORTED_TYPES and not any_type:
            supported = ", ".join(SUPPORTED_TYPES.values())
            raise InvalidParameterError(
                f"{name} in {self.path} is stored as {info.type_name}, which the gguf runner does not multiply "
                f"(it supports {supported}): use --runner int8 or llamacpp"
            )
        out_features = int(info.shape[1])
        if row_range is None:
            return self.raw(info).view(out_features, -1), info
        row_bytes = info.n_bytes // out_features
        start, stop = max(0, row_range[0]), min(out_features, row_range[1])
        return self.raw(info, start * row_bytes, (stop - start) * row_bytes).view(stop - start, row_bytes), info

    def linear(
        self,
        names: Sequence[str],
        in_features: int,
        *,
        permute_heads: Sequence[int | None] = (),
        bias: Tensor | None = None,
        row_ids: Tensor | None = None,
    ) -> GGUFLinear:
        """One linear layer from tensors ``names`` stacked along the output (e.g. q, k, v)."""
        kernels = loaded_kernels()
        groups: list[tuple[int, list[Tensor]]] = []
        for index, name in enumerate(names):
            raw, qtype = self.multiplied(name, in_features)
            heads = permute_heads[index] if index < len(permute_heads) else None
            if heads is not None:
                raw = raw[unpermute_rows(raw.shape[0], heads)]
            if row_ids is not None:
                raw = raw[row_ids]
            if groups and groups[-1][0] == qtype:
                groups[-1][1].append(raw)
            else:
                groups.append((qtype, [raw]))
        parts = []
        for qtype, raws in groups:
            block = torch.cat(raws) if len(raws) > 1 else raws[0]
            packed = kernels.repack(block.contiguous().view(-1), qtype, block.shape[0], in_features)
            parts.append((packed, qtype, block.shape[0]))
        return GGUFLinear(parts, in_features, bias)

    def multiplied(self, name: str, in_features: int) -> tuple[Tensor, int]:
        """Raw blocks ``[out, row_bytes]`` of ``name`` as the kernels will multiply them, and their
        block type: re-quantized when ``requantize`` asks it of this block type."""
        raw, info = self.rows(name, in_features)
        qtype = info.qtype
        if self.requantize is not None and qtype not in FOUR_BIT_TYPES and in_features % 32 == 0:
            # per row, so re-quantizing the whole matrix then picking rows equals the reverse
            raw, qtype = self._requantized(name, raw, qtype, in_features), REQUANTIZATIONS[self.requantize]
        return raw, qtype

    def _requantized(self, name: str, raw: Tensor, qtype: int, in_features: int) -> Tensor:
        """``raw`` ``[out, row_bytes]`` re-quantized to ``self.requantize`` blocks, from the weight
        cache when one is open (the scale search of IQ4_NL takes seconds per model)."""
        to = REQUANTIZATIONS[self.requantize]

        def compute() -> tuple[Tensor]:
            flat = loaded_kernels().requantize_4bit(
                raw.contiguous().view(-1), qtype, raw.shape[0], in_features, to, kernel_isa_number()
            )
            return (flat.view(raw.shape[0], -1),)

        if self.cache is None:
            return compute()[0]
        return self.cache.get(name, compute)[0]

    @property
    def q_heads(self) -> tuple:
        """Heads of q, k, v whose rows llama.cpp's converter interleaved (llama files), else ()."""
        return (self.num_heads, self.num_kv_heads, None) if self.arch.permuted_qk else ()

    def qkv_bias(self, prefix: str) -> Tensor | None:
        """The fused q/k/v bias of layer ``prefix`` (rows in the un-permuted order), None without one.

        Raises ModelIntegrityError when only some of the three are present."""
        names = [prefix + "attn_q.bias", prefix + "attn_k.bias", prefix + "attn_v.bias"]
        present = [name in self.header.tensors for name in names]
        if not any(present):
            return None
        if not all(present):
            raise ModelIntegrityError(f"{self.path} has only some of the biases {names}")
        values = []
        for name, heads in zip(names, self.q_heads or (None, None, None)):
            value = self.floats(name)
            values.append(value[unpermute_rows(value.shape[0], heads)] if heads is not None else value)
        return torch.cat(values)

    def decoder_layers(self, linear: Callable) -> list[Int8Layer]:
        """One :class:`Int8Layer` per block, its matrices made by ``linear(names, in_features,
        heads, bias)`` (q, k and v fused; gate and up fused, as the file fuses them or not); the
        norms :attr:`arch` declares; the C heap trimmed after each.

        Raises ModelIntegrityError when a fused matrix has the wrong number of rows."""
        arch, layers = self.arch, []
        for i in range(self.num_layers):
            p = f"blk.{i}."
            ffn = int(self.tensor(p + "ffn_down.weight").shape[0])
            if arch.fused_qkv:
                qkv = linear([p + "attn_qkv.weight"], self.hidden, (), None)
            else:
                names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
                qkv = linear(names, self.hidden, self.q_heads, self.qkv_bias(p))
            if arch.fused_gate_up:
                gate_up = linear([p + "ffn_up.weight"], self.hidden, (), None)
            else:
                gate_up = linear([p + "ffn_gate.weight", p + "ffn_up.weight"], self.hidden, (), None)
            expected = ((self.num_heads + 2 * self.num_kv_heads) * self.head_dim, 2 * ffn)
            if (qkv.out_features, gate_up.out_features) != expected:
                raise ModelIntegrityError(f"{self.path}: layer {i}'s q/k/v or gate/up rows do not match the header")
            norm = self.floats
            layers.append(
                Int8Layer(
                    input_norm=norm(p + "attn_norm.weight"),
                    qkv=qkv,
                    o=linear([p + "attn_output.weight"], self.num_heads * self.head_dim, (), None),
                    post_norm=norm(p + "ffn_norm.weight"),
                    gate_up=gate_up,
                    down=linear([p + "ffn_down.weight"], ffn, (), None),
                    q_norm=norm(p + "attn_q_norm.weight") if arch.qk_norm else None,
                    k_norm=norm(p + "attn_k_norm.weight") if arch.qk_norm else None,
                    attn_post_norm=norm(p + "post_attention_norm.weight") if arch.post_norms else None,
                    ffn_post_norm=norm(p + "post_ffw_norm.weight") if arch.post_norms else None,
                )
            )
            release_freed_memory()
        return layers

    def rope_tables(self, max_positions: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """``cos``, ``sin`` and the local layers' ``local_cos``, ``local_sin`` (or None), each
        ``[max_positions, rot]`` float32, for :attr:`arch`'s RoPE (with the file's ``rope_freqs``)."""
        rope = self.arch.rope
        factors = self.floats("rope_freqs.weight") if rope.freq_factors else None
        cos, sin = rope_tables(rope.dims, rope.base, max_positions, factor=rope.factor, freq_factors=factors)
        if rope.local_base is None:
            return cos, sin, None, None
        return (cos, sin, *rope_tables(rope.dims, rope.local_base, max_positions))

    def weights(self, max_positions: int, head_token_ids: Tensor | None, context_rows: bool = False) -> GGUFWeights:
        hidden = self.hidden
        layers = self.decoder_layers(
            lambda names, in_features, heads, bias: self.linear(names, in_features, permute_heads=heads, bias=bias)
        )
        embed_info = self.tensor("token_embd.weight")
        embedding = GGUFEmbedding(self.raw(embed_info).view(int(embed_info.shape[1]), -1), embed_info.qtype, hidden)
        head_name = "output.weight" if "output.weight" in self.header.tensors else "token_embd.weight"
        row_ids = None if head_token_ids is None else head_token_ids.long()
        context = None  # the head's rows as multiplied, for each sequence's own rows
        if context_rows and row_ids is not None:
            context = ContextHeadRows(*self.multiplied(head_name, hidden), hidden, row_ids)
        lm_head = context.linear(row_ids) if context else self.linear([head_name], hidden, row_ids=row_ids)
        head_rows = embedding
        if head_name != "token_embd.weight":
            head_info = self.tensor(head_name)
            head_rows = GGUFEmbedding(self.raw(head_info).view(int(head_info.shape[1]), -1), head_info.qtype, hidden)
        weights = self.assemble(embedding, layers, lm_head, max_positions, row_ids, head_rows)
        weights.context_head = context
        return weights

    def assemble(
        self, embedding, layers: list, lm_head, max_positions: int, head_token_ids: Tensor | None, head_rows=None
    ) -> GGUFWeights:
        """The :class:`GGUFWeights` of these layers and head, with what the header gives every
        runner: shapes, the final norm, the RoPE tables for ``max_positions`` and the architecture."""
        cos, sin, local_cos, local_sin = self.rope_tables(max_positions)
        return GGUFWeights(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.eps,
            embedding=embedding,
            layers=layers,
            final_norm=self.floats("output_norm.weight"),
            lm_head=lm_head,
            cos=cos,
            sin=sin,
            head_token_ids=head_token_ids,
            head_rows=head_rows,
            arch=self.arch,
            local_cos=local_cos,
            local_sin=local_sin,
        )


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).
    Loading frees many medium-sized buffers (raw blocks, re-quantized pieces) that glibc would
    otherwise keep resident: called after each decoder layer, it lowers the peak RSS."""
    if not _LIBC:
        try:
            import ctypes

            _LIBC.append(getattr(ctypes.CDLL("libc.so.6"), "malloc_trim", None))
        except OSError:
            _LIBC.append(None)
    if _LIBC[0] is not None:
        _LIBC[0](0)


_LIBC: list = []
