"""Model execution behind one small protocol the engine calls.

A runner owns one model and the KV cache of one sequence; :meth:`Runner.new_sequence` (where a
runner offers it) gives another sequence over the same weights, and :func:`forward_batch` runs
the new tokens of several sequences in one pass (one pass over the weights where the runner
can: every row of every sequence through each linear layer at once). The engine never branches
on the runner type: it prefills, forwards new tokens, and rolls back by moving a length. Knows
nothing about drafting, verification or sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from torch import Tensor


@runtime_checkable
class Runner(Protocol):
    """One model + one KV cache.

    Attributes:
        vocab_size: width of the logits rows (may exceed the tokenizer's size by padding rows).
        max_context_length: positions the model supports (prompt + output).

    Optional, on the runners that can hand out their hidden states to a feature drafter (EAGLE-3,
    Li et al. 2025, arXiv 2503.01840; the int8, gguf and torch runners), not required here:

    - ``capture_features(layers: Sequence[int]) -> None``: from now on every pass of this
      sequence (``forward``, ``forward_tree``, a batched pass of :func:`forward_batch`) records,
      for *every* row of the pass (not only the ``num_logits`` rows), the hidden state entering
      each decoder layer in ``layers`` (transformers' ``hidden_states[i]``: 0 the embeddings,
      ``i`` the output of layer ``i - 1``; :mod:`verispec.runners.features`). ``()`` stops it.
      ``new_sequence()`` keeps the setting. Raises InvalidParameterError (a ValueError) for an
      index outside ``0 .. num_layers - 1``.
    - ``last_features: Tensor | None``: float32 ``[rows of this sequence's last pass,
      len(layers) * hidden_size]``, the layers concatenated in the order given; only this
      sequence's rows in a batched pass; None when not capturing (or before the first pass).

    Capture is no extra pass: the states are those the pass computes anyway, and the logits are
    bit-identical with it on or off.

    Optional too: ``release() -> None``, ``truncate(0)`` that also hands the cache's memory back to
    the OS (a static cache allocated at full capacity keeps the pages it was written to otherwise:
    :meth:`verispec.runners.cpu.int8.Int8Runner.release`); the scheduler calls it when a request
    leaves its sequence (:meth:`verispec.engine.state.Slot.release`), and falls back to
    ``truncate(0)`` where a runner has none.

    Optional too: ``kv_bytes_per_token: int``, the bytes one position takes in the sequence's K
    and V caches (layers x 2 x kv_heads x head_dim x bytes per element), read by
    :func:`kv_cache_bytes`.
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


@dataclass
class ForwardCall:
    """The new tokens of one sequence in a batched pass (:func:`forward_batch`).

    Attributes:
        runner: the sequence (a runner, or one from its ``new_sequence()``).
        token_ids: ``[num_new]`` appended at positions ``runner.num_cached_tokens ...``.
        num_logits: rows returned, the last ones (None: all; 0: none, e.g. a prefill chunk
            that is not the prompt's last).
        position_ids, attention_mask: set for a token tree (``forward_tree``'s arguments,
            :mod:`verispec.algorithms.tree`), None for a chain.
    """

    runner: Runner
    token_ids: Sequence[int]
    num_logits: int | None = None
    position_ids: Tensor | None = None
    attention_mask: Tensor | None = None

    @property
    def is_tree(self) -> bool:
        return self.attention_mask is not None


def forward_batch(calls: Sequence[ForwardCall]) -> list[Tensor]:
    """Run every call's tokens; returns each call's logits (float32 ``[rows, vocab_size]``).

    Sequences of one batch-capable runner (a class method ``forward_many`` and the same weights,
    e.g. :class:`verispec.runners.cpu.int8.Int8Runner` and its ``new_sequence()`` s) go through one
    pass; others run one after the other. Either way each sequence's rows equal what its own
    ``forward`` / ``forward_tree`` would return on a batch-invariant runner.

    Raises:
        ValueError: no call, a call the runner rejects (see ``forward``), or one sequence twice.
    """
    if not calls:
        raise ValueError("forward_batch needs at least one call")
    if len({id(call.runner) for call in calls}) != len(calls):
        raise ValueError("a sequence appears twice in one batch")
    first = calls[0].runner
    many = getattr(type(first), "forward_many", None)
    if len(calls) > 1 and many is not None and all(_same_model(first, call.runner) for call in calls):
        return many(calls)
    return [_forward_one(call) for call in calls]


def _same_model(a, b) -> bool:
    return type(a) is type(b) and getattr(a, "weights", None) is getattr(b, "weights", object())


def _forward_one(call: ForwardCall) -> Tensor:
    if call.is_tree:
        return call.runner.forward_tree(call.token_ids, call.position_ids, call.attention_mask)
    if call.num_logits == 0:  # a runner's forward returns at least one row
        return call.runner.forward(call.token_ids, num_logits=1)[:0]
    return call.runner.forward(call.token_ids, num_logits=call.num_logits)


def kv_cache_bytes(runner: Runner, num_tokens: int | None = None) -> int | None:
    """Bytes of one sequence's K and V caches at ``num_tokens`` positions (default the runner's
    ``max_context_length``): layers x 2 x kv_heads x head_dim x bytes per element x tokens. None
    for a runner that does not declare ``kv_bytes_per_token``."""
    per_token = getattr(runner, "kv_bytes_per_token", None)
    if per_token is None:
        return None
    return int(per_token) * int(runner.max_context_length if num_tokens is None else num_tokens)


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
