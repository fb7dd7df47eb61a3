"""Which float format a head trains in, decided once with its reason: ``bf16`` where the CPU
multiplies bf16 matrices natively (AMX-BF16 on Intel Xeon 4th generation and later, AVX512-BF16
on AMD Zen 4/5 and Intel Cooper Lake), ``f32`` elsewhere.

Knows nothing about the training loop (:mod:`verispec.training.step` runs the chosen format)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import InvalidParameterError

PRECISIONS = ("auto", "f32", "bf16")
# /proc/cpuinfo flag -> the name said to the user, most capable first
NATIVE_BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


@dataclass(frozen=True)
class PrecisionChoice:
    """``precision``: "f32" or "bf16"; ``reason``: one line saying why (shown first in a run)."""

    precision: str
    reason: str


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no such file)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def _torch_flags() -> set[str] | None:
    """The native bf16 flags by torch's own CPU checks (they also see whether the OS lets a
    process use AMX tiles); None where this torch has no such checks."""
    import torch

    amx, avx512 = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    if amx is None or avx512 is None:
        return None
    return {flag for flag, has in (("amx_bf16", amx()), ("avx512_bf16", avx512())) if has}


def native_bf16(flags: Collection[str] | None = None) -> str | None:
    """The CPU's native bf16 matrix instructions, ``"AMX-BF16"`` or ``"AVX512-BF16"`` (the first
    of :data:`NATIVE_BF16_FLAGS` present), or None.

    ``flags``: CPU flags to decide from; None: torch's checks where it has them, else
    :func:`cpu_flags`."""
    if flags is None:
        flags = _torch_flags()
        flags = cpu_flags() if flags is None else flags
    return next((name for flag, name in NATIVE_BF16_FLAGS.items() if flag in flags), None)


def choose_precision(requested: str, device: str = "cpu") -> PrecisionChoice:
    """The format to train in for ``requested`` (``auto``, ``f32`` or ``bf16``) on torch device
    ``device``, from the CPU's :func:`native_bf16`.

    ``auto`` gives bf16 on a CPU with native bf16 and f32 elsewhere (another device: f32, the
    reference). bf16 keeps fp32 master weights either way (:mod:`verispec.training.step`).

    Raises:
        InvalidParameterError: an unknown ``requested``, or ``bf16`` on a CPU without native
            bf16 (torch would emulate it, slower than f32).
    """
    if requested not in PRECISIONS:
        raise InvalidParameterError(f"--precision must be one of {', '.join(PRECISIONS)}, not {requested!r}")
    on_cpu = device.split(":")[0] == "cpu"
    if requested == "f32":
        return PrecisionChoice("f32", "f32, as asked (--precision f32)")
    if not on_cpu:
        if requested == "bf16":
            return PrecisionChoice("bf16", f"bf16 on {device}, as asked (fp32 master weights)")
        return PrecisionChoice("f32", f"f32: auto chooses bf16 on CPUs only, and the head trains on {device}")
    native = native_bf16()
    if native is None:
        if requested == "bf16":
            raise InvalidParameterError(
                "--precision bf16 needs a CPU with native bf16 matrix products (AMX-BF16 or AVX512-BF16); this one "
                "has neither and would run slower than f32: use --precision f32 or auto"
            )
        return PrecisionChoice("f32", "f32: this CPU has no native bf16 matrix product (AMX-BF16 or AVX512-BF16)")
    how = "as asked" if requested == "bf16" else "auto"
    return PrecisionChoice("bf16", f"bf16 ({how}): this CPU has {native}; fp32 master weights, fp32 loss")
