"""The target's hidden states handed out by a verify pass, for drafters that read them (EAGLE-3).

Owns the layer-index convention, its check, EAGLE-3's default layers and the slicing of a pass's
states into one sequence's feature rows. The runners that capture (:mod:`verispec.runners.cpu.int8`,
:mod:`verispec.runners.cpu.gguf_runner`, :mod:`verispec.runners.torch_runner`) keep references to
states their forward computes anyway and call :func:`concat_features`; nothing here runs a model.

Layer index ``i`` (transformers' ``output_hidden_states`` tuple, ``hidden_states[i]``) is the
residual stream *entering* decoder layer ``i``: 0 the token embeddings, ``i > 0`` the output of
decoder layer ``i - 1``, before any final norm. Valid: ``0 .. num_layers - 1`` (``num_layers``
would be transformers' final-normed state, which is not a layer's residual stream). This is where
EAGLE-3's reference code reads its features (the state before layers 2, N // 2 and N - 3) and
the convention of :class:`verispec.runners.eagle.head.EagleHead` and ``ops.train_head``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high features: ``(2, N // 2, N - 3)`` clamped to ``[0, N - 1]``.

    Li et al. 2025, "EAGLE-3", arXiv 2503.01840, §3.2 ("low, middle and high-level features");
    the indices are those of the reference implementation (the hidden state entering decoder
    layers 2, N // 2 and N - 3). A model of fewer than 6 layers gets repeats, e.g. ``(1, 1, 0)``
    for 2 layers.
    """
    top = max(num_layers - 1, 0)
    low, middle, high = (min(max(i, 0), top) for i in (2, num_layers // 2, num_layers - 3))
    return low, middle, high


def check_feature_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """``layers`` as a tuple of ints, in order, repeats allowed; ``()`` means no capture.

    Raises:
        InvalidParameterError: an index outside ``0 .. num_layers - 1``.
    """
    checked = tuple(int(i) for i in layers)
    if any(not 0 <= i < num_layers for i in checked):
        raise InvalidParameterError(f"feature layers {checked} must be hidden-state indices in [0, {num_layers - 1}]")
    return checked


def concat_features(
    states: Mapping[int, Tensor] | Sequence[Tensor], layers: Sequence[int], start: int, end: int
) -> Tensor:
    """Rows ``start .. end - 1`` of ``states[i]`` for each ``i`` in ``layers``, side by side.

    Args:
        states: indexable by layer index; ``states[i]`` ``[pass_rows, hidden_size]`` (only the
            indices in ``layers`` are read).
        layers: non-empty, from :func:`check_feature_layers`.
    Returns:
        float32 ``[end - start, len(layers) * hidden_size]``, a new tensor (the one copy of the
        capture), on the states' device.
    """
    return torch.cat([states[i][start:end] for i in layers], dim=-1).float()
