"""Batch-invariant int8 matrix products for CPU: per-row activation scales, int32 accumulation.

Owns the int8 weight format (symmetric, one scale per output channel), the per-row (per-token)
activation quantization and the choice of integer GEMM kernel. Integer accumulation is exact,
so row i of ``int8_linear(x)`` depends on row i of ``x`` only, whatever the batch size: a k-token
verify pass and k one-token decode passes give bit-identical rows. Knows nothing about models.

The fast kernel is oneDNN's ``qlinear_pointwise`` (prepacked weights, VNNI on x86, fed uint8
activations with zero point 128: signed ones fall back to oneDNN's slow reference kernel); a weight
matrix is checked once against exact integer arithmetic and the portable ``torch._int_mm`` path
is used wherever oneDNN is missing or disagrees (e.g. a CPU whose int8 path saturates in int16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

INT8_MAX = 127
PACK_HINT = [None]


def quantize_weight_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: ``weight ≈ int8_weight * scales[:, None]``.

    Args:
        weight: ``[out_features, in_features]`` float.
    Returns:
        ``int8_weight`` ``[out_features, in_features]`` int8 and ``scales`` ``[out_features]``
        float32 (``max |row| / 127``; 1 for an all-zero row).
    """
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / INT8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    int8_weight = torch.clamp(torch.round(w / scales[:, None]), -INT8_MAX, INT8_MAX).to(torch.int8)
    return int8_weight, scales


