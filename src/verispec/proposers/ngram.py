"""N-gram (prompt lookup) drafter: copy what followed the last earlier occurrence of the context's tail.

Owns the matching rule (a pure function, the reference) and an index of the context's n-grams
that is extended by the new tokens of each step, so a proposal costs O(max_ngram) however long
the context is. Has no draft probabilities: verification treats its tokens as a one-hot draft.
Knows nothing about models, verification or sampling.
"""

from __future__ import annotations

from typing import Sequence

from verispec.errors import InvalidParameterError
from verispec.proposers import DraftOutput, DraftRequest


def find_ngram_match(context: Sequence[int], min_ngram: int, max_ngram: int) -> tuple[int, int] | None:
    """Where to copy from: ``(n, start)`` for the longest matching suffix n-gram, or None.

    For n from ``max_ngram`` down to ``min_ngram``, look for the most recent *earlier*
    occurrence of the last n tokens, i.e. ``context[start - n : start] == context[-n:]`` with
    ``start < len(context)`` (the suffix itself does not count; an occurrence may overlap it).
    The longest n wins; for one n the most recent occurrence (largest ``start``) wins.
    Prompt lookup decoding (Saxena 2023); vLLM ``NgramProposer``. O(len(context) * max_ngram):
    the reference that :class:`NgramIndex` must agree with.
    """
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n :])
        for start in range(length - 1, n - 1, -1):
            if list(context[start - n : start]) == suffix:
                return n, start
    return None


def copy_continuation(context: Sequence[int], start: int, num_tokens: int) -> list[int]:
    """``num_tokens`` tokens read from ``context[start:]``, continuing into the copy itself.

    An overlapping match (``start`` close to the end) says the text repeats with period
    ``len(context) - start``, so past the end the copy reads its own output (LZ77-style): on
    ``[a, b, a, b]`` copying from 2 gives ``a, b, a, b, ...`` instead of stopping after two.
    """
    length = len(context)
    out: list[int] = []
    for j in range(num_tokens):
        i = start + j
        out.append(int(context[i]) if i < length else out[i - length])
    return out


class NgramIndex:
    """Incremental form of :func:`find_ngram_match` over a context that only grows.

    For each n in ``[min_ngram, max_ngram]`` a dict maps an n-gram to the start of the text
    that followed its most recent occurrence. :meth:`extend` indexes the n-grams that now have a
    following token; :meth:`match` looks up the current suffix. Both cost O(max_ngram).
    """

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.token_ids: list[int] = []
        self._tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extend(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            start = len(self.token_ids)  # the n-grams ending here are now followed by ``token``
            for n, table in self._tables.items():
                if start >= n:
                    table[tuple(self.token_ids[start - n : start])] = start
            self.token_ids.append(int(token))

    def match(self) -> tuple[int, int] | None:
        length = len(self.token_ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self._tables[n].get(tuple(self.token_ids[length - n :]))
            if start is not None:
                return n, start
        return None


class NgramProposer:
    """Prompt-lookup drafter over the request's context (prompt + output so far).

    Args:
        min_ngram, max_ngram: suffix lengths tried, longest first; ``1 <= min_ngram <= max_ngram``.
    Raises:
        InvalidParameterError: on a bad n-gram range.
    """

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidParameterError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._index = NgramIndex(min_ngram, max_ngram)

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        """The continuation of the longest recent match, or an empty draft when none has n >= min_ngram."""
        if num_speculative_tokens <= 0:
            return DraftOutput()
        index = self._sync(request)
        match = index.match()
        if match is None:
            return DraftOutput()
        return DraftOutput(draft_token_ids=copy_continuation(index.token_ids, match[1], num_speculative_tokens))

    def observe(self, num_accepted_tokens: int) -> None:
        """Nothing to learn: accepted tokens arrive with the next request's context."""

    def _sync(self, request: DraftRequest) -> NgramIndex:
        """Extend the index by the new context tokens; start over when the context is not an extension."""
        indexed = self._index.token_ids
        num_prompt = len(request.prompt_token_ids)
        is_extension = (
            len(indexed) >= num_prompt
            and indexed[:num_prompt] == list(request.prompt_token_ids)
            and indexed[num_prompt:] == list(request.output_token_ids[: len(indexed) - num_prompt])
            and len(indexed) <= num_prompt + len(request.output_token_ids)
        )
        if not is_extension:
            self._index = NgramIndex(self.min_ngram, self.max_ngram)
            self._index.extend(request.prompt_token_ids)
        self._index.extend(request.output_token_ids[len(self._index.token_ids) - num_prompt :])
        return self._index
