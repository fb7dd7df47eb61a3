"""Which tokens a reduced-vocabulary draft head keeps (FR-Spec, Zhao et al. 2025, §3).

FR-Spec restricts the *draft's* LM head to the most frequent tokens: the draft computes logits
for those rows only and gives every other token probability 0, so its head costs a fraction of
the full one (an EAGLE head's draft vocabulary is chosen the same way:
:func:`choose_draft_vocabulary`). Verification still scores the full vocabulary with the target,
so the output is unchanged (greedy) or keeps the target's distribution (sampling: the residual covers the tokens
the draft cannot propose). Owns the frequency counts and the choice of the kept set; the runner
that applies it is :class:`verispec.runners.cpu.int8.Int8Runner` (``head_token_ids``). Knows
nothing about models.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError


def token_counts(token_id_sequences: Iterable[Sequence[int]], vocab_size: int) -> Tensor:
    """How often each token id occurs: ``[vocab_size]`` int64 (ids outside the range are ignored)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in token_id_sequences:
        ids = torch.as_tensor(list(ids), dtype=torch.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def corpus_counts(tokenizer, paths: Iterable[str | Path], vocab_size: int, *, max_bytes: int = 20_000_000) -> Tensor:
    """Token counts of text files (read as UTF-8, undecodable bytes replaced), up to ``max_bytes``.

    ``tokenizer.encode(text, add_special_tokens=False)`` turns each file into ids.
    """

    def texts():
        budget = max_bytes
        for path in paths:
            if budget <= 0:
                return
            text = Path(path).read_bytes()[:budget].decode("utf-8", errors="replace")
            budget -= len(text)
            yield tokenizer.encode(text, add_special_tokens=False)

    return token_counts(texts(), vocab_size)


def select_vocabulary(counts: Tensor, size: int, always: Iterable[int] = ()) -> Tensor:
    """The ``size`` most frequent token ids (ties: lower id first) plus ``always``, sorted.

    Args:
        counts: ``[vocab]`` occurrence counts (float or int).
        size: tokens to keep, 1..vocab; ``always`` ids (EOS, chat markers) are added on top.
    Returns:
        ``[kept]`` int64 ascending token ids.
    Raises:
        ValueError: ``size`` out of range or an ``always`` id outside the vocabulary.
    """
    vocab = counts.shape[0]
    if not 1 <= size <= vocab:
        raise ValueError(f"the reduced vocabulary size must be in [1, {vocab}], got {size}")
    # stable sort by descending count keeps lower ids first among equal counts
    order = torch.sort(-counts.double(), stable=True).indices
    kept = set(order[:size].tolist())
    for token_id in always:
        if not 0 <= int(token_id) < vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {vocab}")
        kept.add(int(token_id))
    return torch.tensor(sorted(kept), dtype=torch.int64)


def rank_counts(vocab_size: int) -> Tensor:
    """A corpus-free proxy: byte-level BPE ids are assigned in merge order, roughly by frequency.

    Returns pseudo-counts ``[vocab_size]`` that rank lower ids as more frequent. Weaker than real
    counts (FR-Spec's), but needs no data.
    """
    return torch.arange(vocab_size, 0, -1, dtype=torch.int64)


def coverage(counts: Tensor, kept: Tensor) -> float:
    """Share of the counted occurrences that fall on kept tokens (in [0, 1]; 0 for no counts)."""
    total = counts.sum().item()
    return float(counts[kept].sum().item() / total) if total > 0 else 0.0


def choose_draft_vocabulary(counts: Tensor, draft_vocab_size: int, eos_token_ids: Sequence[int] = ()) -> Tensor:
    """The ``draft_vocab_size`` most frequent token ids, the EOS ids always among them.

    Args:
        counts: ``[vocab]`` occurrence counts (``reduced_vocab.token_counts``).
        draft_vocab_size: rows of the head's ``lm_head``, ``len(eos_token_ids)..vocab``.
    Returns:
        int64 ``[draft_vocab_size]`` ascending target token ids (ties: lower id first).
    Raises:
        InvalidParameterError: a size out of range or an EOS id outside the vocabulary.
    """
    vocab = counts.shape[0]
    always = sorted({int(t) for t in eos_token_ids})
    if not max(len(always), 1) <= draft_vocab_size <= vocab:
        raise InvalidParameterError(
            f"draft_vocab_size must be in [{max(len(always), 1)}, {vocab}], got {draft_vocab_size}"
        )
    if any(not 0 <= t < vocab for t in always):
        raise InvalidParameterError(f"an EOS id of {always} is outside the vocabulary of {vocab}")
    boosted = counts.double().clone()
    boosted[always] = math.inf  # the EOS ids rank first, the rest by count
    return select_vocabulary(boosted, draft_vocab_size)
