"""GGUF quantized blocks as the kernels multiply them: the block types, the layers made of them.

Owns which ggml block types the kernels multiply (:data:`SUPPORTED_TYPES`), the linear layer over
repacked 16-column tiles (:class:`GGUFLinear`), the token embedding kept in the file's own format
and de-quantized per lookup (:class:`GGUFEmbedding`, :func:`dequantize_blocks`), and the one handle on
the compiled kernels (:func:`loaded_kernels`). Every op is row-local and the block products
(:mod:`verispec.runners.kernels`) accumulate in one fixed order. Knows nothing about reading a
file (:mod:`verispec.runners.cpu.gguf_weights`) or running a model
(:mod:`verispec.runners.cpu.gguf_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from verispec.errors import InvalidParameterError
from verispec.runners.kernels import kernel_isa_number

# ggml type ids the kernels multiply (ggml.h: enum ggml_type)
SUPPORTED_TYPES = {12: "Q4_K", 14: "Q6_K", 2: "Q4_0", 20: "IQ4_NL", 6: "Q5_0", 8: "Q8_0"}
Q4_0, Q4_K, IQ4_NL = 2, 12, 20
FOUR_BIT_TYPES = (Q4_0, Q4_K, IQ4_NL)
FLOAT_TYPES = {0: np.float32, 1: np.float16}


@dataclass
class GGUFLinear:
    """``y = x @ W.T + bias`` with W in GGUF blocks: ``parts`` are row ranges of W, each one block type.

    ``parts``: ``(packed tiles uint8, ggml type id, rows)``; ``bias`` ``[out_features]`` float32.
    """

    parts: list[tuple[Tensor, int, int]]
    in_features: int
    bias: Tensor | None = None

    @property
    def out_features(self) -> int:
        return sum(rows for _, _, rows in self.parts)

    def __call__(self, x: Tensor) -> Tensor:
        """``x`` ``[rows, in_features]`` float32 -> ``[rows, out_features]`` float32, row-local."""
        kernels, impl = loaded_kernels(), kernel_isa_number()
        outs = [kernels.linear(x, packed, qtype, rows, impl)[:, :rows] for packed, qtype, rows in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y

    def nbytes(self) -> int:
        return sum(p.numel() for p, _, _ in self.parts) + (0 if self.bias is None else self.bias.numel() * 4)


@dataclass
class GGUFEmbedding:
    """Token embedding rows in the file's own format, de-quantized per lookup (:func:`dequantize_blocks`)."""

    raw: Tensor  # [vocab, row_bytes] uint8
    qtype: int
    hidden: int

    def __call__(self, ids: Tensor) -> Tensor:
        """``ids`` ``[n]`` int64 -> float32 ``[n, hidden]`` (ggml's formulas, as the file holds them)."""
        return dequantize_blocks(loaded_kernels(), self.raw[ids].contiguous(), self.qtype, self.hidden)


def dequantize_blocks(kernels, raw: Tensor, qtype: int, in_features: int) -> Tensor:
    """float32 ``[rows, in_features]`` of raw blocks ``[rows, row_bytes]``: the kernels for their
    block types, ``gguf``'s numpy code for the others (Q4_1, Q5_K, ...), a view for F32/F16."""
    if qtype in SUPPORTED_TYPES:
        return kernels.dequantize(raw.view(-1), qtype, raw.shape[0], in_features)
    if qtype in FLOAT_TYPES:
        return torch.from_numpy(raw.numpy().view(FLOAT_TYPES[qtype]).astype(np.float32)).view(raw.shape[0], in_features)
    from gguf import GGMLQuantizationType, quants

    try:
        values = quants.dequantize(raw.numpy(), GGMLQuantizationType(qtype))
    except (NotImplementedError, ValueError) as exc:
        raise InvalidParameterError(f"block type {qtype} cannot be de-quantized here: {exc}") from exc
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(raw.shape[0], in_features)


def loaded_kernels():
    """The compiled kernel module, looked up once (every linear layer calls this)."""
    if not _MODULE:
        from verispec.runners.kernels import gguf_kernels

        _MODULE.append(gguf_kernels())
    return _MODULE[0]


_MODULE: list = []
