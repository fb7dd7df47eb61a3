"""Verification of a drafted chain against the target: greedy matching and rejection sampling.

Owns the accept/reject decision and the choice of the one extra token the target contributes
per step (recovered after a rejection, bonus after a fully accepted draft). Pure functions over
tensors; knows nothing about models, caches, drafters or text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.algorithms.sampling import sample_from


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one draft.

    Attributes:
        num_accepted_tokens: length of the accepted prefix of the draft (0..num_draft_tokens).
        token_ids: the tokens to emit: the accepted draft tokens, then one target token.
        is_bonus: True when the whole draft was accepted and the last token is the bonus token;
            False when it is the recovered token sampled after a rejection (or argmax at a
            mismatch in greedy).
    """

    num_accepted_tokens: int
    token_ids: list[int]
    is_bonus: bool


def accepted_prefix_length(accepted: Sequence[bool] | Tensor) -> int:
    """Number of leading True values: only the accepted *prefix* of a draft counts.

    ``[1, 0, 1, 0] -> 1``: the third token was never reachable once the second was rejected.
    """
    mask = torch.as_tensor(accepted, dtype=torch.bool).flatten()
    rejected = torch.nonzero(~mask)
    return int(rejected[0].item()) if rejected.numel() else int(mask.numel())


def greedy_verify(
    draft_token_ids: Sequence[int],  # [num_draft_tokens]
    target_token_ids: Tensor,  # [num_draft_tokens + 1] int64: target argmax after each prefix
) -> VerifyResult:
    """Greedy verification: keep the longest prefix equal to the target's argmax, plus one.

    Row i of ``target_token_ids`` is the target's choice after the context and the first i
    draft tokens. The output therefore equals what plain greedy decoding would emit.
    (Leviathan et al. 2023, §2.3 with temperature 0; Stern et al. 2018 blockwise decoding.)
    """
    num_draft = len(draft_token_ids)
    if target_token_ids.shape[0] != num_draft + 1:
        raise ValueError(f"target rows {target_token_ids.shape[0]} != num_draft_tokens + 1 = {num_draft + 1}")
    draft = torch.as_tensor(list(draft_token_ids), dtype=torch.long)
    num_accepted = accepted_prefix_length(draft == target_token_ids[:num_draft])
    token_ids = [int(t) for t in target_token_ids[: num_accepted + 1].tolist()]
    return VerifyResult(num_accepted, token_ids, is_bonus=num_accepted == num_draft)


def rejection_sample(
    draft_token_ids: Sequence[int],  # [num_draft_tokens]
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab] float32; None = one-hot (deterministic) draft
    target_probs: Tensor,  # [num_draft_tokens + 1, vocab] float32
    generator: torch.Generator,
) -> VerifyResult:
    """Modified rejection sampling: the emitted tokens are distributed exactly as the target's.

    Draft token x_i (drawn from ``draft_probs[i]``) is accepted with probability
    ``min(1, target_probs[i, x_i] / draft_probs[i, x_i])``. At the first rejection the recovered
    token is drawn from ``normalize(max(0, target_probs[i] - draft_probs[i]))``; after a full
    accept the bonus token is drawn from ``target_probs[num_draft_tokens]``.
    Source: Leviathan et al. 2023, Algorithm 1 and Appendix A.1; Chen et al. 2023, Algorithm 2.

    A draft without probabilities (n-gram lookup) is a one-hot distribution: x_i is accepted
    with probability ``target_probs[i, x_i]`` and the residual is the target with x_i removed.
    ``draft_probs`` must have the target's vocabulary width (pad or trim before calling).
    """
    num_draft = len(draft_token_ids)
    if target_probs.shape[0] != num_draft + 1:
        raise ValueError(f"target rows {target_probs.shape[0]} != num_draft_tokens + 1 = {num_draft + 1}")
    draft = torch.as_tensor(list(draft_token_ids), dtype=torch.long)
    rows = torch.arange(num_draft)
    if draft_probs is None:
        draft_probs = torch.zeros(num_draft, target_probs.shape[1])
        draft_probs[rows, draft] = 1.0
    target_of_draft = target_probs[rows, draft]
    draft_of_draft = draft_probs[rows, draft]
    uniform = torch.rand(num_draft, generator=generator)
    # u < p_t / p_d, written without the division; u in [0, 1) so p_t >= p_d always accepts.
    num_accepted = accepted_prefix_length(uniform * draft_of_draft < target_of_draft)
    accepted = [int(t) for t in draft[:num_accepted].tolist()]
    if num_accepted == num_draft:
        return VerifyResult(num_accepted, accepted + [sample_from(target_probs[num_draft], generator)], True)
    residual = residual_distribution(target_probs[num_accepted], draft_probs[num_accepted])
    return VerifyResult(num_accepted, accepted + [sample_from(residual, generator)], False)


def residual_distribution(target_probs: Tensor, draft_probs: Tensor) -> Tensor:
    """``normalize(max(0, target_probs - draft_probs))`` for one position (``[vocab]`` each).

    A rejection has probability ``sum(max(0, draft_probs - target_probs))``, so an all-zero
    residual means the rejection could not happen in exact arithmetic; float rounding can still
    produce it when the two distributions are equal, and then the target itself is the correct
    distribution to sample (it equals the draft).
    """
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    total = residual.sum()
    if total <= 0:
        return target_probs
    return residual / total


def pad_vocab(probs: Tensor, width: int) -> Tensor:
    """Zero-pad ``probs`` (``[rows, vocab]``) to ``width >= vocab`` columns.

    Draft and target may differ only in padding rows of their LM heads (checked at load time).
    Both are padded to the wider of the two, so a draft token beyond the target's width gets
    target probability 0 and is always rejected, and the residual never lands there.
    """
    current = probs.shape[-1]
    if current > width:
        raise ValueError(f"cannot pad {current} columns down to {width}")
    if current == width:
        return probs
    return torch.nn.functional.pad(probs, (0, width - current))
