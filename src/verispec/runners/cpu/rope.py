"""RoPE tables and the q/k row order the rotary embedding of the int8 and gguf runners needs.

Owns computing ``cos``/``sin`` tables (Su et al. 2021, half-split layout) for a
:class:`verispec.runners.cpu.gguf_arch.RoPE` (its base, linear scaling, per-frequency divisors and
partial rotary dimensions) and undoing llama.cpp's q/k row permutation. Knows nothing about files
or the forward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_tables(
    dims: int, base: float, max_positions: int, *, factor: float = 1.0, freq_factors: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``cos``, ``sin`` ``[max_positions, dims]`` float32, half-split layout (Su et al. 2021),
    computed as transformers' default RoPE does; ``factor`` (linear scaling) and ``freq_factors``
    ``[dims / 2]`` (llama3 scaling as a GGUF file's ``rope_freqs`` tensor holds it, applied as
    llama.cpp's ``freq_factors``) divide the inverse frequencies."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float()
    if factor != 1.0:
        inv_freq = inv_freq / factor
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


def unpermute_rows(rows: int, heads: int) -> Tensor:
    """Row order that undoes llama.cpp's q/k permutation (``convert_hf_to_gguf.py``'s ``permute``),
    so the half-split RoPE of :func:`verispec.runners.cpu.int8.rotate` applies."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)
