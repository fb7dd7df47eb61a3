"""Several sequences' rows through one EAGLE head in one pass (:func:`forward_heads`): the head's
weights read once for all of them, each sequence's rows attending to its own cache. Knows nothing
about drafting (:mod:`verispec.proposers.eagle`); the head's layer is :mod:`.head`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from verispec.errors import InvalidParameterError


@dataclass
class HeadCall:
    """One sequence's rows in :func:`forward_heads`: the arguments of :meth:`EagleHead.forward`."""

    head: nn.Module  # an EagleHead (not imported here: head.py imports this module)
    token_ids: Sequence[int] | Tensor
    features: Tensor | None = None
    hidden: Tensor | None = None
    positions: Tensor | None = None
    attention_mask: Tensor | None = None


@torch.inference_mode()
def forward_heads(calls: Sequence[HeadCall]) -> list[tuple[Tensor, Tensor]]:
    """:meth:`EagleHead.forward` for several sequences of one head (``new_sequence``: shared
    weights, each its own cache) in one pass: ``fc``, the layer's linear parts and ``lm_head``
    over all rows (:meth:`EagleHead.layer_segments`), each call's rows appended to its own
    cache. Returns each call's ``(logits, hidden)``, in order.

    Raises:
        InvalidParameterError: as :meth:`EagleHead.forward`, or calls of heads with other weights.
    """
    base = calls[0].head
    if any(call.head.fc is not base.fc for call in calls):
        raise InvalidParameterError("heads drafting in one pass must share their weights (EagleHead.new_sequence)")
    if any((call.features is None) == (call.hidden is None) for call in calls):
        raise InvalidParameterError("pass exactly one of features (the target's) and hidden (the head's own)")
    featured = [call.features for call in calls if call.features is not None]
    fused = iter(
        base.fuse(torch.cat(featured)).split([f.shape[0] for f in featured]) if featured else ()
    )  # fc read once
    ids, inputs, positions, segments = [], [], [], []
    for call in calls:
        head, row_ids = call.head, torch.as_tensor(call.token_ids, dtype=torch.long).reshape(-1)
        num_new, cached = row_ids.numel(), head.num_cached_tokens
        rows = next(fused) if call.features is not None else call.hidden.to(head.norm.weight.dtype)
        if num_new == 0 or rows.shape != (num_new, head.shape.hidden_size):
            raise InvalidParameterError(
                f"need one [{head.shape.hidden_size}] input row per token; got {num_new} tokens, {list(rows.shape)}"
            )
        mask = call.attention_mask
        if mask is None:
            mask = torch.arange(cached + num_new)[None, :] <= torch.arange(cached, cached + num_new)[:, None]
        if mask.dtype != torch.bool or mask.shape != (num_new, cached + num_new):
            raise InvalidParameterError(
                f"attention_mask must be bool [{num_new}, {cached + num_new}], got {mask.dtype} {list(mask.shape)}"
            )
        ids.append(row_ids)
        inputs.append(rows)
        positions.append(
            torch.arange(cached, cached + num_new)
            if call.positions is None
            else torch.as_tensor(call.positions, dtype=torch.long)
        )
        segments.append((head._keys, head._values, mask))
    one = len(calls) == 1
    out, new = base.layer_segments(
        inputs[0] if one else torch.cat(inputs),
        ids[0] if one else torch.cat(ids),
        positions[0] if one else torch.cat(positions),
        segments,
    )
    for call, (keys, values) in zip(calls, new):
        call.head._keys, call.head._values = (
            torch.cat([call.head._keys, keys], 1),
            torch.cat([call.head._values, values], 1),
        )
    logits, sizes = base.logits(out), [len(i) for i in ids]
    return list(zip(logits.split(sizes), out.split(sizes)))
