"""Model execution behind one small protocol the engine calls.

A runner owns one model and its KV cache for one sequence. The engine never branches on the
runner type: it prefills, forwards new tokens, and rolls back by moving a length. Knows nothing
about drafting, verification or sampling.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from torch import Tensor


@runtime_checkable
class Runner(Protocol):
    """One model + one KV cache.

    Attributes:
        vocab_size: width of the logits rows (may exceed the tokenizer's size by padding rows).
        max_context_length: positions the model supports (prompt + output).
    """

    vocab_size: int
    max_context_length: int

    @property
    def num_cached_tokens(self) -> int:
        """Tokens currently held in the KV cache (= position of the next token)."""
        ...

    def forward(self, token_ids: Sequence[int], num_logits: int | None = None) -> Tensor:
        """Append ``token_ids`` at positions ``num_cached_tokens ...`` and return their logits.

        Returns:
            float32 ``[num_logits or len(token_ids), vocab_size]``: the rows of the *last*
            ``num_logits`` tokens; row i scores the token that follows token i.
        """
        ...

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cache entries and drop the rest (0 empties the cache).

        ``num_tokens == num_cached_tokens`` is a no-op. Raises ValueError beyond the length.
        """
        ...


def check_new_tokens(num_cached_tokens: int, num_new_tokens: int, max_context_length: int) -> None:
    """The argument checks every runner's ``forward`` shares.

    Raises:
        ValueError: no new token, or the cache would exceed ``max_context_length`` positions.
    """
    if num_new_tokens == 0:
        raise ValueError("forward needs at least one token")
    if num_cached_tokens + num_new_tokens > max_context_length:
        raise ValueError(f"{num_cached_tokens + num_new_tokens} positions exceed the context length {max_context_length}")


def prefill(runner: Runner, token_ids: Sequence[int]) -> Tensor:
    """Empty the runner's cache and run the prompt; returns the last row ``[vocab_size]``."""
    runner.truncate(0)
    return runner.forward(token_ids, num_logits=1)[0]
