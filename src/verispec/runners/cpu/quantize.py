"""Int8 weight-only quantization of a model's linear layers (for draft models).

Owns the per-output-channel symmetric int8 format and the module that multiplies with it. Each
output row has its own scale and activations stay in the model's dtype, so a row's result does
not depend on the other rows of the batch (unlike per-tensor dynamic activation quantization,
see ``../shared/MODELS.md``). Only the draft is meant to be quantized: the target alone decides
what is emitted, so a quantized draft can lower acceptance but never change the output.
Knows nothing about drafting or verification.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError
from verispec.runners.cpu.int8_ops import quantize_weight_rows

QUANTIZATIONS = ("none", "int8")


# One definition of symmetric per-output-channel int8 weights, shared with the int8 runner.
quantize_rows_int8 = quantize_weight_rows


class Int8Linear(torch.nn.Module):
    """``y = x @ (int8_weight * scales).T + bias`` with int8 weights, activations in ``dtype``.

    Uses ``torch._weight_int8pack_mm`` where the build has it for the device (CPU here) and
    dequantizes on the fly otherwise.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        int8_weight, scales = quantize_rows_int8(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.register_buffer("int8_weight", int8_weight.to(linear.weight.device))
        self.register_buffer("scales", scales.to(device=linear.weight.device, dtype=self.dtype))
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        try:
            out = torch._weight_int8pack_mm(flat, self.int8_weight, self.scales)
        except (RuntimeError, NotImplementedError, AttributeError):
            out = torch.nn.functional.linear(flat, self.int8_weight.to(self.dtype) * self.scales[:, None])
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linear_layers(model: torch.nn.Module, quantization: str) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (LM head included) by an :class:`Int8Linear`.

    Modifies ``model`` in place and returns it: call it only on a model this process owns alone
    (a freshly loaded draft), never on a model shared with the target. ``"none"`` is a no-op.

    Raises:
        InvalidParameterError: unknown ``quantization``.
    """
    if quantization not in QUANTIZATIONS:
        raise InvalidParameterError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return model
