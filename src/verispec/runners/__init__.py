"""Model execution behind one declared contract the engine calls.

A runner owns one model and the KV cache of one sequence. :class:`Runner` declares everything
the engine may ask of one: three required methods (``num_cached_tokens``, ``forward``,
``truncate``) and every optional capability with a default (trees, more sequences, batched
passes, hidden-state capture, prompt sharing, memory release), each with a ``supports_*`` /
``holds_sequences`` property saying whether the runner implements it, so the engine asks and
never looks names up. :func:`forward_batch` runs the new tokens of several sequences in one pass
where the runner can. Knows nothing about drafting, verification or sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from verispec.errors import InvalidParameterError


class RunnerWeights(Protocol):
    """What a runner's own weight layout hands out (the int8 and gguf runners' ``weights``): the
    token embedding and final norm an EAGLE head borrows, and the bytes held. A layout that can
    also give LM-head rows de-quantized (the gguf weights) has ``output_rows(ids)`` too."""

    vocab_size: int
    layers: Sequence[Any]  # one entry per decoder layer
    final_norm: Tensor | None  # [hidden] float32

    def embed(self, token_ids: Tensor) -> Tensor:
        """float32 ``[len(token_ids), hidden]``: the embedding rows of int64 ``token_ids``."""
        ...

    def nbytes(self) -> int:
        """Bytes the weights hold in memory."""
        ...


class Runner:
    """Base of every runner: one model + one KV cache. Subclasses implement ``num_cached_tokens``,
    :meth:`forward` and :meth:`truncate`; every other method has a default, and a capability is
    on where the subclass implements its method (as :class:`verispec.proposers.Proposer` does).

    Attributes:
        vocab_size: width of the logits rows (may exceed the tokenizer's size by padding rows).
        max_context_length: positions the model supports (prompt + output).
        num_cached_tokens: tokens currently held in the KV cache (= position of the next token).
        kv_bytes_per_token: bytes one position takes in the K and V caches (layers x 2 x kv_heads
            x head_dim x bytes per element), read by :func:`kv_cache_bytes`; None where unknown.
        last_features: float32 ``[rows of this sequence's last pass, len(layers) * hidden_size]``
            while capturing (:meth:`capture_features`), only this sequence's rows of a batched
            pass; None when not capturing (or before the first pass).
        last_final_hidden: float32 ``[rows of the last pass, hidden_size]``: the final normed
            hidden state (the LM head's input) while :meth:`capture_final_hidden` is on; else None.
        model: the transformers model the runner runs (the torch runner); None for runners that
            hold their weights in their own layout.
        weights: the weights in the runner's own layout (:class:`RunnerWeights`: the int8 and
            gguf runners); None for the others.

    Capabilities (each False by default; the engine checks them before calling):
        supports_trees: :meth:`forward_tree` and :meth:`keep_tree_path` (token-tree verification).
        holds_sequences: :meth:`new_sequence` (batching: one sequence per request).
        supports_features: :meth:`capture_features` (hidden states for an EAGLE-3 head).
        supports_final_hidden: :meth:`capture_final_hidden` (the LM head's input, for training a
            head on the runner's own passes, :func:`verispec.training.teacher.runner_teacher`).
        shares_prompts: :meth:`copy_prefix` (one prompt's cache copied to another sequence).
        exports_kv: :meth:`export_kv` and :meth:`import_kv` (cache entries copied out to the
            prefix cache and back, :mod:`verispec.engine.prefix_cache`): only runners whose entries
            do not depend on how a prompt was split into passes declare it (batch-invariant ones).
        runs_block_kernels: the runner runs GGUF weight blocks on the kernels compiled here
            (:mod:`verispec.runners.kernels`), so a drafter's block-quantized layers (an EAGLE
            head's ``q8_0``) run on them beside it at no extra build.
        prefill_chunk_rows: the most rows a pass that feeds a long prompt should hold; the engine
            prefills a request alone, and a draft model catches up, in passes of at most this many
            rows (None: the whole prompt in one pass). On a batch-invariant runner the entries
            and logits are the same bits however a prompt is split; the CPU runners get slower
            per row in passes of many hundred rows (their intermediate tensors leave the caches).
    """

    vocab_size: int
    max_context_length: int
    num_cached_tokens: int
    kv_bytes_per_token: int | None = None
    last_features: Tensor | None = None
    last_final_hidden: Tensor | None = None
    model: Any = None
    weights: RunnerWeights | None = None
    runs_block_kernels: bool = False
    prefill_chunk_rows: int | None = None

    def forward(self, token_ids: Sequence[int], num_logits: int | None = None) -> Tensor:
        """Append ``token_ids`` at positions ``num_cached_tokens ...`` and return their logits.

        Returns:
            float32 ``[num_logits or len(token_ids), vocab_size]``: the rows of the *last*
            ``num_logits`` tokens; row i scores the token that follows token i.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cache entries and drop the rest (0 empties the cache).

        ``num_tokens == num_cached_tokens`` is a no-op. Raises ValueError beyond the length.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement truncate")

    @property
    def supports_trees(self) -> bool:
        """This runner verifies token trees: it implements :meth:`forward_tree`."""
        return type(self).forward_tree is not Runner.forward_tree

    @property
    def holds_sequences(self) -> bool:
        """This runner gives more sequences over its weights: it implements :meth:`new_sequence`."""
        return type(self).new_sequence is not Runner.new_sequence

    @property
    def supports_features(self) -> bool:
        """This runner hands out hidden states: it implements :meth:`capture_features`."""
        return type(self).capture_features is not Runner.capture_features

    @property
    def supports_final_hidden(self) -> bool:
        """This runner hands out its final hidden states: it implements :meth:`capture_final_hidden`."""
        return type(self).capture_final_hidden is not Runner.capture_final_hidden

    @property
    def shares_prompts(self) -> bool:
        """This runner copies a prompt's cache between sequences: it implements :meth:`copy_prefix`."""
        return type(self).copy_prefix is not Runner.copy_prefix

    @property
    def exports_kv(self) -> bool:
        """This runner copies cache entries out and back: it implements :meth:`export_kv`."""
        return type(self).export_kv is not Runner.export_kv

    def export_kv(self, start: int, end: int) -> Tensor:
        """A copy of cache entries ``start .. end - 1``: float ``[2, layers, kv_heads, end - start,
        head_dim]`` (K then V), what :meth:`import_kv` takes back. On a batch-invariant runner
        these are the bits any prefill of the same tokens writes, however it is split into passes.

        Raises:
            ValueError: the range is outside ``0 .. num_cached_tokens``.
            InvalidParameterError: the runner cannot copy its cache out (:attr:`exports_kv`).
        """
        raise InvalidParameterError(f"the {type(self).__name__} cannot copy its KV cache out")

    def import_kv(self, kv: Tensor, start: int) -> None:
        """Keep the first ``start`` entries, then write ``kv`` (``[2, layers, kv_heads, n, head_dim]``
        from :meth:`export_kv` of a sequence over the same weights) at ``start .. start + n - 1``;
        ``num_cached_tokens`` becomes ``start + n``.

        Raises:
            ValueError: ``start`` past the cache, a shape that is not this model's, or past the capacity.
            InvalidParameterError: the runner cannot take entries in (:attr:`exports_kv`).
        """
        raise InvalidParameterError(f"the {type(self).__name__} cannot copy entries into its KV cache")

    def forward_tree(self, token_ids: Sequence[int], position_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Append a token tree (:mod:`verispec.algorithms.tree`) and return one logits row per node:
        float32 ``[num_nodes, vocab_size]``; ``position_ids`` ``[num_nodes]``, ``attention_mask``
        bool ``[num_nodes, num_cached_tokens + num_nodes]``.

        Raises:
            InvalidParameterError: the runner cannot verify trees (:attr:`supports_trees`).
        """
        raise InvalidParameterError(f"the {type(self).__name__} cannot verify token trees")

    def keep_tree_path(self, num_prefix_tokens: int, node_indices: Sequence[int]) -> None:
        """After a tree pass, keep the first ``num_prefix_tokens`` entries and then the tree
        nodes ``node_indices`` (the accepted path, in order); drop the rest.

        Raises:
            InvalidParameterError: the runner cannot verify trees (:attr:`supports_trees`).
        """
        raise InvalidParameterError(f"the {type(self).__name__} cannot verify token trees")

    def new_sequence(self) -> Runner:
        """Another sequence over the same weights, with its own empty cache; it keeps this
        sequence's feature capture.

        Raises:
            InvalidParameterError: the runner holds one sequence only (:attr:`holds_sequences`).
        """
        raise InvalidParameterError(f"the {type(self).__name__} holds one sequence only")

    def shares_weights_with(self, other: Runner) -> bool:
        """``other`` is a sequence over this runner's weights, so :meth:`forward_many` may run
        both in one pass. False by default (each sequence then runs on its own)."""
        return False

    @staticmethod
    def forward_many(calls: Sequence[ForwardCall]) -> list[Tensor]:
        """Each call's logits, for sequences that share weights (:meth:`shares_weights_with`); a
        runner that can overrides this to run them in one pass. By default one after the other."""
        return [forward_one(call) for call in calls]

    def capture_features(self, layers: Sequence[int]) -> None:
        """From now on every pass of this sequence (``forward``, ``forward_tree``, a batched pass)
        records, for *every* row of the pass, the hidden state entering each decoder layer in
        ``layers`` (transformers' ``hidden_states[i]``: 0 the embeddings, ``i`` the output of layer
        ``i - 1``; :mod:`verispec.runners.features`) into :attr:`last_features`; ``()`` stops it.
        No extra pass, and the logits are bit-identical with capture on or off (EAGLE-3, Li et al.
        2025, arXiv 2503.01840).

        Raises:
            InvalidParameterError: an index outside ``0 .. num_layers - 1``, or a runner that
                cannot hand out its hidden states (:attr:`supports_features`).
        """
        raise InvalidParameterError(f"the {type(self).__name__} cannot hand out its hidden states")

    def capture_final_hidden(self, on: bool = True) -> None:
        """From now on (``on``) every pass sets :attr:`last_final_hidden` to this sequence's rows of
        the final normed hidden state; the logits are bit-identical either way.

        Raises:
            InvalidParameterError: the runner cannot hand them out (:attr:`supports_final_hidden`).
        """
        raise InvalidParameterError(f"the {type(self).__name__} cannot hand out its final hidden states")

    def note_context_tokens(self, token_ids: Sequence[int]) -> None:
        """``token_ids`` are in this sequence's context although no pass of it fed them (a cache
        written by :meth:`import_kv`): a runner whose logits depend on the tokens a sequence has seen
        (a reduced draft head with context rows) takes them in. By default nothing."""

    def copy_prefix(self, source: Runner, num_tokens: int) -> None:
        """Make this sequence's cache the first ``num_tokens`` entries of ``source``'s (a sequence
        over the same weights), so a shared prompt is not run twice.

        Raises:
            InvalidParameterError: the runner cannot copy caches (:attr:`shares_prompts`).
        """
        raise InvalidParameterError(f"the {type(self).__name__} cannot copy a cache between sequences")

    def release(self) -> None:
        """``truncate(0)``, and where the runner can, hand the cache's memory back to the OS too (a
        static cache allocated at full capacity otherwise keeps the pages it was written to). The
        scheduler calls it when a request leaves its sequence. By default ``truncate(0)``."""
        self.truncate(0)


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

    Sequences over the same weights (:meth:`Runner.shares_weights_with`, e.g.
    :class:`verispec.runners.cpu.int8.Int8Runner` and its ``new_sequence()`` s) go through their
    runner's :meth:`Runner.forward_many`, one pass; others run one after the other. Either way
    each sequence's rows equal what its own
    ``forward`` / ``forward_tree`` would return on a batch-invariant runner.

    Raises:
        ValueError: no call, a call the runner rejects (see ``forward``), or one sequence twice.
    """
    if not calls:
        raise ValueError("forward_batch needs at least one call")
    if len({id(call.runner) for call in calls}) != len(calls):
        raise ValueError("a sequence appears twice in one batch")
    first = calls[0].runner
    if len(calls) > 1 and all(first.shares_weights_with(call.runner) for call in calls[1:]):
        return type(first).forward_many(calls)
    return [forward_one(call) for call in calls]


def forward_one(call: ForwardCall) -> Tensor:
    """One call's logits through its runner's own ``forward`` / ``forward_tree``."""
    if call.is_tree:
        return call.runner.forward_tree(call.token_ids, call.position_ids, call.attention_mask)
    if call.num_logits == 0:  # a runner's forward returns at least one row
        return call.runner.forward(call.token_ids, num_logits=1)[:0]
    return call.runner.forward(call.token_ids, num_logits=call.num_logits)


def kv_cache_bytes(runner: Runner, num_tokens: int | None = None) -> int | None:
    """Bytes of one sequence's K and V caches at ``num_tokens`` positions (default the runner's
    ``max_context_length``): layers x 2 x kv_heads x head_dim x bytes per element x tokens. None
    for a runner that does not declare ``kv_bytes_per_token``."""
    per_token = runner.kv_bytes_per_token
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
        raise ValueError(
            f"{num_cached_tokens + num_new_tokens} positions exceed the context length {max_context_length}"
        )


def prefill(runner: Runner, token_ids: Sequence[int]) -> Tensor:
    """Empty the runner's cache and run the prompt; returns the last row ``[vocab_size]``."""
    runner.truncate(0)
    return runner.forward(token_ids, num_logits=1)[0]