def quantize_activation_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row (per-token) symmetric int8 of ``x`` ``[rows, features]`` float32.

    Returns ``int8_x`` ``[rows, features]`` and ``scales`` ``[rows, 1]`` float32 with
    ``x ≈ int8_x * scales``. Every op is row-local (max, divide, round), so a row's result does
    not depend on the other rows.
    """
    scales = activation_scales(x)
    int8_x = torch.round(x / scales).to(torch.int8)  # |x| <= max |row|, so within [-127, 127]
    return int8_x, scales


def activation_scales(x: Tensor) -> Tensor:
    """``[rows, 1]`` float32: ``max |row| / 127`` of ``x`` ``[rows, features]`` (tiny, never 0)."""
    return x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30).div_(INT8_MAX)  # amax is exact


_ONEDNN_EXACT: bool | None = None


def onednn_is_exact() -> bool:
    """Whether oneDNN's int8 product equals exact integer arithmetic here (checked once).

    Probes the extremes (all +-127, where a kernel that sums u8*s8 pairs in int16 saturates) and
    random values, at a few row counts.
    """
    global _ONEDNN_EXACT
    if _ONEDNN_EXACT is None:
        _ONEDNN_EXACT = _onednn_available() and _probe_onednn()
    return _ONEDNN_EXACT


def default_kernel() -> str:
    """The kernel ``kernel="auto"`` gives on this CPU: ``"onednn"`` (oneDNN's VNNI product, checked
    exact here) or ``"int_mm"`` (``torch._int_mm``: exact everywhere, but several times slower; what
    CPUs without AVX-512 VNNI get, e.g. AVX2-only Zen 1-3)."""
    return "onednn" if _onednn_available() and onednn_is_exact() else "int_mm"


def _probe_onednn() -> bool:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-INT8_MAX, INT8_MAX + 1, (64, 256), generator=generator, dtype=torch.int8)
    weight[:8] = INT8_MAX
    weight[8:16] = -INT8_MAX
    scales = torch.ones(64)
    layer = Int8Weight(
        256,
        64,
        scales,
        None,
        "onednn",
        packed=torch.ops.onednn.qlinear_prepack(weight, None),
        zero_points=torch.zeros(64, dtype=torch.int64),
    )
    for rows in (1, 5, 33):
        x = torch.randint(-INT8_MAX, INT8_MAX + 1, (rows, 256), generator=generator, dtype=torch.int8)
        x[0] = INT8_MAX
        expected = (x.long() @ weight.long().t()).float()
        if not torch.equal(layer.integer_product(x), expected):
            return False
    return True


def _onednn_available() -> bool:
    return (
        hasattr(torch.ops, "onednn")
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
        and (torch.backends.mkldnn.is_available())
    )


@dataclass
class Int8Weight:
    """One linear layer in int8: ``y = (int8(x) @ int8_weight.T) * x_scale * scales + bias``.

    Attributes:
        scales: ``[out_features]`` float32 per-output-channel weight scales.
        bias: ``[out_features]`` float32 or None.
        packed: oneDNN-prepacked weight (kernel ``"onednn"``), else None.
        weight_t: ``[in_features, out_features]`` int8 for ``torch._int_mm`` (kernel ``"int_mm"``).
    """

    in_features: int
    out_features: int
    scales: Tensor
    bias: Tensor | None
    kernel: str
    packed: Tensor | None = None
    weight_t: Tensor | None = None
    zero_points: Tensor | None = None

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None, *, kernel: str = "auto") -> Int8Weight:
        """Quantize ``weight`` ``[out, in]`` float (and keep ``bias`` ``[out]`` in float32).

        ``kernel``: ``"auto"`` (oneDNN when it reproduces exact integer results, else
        ``int_mm``), ``"onednn"`` or ``"int_mm"``. Raises ValueError for an unknown kernel.
        """
        int8_weight, scales = quantize_weight_rows(weight)
        return cls.from_int8(int8_weight, scales, bias, kernel=kernel)

    @classmethod
    def from_int8(
        cls, int8_weight: Tensor, scales: Tensor, bias: Tensor | None = None, *, kernel: str = "auto"
    ) -> Int8Weight:
        if kernel not in ("auto", "onednn", "int_mm"):
            raise ValueError(f"unknown int8 kernel {kernel!r}")
        out_features, in_features = int8_weight.shape
        bias = None if bias is None else bias.detach().float().contiguous()
        scales = scales.float().contiguous()
        if kernel in ("auto", "onednn") and _onednn_available():
            packed = torch.ops.onednn.qlinear_prepack(
                int8_weight.contiguous(), None if PACK_HINT[0] is None else [PACK_HINT[0], in_features]
            )
            zero_points = torch.zeros(out_features, dtype=torch.int64)
            if kernel == "onednn" or onednn_is_exact():
                return cls(in_features, out_features, scales, bias, "onednn", packed=packed, zero_points=zero_points)
        if kernel == "onednn":
            raise ValueError("the oneDNN int8 kernel is not available in this torch build")
        return cls(in_features, out_features, scales, bias, "int_mm", weight_t=int8_weight.t().contiguous())

    def integer_product(self, int8_x: Tensor) -> Tensor:
        """``float32(int8_x @ int8_weight.T) * scales`` ``[rows, out]`` from ``int8_x`` ``[rows, in]``."""
        if self.kernel == "onednn":
            # oneDNN's fast (brgemm VNNI) path wants unsigned activations: v + 128 with zero point
            # 128 is the same integer product (the offset is compensated exactly in int32).
            return self._onednn_product(int8_x.view(torch.uint8).bitwise_xor(0x80))
        return torch._int_mm(int8_x, self.weight_t).float() * self.scales

    def _onednn_product(self, offset_x: Tensor) -> Tensor:
        """oneDNN's int8 product of ``offset_x`` ``[rows, in]`` uint8 (activations + 128, zero point
        128) with the packed weight: ``[rows, out]`` float32 times the weight scales."""
        return torch.ops.onednn.qlinear_pointwise(
            offset_x, 1.0, 128, self.packed, self.scales, self.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )

    def __call__(self, x: Tensor) -> Tensor:
        """``x`` ``[rows, in]`` float32 -> ``[rows, out]`` float32, each row independent of the others."""
        if self.kernel == "onednn":
            x_scales = activation_scales(x)
            offset_x = x.div(x_scales).round_().add_(128).to(torch.uint8)  # = quantize_activation_rows + 128
            out = self._onednn_product(offset_x)
        else:
            int8_x, x_scales = quantize_activation_rows(x)
            out = self.integer_product(int8_x)
        out.mul_(x_scales)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def nbytes(self) -> int:
        stored = self.packed if self.packed is not None else self.weight_t
        extra = self.scales.numel() * 4 + (self.bias.numel() * 4 if self.bias is not None else 0)
        return stored.numel() * stored.element_size() + extra
