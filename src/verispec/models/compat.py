"""Whether a draft model can propose tokens for a target model.

Speculative decoding compares draft and target distributions id by id, so both must use the
same token ids for the same strings, cover the whole tokenizer with their logits, and stop on the
same EOS ids. This module owns that check; it knows nothing about loading or generation and only
needs ``len(tokenizer)`` and ``tokenizer.get_vocab()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from verispec.errors import IncompatibleDraftError


def check_draft_compatibility(
    target_tokenizer: Any,
    draft_tokenizer: Any,
    *,
    target_vocab_size: int,
    draft_vocab_size: int,
    target_eos_token_ids: Iterable[int],
    draft_eos_token_ids: Iterable[int],
) -> None:
    """Raise IncompatibleDraftError unless the draft can serve the target.

    Requires: the same token string for every id (:func:`check_same_tokens`); logits widths
    (``*_vocab_size``, the last dimension of the logits) each at least ``len(tokenizer)``, which
    lets them differ by padding rows only (151936 vs 152064 is fine); and the same set of EOS ids.
    The message names the first mismatch found. Takes ~0.1 s for a 152k-token vocabulary.
    """
    target_tokens = _tokens_by_id(target_tokenizer)
    draft_tokens = _tokens_by_id(draft_tokenizer)
    check_same_tokens(target_tokens, draft_tokens)
    _check_logits_width("target", target_vocab_size, len(target_tokenizer))
    _check_logits_width("draft", draft_vocab_size, len(draft_tokenizer))
    _check_same_eos(tuple(target_eos_token_ids), tuple(draft_eos_token_ids), target_tokens)


def _tokens_by_id(tokenizer: Any) -> list[str | None]:
    """Token string of each id in ``range(len(tokenizer))``; None for an unassigned id."""
    size = len(tokenizer)
    tokens: list[str | None] = [None] * size
    for token, token_id in tokenizer.get_vocab().items():
        if 0 <= token_id < size:
            tokens[token_id] = token
    return tokens


def check_same_tokens(target_tokens: list[str | None], draft_tokens: list[str | None]) -> None:
    """Raise IncompatibleDraftError, in one line naming the first id whose token differs and both
    strings, unless the two lists are equal (``None``: an unassigned id). An id past the end of the
    shorter list counts as absent there, so lists that agree on every shared id but differ in length
    are named by the first id only one of them has. Equal sizes are not enough: every string counts.
    """
    if target_tokens == draft_tokens:
        return
    shared = min(len(target_tokens), len(draft_tokens))
    token_id = next((i for i in range(shared) if target_tokens[i] != draft_tokens[i]), shared)
    sizes = (
        f" (it has {len(draft_tokens)} tokens, the target {len(target_tokens)})"
        if len(target_tokens) != len(draft_tokens)
        else ""
    )
    raise IncompatibleDraftError(
        f"draft vocabulary differs from the target's: id {token_id} is {_show_at(target_tokens, token_id)} in the "
        f"target and {_show_at(draft_tokens, token_id)} in the draft{sizes}; the draft must use the target's "
        "tokenizer, or give --draft none for no draft model"
    )


def _show_at(tokens: list[str | None], token_id: int) -> str:
    return _show(tokens[token_id]) if token_id < len(tokens) else "absent"


def _check_logits_width(role: str, logits_width: int, tokenizer_size: int) -> None:
    if logits_width < tokenizer_size:
        raise IncompatibleDraftError(
            f"{role} logits width {logits_width} is smaller than its tokenizer ({tokenizer_size} "
            f"tokens): ids {logits_width}..{tokenizer_size - 1} would have no probability"
        )


def _check_same_eos(target_eos: tuple[int, ...], draft_eos: tuple[int, ...], tokens: list[str | None]) -> None:
    if set(target_eos) != set(draft_eos):
        raise IncompatibleDraftError(
            f"draft EOS token ids {_describe(draft_eos, tokens)} differ from the target's "
            f"{_describe(target_eos, tokens)}; give a draft of the target's family, or --draft none for no draft model"
        )


def _describe(token_ids: tuple[int, ...], tokens: list[str | None]) -> str:
    named = (f"{i} {_show(tokens[i])}" if 0 <= i < len(tokens) else str(i) for i in token_ids)
    return "[" + ", ".join(named) + "]"


def _show(token: str | None) -> str:
    return "unassigned" if token is None else repr(token)
