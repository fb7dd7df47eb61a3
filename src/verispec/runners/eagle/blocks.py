"""An EAGLE head's linear layers in GGUF blocks, run by the gguf runner's kernels at inference.

A head drafts one row at a time, so like the target it is bound by the bytes it reads: float32
weights cost about four times Q8_0's and seven times IQ4_NL's. Owns the conversion of a trained
head's ``nn.Linear`` layers (in place, for inference only) and the module that runs them. The
draft's quantization changes only which tokens are drafted, never the output (the target
verifies). Knows nothing about training or drafting.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from verispec.errors import InvalidParameterError
from verispec.runners.cpu.gguf_blocks import GGUFLinear, loaded_kernels
from verispec.runners.kernels import kernel_isa_number

HEAD_LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
Q8_0, IQ4_NL = 8, 20  # ggml type ids
HEAD_QUANTIZATIONS = {"q8_0": Q8_0, "iq4_nl": IQ4_NL}
BLOCK = 32  # values per Q8_0 / IQ4_NL block


class BlockLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` in GGUF blocks (:class:`GGUFLinear`), float32 in and out;
    inference only (no gradient flows through it)."""

    def __init__(self, linear: GGUFLinear) -> None:
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:  # x: [rows, in_features]
        return self.linear(x.float().contiguous())


def head_nbytes(head: nn.Module) -> int:
    """Bytes of ``head``'s own weights: its parameters and buffers (float32 where not quantized,
    ``d2t``) plus the blocks of every :class:`BlockLinear`. The target's embedding it borrows is
    not counted (the target holds it)."""
    tensors = {id(t): t for t in list(head.parameters()) + list(head.buffers())}
    blocks = sum(m.linear.nbytes() for m in head.modules() if isinstance(m, BlockLinear))
    return sum(t.numel() * t.element_size() for t in tensors.values()) + blocks


def quantize_head_(head: nn.Module, quantization: str = "q8_0") -> nn.Module:
    """Replace ``head``'s linear layers by :class:`BlockLinear` in ``quantization`` blocks (in
    place; returns ``head``). ``"q8_0"``: 8.5 bits per weight; ``"iq4_nl"``: 4.5 (the Q8_0
    blocks re-quantized by the kernels' IQ4_NL fit, as ``--draft-quantization iq4_nl`` does).

    Raises:
        InvalidParameterError: an unknown quantization, or a layer whose input width is not a
            multiple of 32 (the block size).
    """
    if quantization not in HEAD_QUANTIZATIONS:
        raise InvalidParameterError(
            f"unknown head quantization {quantization!r}; choose one of {', '.join(HEAD_QUANTIZATIONS)}"
        )
    from gguf import GGMLQuantizationType, quants

    kernels = loaded_kernels()
    for name in HEAD_LINEARS:
        module = getattr(head, name)
        if isinstance(module, BlockLinear):
            continue
        rows, width = module.weight.shape
        if width % BLOCK:
            raise InvalidParameterError(
                f"the head's {name} has {width} inputs, not a multiple of {BLOCK}: it cannot be quantized"
            )
        values = module.weight.detach().float().numpy()
        raw = torch.from_numpy(np.ascontiguousarray(quants.quantize(values, GGMLQuantizationType.Q8_0)))
        qtype = Q8_0
        if quantization == "iq4_nl":
            raw = kernels.requantize_4bit(raw.view(-1), Q8_0, rows, width, IQ4_NL, kernel_isa_number()).view(rows, -1)
            qtype = IQ4_NL
        packed = kernels.repack(raw.contiguous().view(-1), qtype, rows, width)
        bias = None if module.bias is None else module.bias.detach().float().clone()
        setattr(head, name, BlockLinear(GGUFLinear([(packed, qtype, rows)], width, bias)))
    head.quantization = quantization
    return head
