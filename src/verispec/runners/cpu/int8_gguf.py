"""The int8 runner's weights read straight from a GGUF file (``--runner int8`` on GGUF models).

Owns the layer-by-layer re-quantization of GGUF blocks to per-row int8 (the gguf kernels'
``requantize_int8``, gguf's numpy code for other block types, kept in a
:class:`verispec.runners.cpu.weight_cache.WeightCache` so a later load reads them instead) and the
LM head packed in row ranges; reuses the gguf runner's loader, embedding and RoPE tables. Knows
nothing about decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError
from verispec.models.gguf_file import TensorInfo, read_gguf_header
from verispec.runners.cpu.gguf_blocks import SUPPORTED_TYPES, GGUFEmbedding, dequantize_blocks, loaded_kernels
from verispec.runners.cpu.gguf_weights import GGUFLoader, GGUFWeights, release_freed_memory
from verispec.runners.cpu.rope import unpermute_rows
from verispec.runners.cpu.weight_cache import WeightCache

INT8_CACHE_VERSION = 1  # bump when the re-quantization (requantize_int8 and its callers) changes


def int8_weights_from_gguf(
    path: Path, max_positions: int, *, head_token_ids: Tensor | None = None, cache_dir: Path | None = None
) -> GGUFWeights:
    """Weights for :class:`verispec.runners.cpu.int8.Int8Runner` read straight from a GGUF file, layer
    by layer: int8 linear layers and LM head (:class:`Int8Weight`), the embedding in the file's
    own blocks (:class:`GGUFEmbedding`, mapped).

    Each matrix's blocks are de-quantized (ggml's formulas, the values llama.cpp and transformers
    see) and re-quantized per output row to int8 by the kernels in one pass, then prepacked, so
    neither a float model nor a second copy of the int8 model is ever held. ``head_token_ids``
    ``[kept]``: a reduced LM head (FR-Spec). ``cache_dir``: keep the int8 matrices there
    (:class:`WeightCache`), so the next load of the same file skips the re-quantization; None: no
    cache. Raises what :meth:`GGUFWeights.from_file` raises.
    """
    from verispec.runners.cpu.int8_ops import Int8Weight, quantize_weight_rows

    if head_token_ids is not None and not bool((head_token_ids[1:] > head_token_ids[:-1]).all()):
        raise InvalidParameterError("head_token_ids must be strictly increasing")
    loader = GGUFLoader(read_gguf_header(Path(path)))
    kernels = loaded_kernels()
    cache = WeightCache(Path(path), cache_dir, "int8", INT8_CACHE_VERSION) if cache_dir is not None else None

    def int8_of(raw: Tensor, info: TensorInfo, in_features: int, key: str) -> tuple[Tensor, Tensor]:
        if cache is not None:
            return cache.get(key, lambda: compute_int8(raw, info, in_features))
        return compute_int8(raw, info, in_features)

    def compute_int8(raw: Tensor, info: TensorInfo, in_features: int) -> tuple[Tensor, Tensor]:
        if info.qtype in SUPPORTED_TYPES:
            return kernels.requantize_int8(raw.contiguous().view(-1), info.qtype, raw.shape[0], in_features)
        # other block types: gguf's numpy de-quantization, a few thousand rows at a time
        parts = [
            quantize_weight_rows(dequantize_blocks(kernels, raw[s : s + 8192].contiguous(), info.qtype, in_features))
            for s in range(0, raw.shape[0], 8192)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def int8_rows(names: Sequence[str], in_features: int, heads: Sequence[int | None] = ()) -> tuple[Tensor, Tensor]:
        pieces, scales = [], []
        for index, name in enumerate(names):
            raw, info = loader.rows(name, in_features, any_type=True)
            if index < len(heads) and heads[index] is not None:
                raw = raw[unpermute_rows(raw.shape[0], heads[index])]
            int8, scale = int8_of(raw, info, in_features, name)
            pieces.append(int8)
            scales.append(scale)
        return (torch.cat(pieces), torch.cat(scales)) if len(pieces) > 1 else (pieces[0], scales[0])

    def linear(
        names: Sequence[str], in_features: int, heads: Sequence[int | None] = (), bias: Tensor | None = None
    ) -> Int8Weight:
        return Int8Weight.from_int8(*int8_rows(names, in_features, heads), bias)

    hidden = loader.hidden
    layers = loader.decoder_layers(linear)
    embed_info = loader.tensor("token_embd.weight")
    # the embedding stays in the file's own blocks (mapped, rows de-quantized per lookup, as the
    # gguf runner does): only the looked-up rows are ever resident
    embedding = GGUFEmbedding(loader.raw(embed_info).view(int(embed_info.shape[1]), -1), embed_info.qtype, hidden)
    rows = None if head_token_ids is None else head_token_ids.long()
    head_name = "output.weight" if "output.weight" in loader.header.tensors else "token_embd.weight"
    head_info = loader.tensor(head_name)
    parts = []
    for start in range(
        0, int(head_info.shape[1]), RowChunks.CHUNK_ROWS
    ):  # a range of rows mapped, re-quantized, packed, dropped
        raw, info = loader.rows(head_name, hidden, any_type=True, row_range=(start, start + RowChunks.CHUNK_ROWS))
        int8, scale = int8_of(raw, info, hidden, f"{head_name}@{start}:{start + raw.shape[0]}")
        if rows is not None:  # FR-Spec: the kept rows of this range
            keep = rows[(rows >= start) & (rows < start + raw.shape[0])] - start
            int8, scale = int8[keep].contiguous(), scale[keep].contiguous()
        if int8.shape[0]:
            parts.append(Int8Weight.from_int8(int8, scale))
        del raw, int8, scale
        release_freed_memory()
    lm_head = RowChunks(parts, hidden)
    if cache is not None:
        cache.finish()
    return loader.assemble(embedding, layers, lm_head, max_positions, rows)


@dataclass
class RowChunks:
    """A linear layer stored as consecutive row ranges of its weight (``parts``), so that packing
    a large matrix (the LM head) holds one range twice at a time, not the whole matrix. Each
    output column is computed by exactly one part, as the whole matrix would compute it."""

    parts: list
    in_features: int

    CHUNK_ROWS = 16384

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def __call__(self, x: Tensor) -> Tensor:
        """``x`` ``[rows, in_features]`` float32 -> ``[rows, out_features]`` float32."""
        return torch.cat([p(x) for p in self.parts], dim=1)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)
