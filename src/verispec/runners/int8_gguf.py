"""The int8 runner's weights read straight from a GGUF file (``--runner int8`` on GGUF models).

Owns the layer-by-layer re-quantization of GGUF blocks to per-row int8 (the gguf kernels'
``requantize_int8``, gguf's numpy code for other block types), the on-disk cache of those int8
matrices (:class:`Int8Cache`: a later load reads them instead of re-quantizing) and the LM head
packed in row ranges; reuses the gguf runner's loader, embedding and RoPE tables. Knows nothing
about decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from verispec.errors import InvalidParameterError
from verispec.models.gguf_file import TensorInfo, read_gguf_header
from verispec.runners.gguf_runner import (
    SUPPORTED_TYPES,
    GGUFEmbedding,
    GGUFWeights,
    _dequantize,
    _kernels,
    _Loader,
    _unpermute_rows,
    release_freed_memory,
    rope_tables,
)


def int8_weights_from_gguf(path: Path, max_positions: int, *, head_token_ids: Tensor | None = None,
                           cache_dir: Path | None = None) -> GGUFWeights:
    """Weights for :class:`verispec.runners.int8.Int8Runner` read straight from a GGUF file, layer
    by layer: int8 linear layers and LM head (:class:`Int8Weight`), the embedding in the file's
    own blocks (:class:`GGUFEmbedding`, mapped).

    Each matrix's blocks are de-quantized (ggml's formulas, the values llama.cpp and transformers
    see) and re-quantized per output row to int8 by the kernels in one pass, then prepacked, so
    neither a float model nor a second copy of the int8 model is ever held. ``head_token_ids``
    ``[kept]``: a reduced LM head (FR-Spec). ``cache_dir``: keep the int8 matrices there
    (:class:`Int8Cache`), so the next load of the same file skips the re-quantization; None: no
    cache. Raises what :meth:`GGUFWeights.from_file` raises.
    """
    from verispec.runners.int8_ops import Int8Weight, quantize_weight_rows

    if head_token_ids is not None and not bool((head_token_ids[1:] > head_token_ids[:-1]).all()):
        raise InvalidParameterError("head_token_ids must be strictly increasing")
    loader = _Loader(read_gguf_header(Path(path)))
    kernels = _kernels()
    cache = Int8Cache(Path(path), cache_dir) if cache_dir is not None else None

    def int8_of(raw: Tensor, info: TensorInfo, in_features: int, key: str) -> tuple[Tensor, Tensor]:
        if cache is not None:
            return cache.get(key, lambda: compute_int8(raw, info, in_features))
        return compute_int8(raw, info, in_features)

    def compute_int8(raw: Tensor, info: TensorInfo, in_features: int) -> tuple[Tensor, Tensor]:
        if info.qtype in SUPPORTED_TYPES:
            return kernels.requantize_int8(raw.contiguous().view(-1), info.qtype, raw.shape[0], in_features)
        # other block types: gguf's numpy de-quantization, a few thousand rows at a time
        parts = [quantize_weight_rows(_dequantize(kernels, raw[s : s + 8192].contiguous(), info.qtype, in_features))
                 for s in range(0, raw.shape[0], 8192)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def int8_rows(names: Sequence[str], in_features: int, heads: Sequence[int | None] = ()) -> tuple[Tensor, Tensor]:
        pieces, scales = [], []
        for index, name in enumerate(names):
            raw, info = loader.rows(name, in_features, any_type=True)
            if index < len(heads) and heads[index] is not None:
                raw = raw[_unpermute_rows(raw.shape[0], heads[index])]
            int8, scale = int8_of(raw, info, in_features, name)
            pieces.append(int8)
            scales.append(scale)
        return (torch.cat(pieces), torch.cat(scales)) if len(pieces) > 1 else (pieces[0], scales[0])

    def linear(names: Sequence[str], in_features: int, heads: Sequence[int | None] = (), bias: Tensor | None = None) -> Int8Weight:
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
    for start in range(0, int(head_info.shape[1]), RowChunks.CHUNK_ROWS):  # a range of rows mapped, re-quantized, packed, dropped
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
    cos, sin = rope_tables(loader.head_dim, loader.rope_base, max_positions)
    return GGUFWeights(
        num_heads=loader.num_heads, num_kv_heads=loader.num_kv_heads, head_dim=loader.head_dim, rms_norm_eps=loader.eps,
        embedding=embedding, layers=layers, final_norm=loader.floats("output_norm.weight"),
        lm_head=lm_head, cos=cos, sin=sin, head_token_ids=rows,
    )


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


class Int8Cache:
    """The int8 matrices (and their scales) re-quantized from one GGUF file, kept on disk.

    ``<directory>/<file stem>-<key>.int8`` holds the matrices one after another, the ``.json``
    beside it their offsets and shapes; the key hashes :data:`VERSION`, the file's path, size and
    modification time, so a changed file (or a changed re-quantization) is re-quantized. A hit
    maps each matrix only while it is packed (peak memory: the packed model plus one matrix). A
    miss computes and appends each matrix as it goes, and the pair is published by renames once
    complete, so a crash or a full disk leaves no half cache (then the load just goes on
    uncached). A cache whose index or size does not match is ignored and rewritten. The values
    are the ones the re-quantization gives, bit for bit, so the cache never changes results.
    """

    VERSION = 1  # bump when the re-quantization (requantize_int8 and its callers) changes

    def __init__(self, gguf_path: Path, directory: Path) -> None:
        stat = gguf_path.stat()
        digest = hashlib.sha256(f"{self.VERSION}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        self.data_path = Path(directory) / f"{gguf_path.stem}-{digest}.int8"
        self.index_path = self.data_path.with_suffix(".json")
        self.entries: dict | None = self._read_index()
        self._writer = None
        self._written: dict = {}
        self._offset = 0

    @property
    def hit(self) -> bool:
        return self.entries is not None

    def _read_index(self) -> dict | None:
        try:
            entries = json.loads(self.index_path.read_text())["matrices"]
            end = max((e["offset"] + e["rows"] * e["cols"] + 4 * e["rows"] for e in entries.values()), default=0)
            if self.data_path.stat().st_size != end:
                return None
            return entries
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def get(self, key: str, compute: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """``(int8 [rows, cols], scales [rows] float32)`` of matrix ``key``: read, or computed (and stored)."""
        if self.entries is not None and key in self.entries:
            e = self.entries[key]
            rows, cols, offset = int(e["rows"]), int(e["cols"]), int(e["offset"])
            int8 = np.memmap(self.data_path, dtype=np.int8, mode="c", offset=offset, shape=(rows, cols))
            scales = np.fromfile(self.data_path, dtype=np.float32, count=rows, offset=offset + rows * cols)
            return torch.from_numpy(int8), torch.from_numpy(scales)
        int8, scales = compute()
        if self.entries is None:
            self._append(key, int8, scales)
        return int8, scales

    def _append(self, key: str, int8: Tensor, scales: Tensor) -> None:
        try:
            if self._writer is None:
                self.data_path.parent.mkdir(parents=True, exist_ok=True)
                self._writer = open(self.data_path.with_suffix(f".int8.tmp{os.getpid()}"), "wb")
            self._writer.write(memoryview(int8.contiguous().numpy()).cast("B"))
            self._writer.write(memoryview(scales.float().contiguous().numpy()).cast("B"))
            self._written[key] = {"offset": self._offset, "rows": int(int8.shape[0]), "cols": int(int8.shape[1])}
            self._offset += int8.numel() + 4 * scales.numel()
        except OSError as exc:
            self._abandon(exc)

    def _abandon(self, exc: OSError) -> None:
        print(f"verispec: not caching the int8 weights ({exc}); the next load re-quantizes again", file=sys.stderr)
        if self._writer is not None:
            self._writer.close()
            Path(self._writer.name).unlink(missing_ok=True)
        self._writer = None
        self.entries = {}  # stop writing; nothing is read from an empty index

    def finish(self) -> None:
        """Publish a cache that was written during this load (no-op after a hit or a failure)."""
        if self._writer is None:
            return
        try:
            self._writer.close()
            index_tmp = self.index_path.with_suffix(f".json.tmp{os.getpid()}")
            index_tmp.write_text(json.dumps({"version": self.VERSION, "matrices": self._written}))
            os.replace(self._writer.name, self.data_path)
            os.replace(index_tmp, self.index_path)
            for stale in self.data_path.parent.glob(self.data_path.stem.rsplit("-", 1)[0] + "-*.int8"):
                if stale != self.data_path:  # the same file before it changed: never read again
                    stale.unlink(missing_ok=True)
                    stale.with_suffix(".json").unlink(missing_ok=True)
        except OSError as exc:
            self._abandon(exc)
        self._writer = None
