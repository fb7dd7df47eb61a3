"""The batch-invariant CPU runner over a model's row-local ops: :class:`CPURunner`.

Owns a static KV cache per sequence and everything a :class:`verispec.runners.Runner` does with it
(chains, token trees, several sequences in one pass, hidden-state capture, rollback, prefix copies,
cache export and import, page release); the pass itself is :mod:`verispec.runners.cpu.decoder`'s,
over the ops it is given (:class:`verispec.runners.cpu.decoder_ops.DecoderOps`). The int8 runner
(:class:`verispec.runners.cpu.int8.Int8Runner`) and the gguf runner
(:class:`verispec.runners.cpu.gguf_runner.GGUFRunner`) are this class over their own ops. Every row
of a verify pass is bit-identical to a one-token pass, so speculative greedy output equals plain
greedy output. Rollback moves a length. Knows nothing about drafting or sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from verispec.runners import ForwardCall, Runner, check_new_tokens
from verispec.runners.cpu.decoder import Segment, run_segments
from verispec.runners.cpu.decoder_ops import DecoderOps
from verispec.runners.cpu.memory import release_pages
from verispec.runners.features import check_feature_layers


class CPURunner(Runner):
    """:class:`verispec.runners.Runner` over ``ops`` (:class:`DecoderOps`: the model and its
    row-local ops) with a static KV cache.

    Args:
        ops: the model's ops; shared by every sequence of the model (:meth:`new_sequence`).
        max_context_length: KV cache capacity in tokens (at most the RoPE table's length;
            default all of it).
    """

    # Passes of 64-256 rows prefill a 1,200-token prompt of the 1.5B target 1.2x faster than one
    # pass (AMD Zen 4, avx512: 6.6-7.3 s vs 8.0-8.9 s): a [1200, 17920] gate-up output is 86 MB.
    prefill_chunk_rows = 128

    def __init__(self, ops: DecoderOps, *, max_context_length: int | None = None) -> None:
        weights = ops.weights
        capacity = int(max_context_length or weights.cos.shape[0])
        if capacity > weights.cos.shape[0]:
            raise ValueError(f"max_context_length {capacity} exceeds the {weights.cos.shape[0]} prepared positions")
        self.ops = ops
        self.weights = weights
        self.vocab_size = weights.vocab_size
        self.max_context_length = capacity
        shape = (len(weights.layers), weights.num_kv_heads, capacity, weights.head_dim)
        # uninitialised on purpose: a slot is read only after this pass or an earlier one wrote it
        # (attention over slots < num_cached_tokens + new rows), so the pages of an unused context
        # are never touched and never resident
        self._keys = torch.empty(shape)
        self._values = torch.empty(shape)
        self._num_cached = 0
        self._feature_layers: tuple[int, ...] = ()
        self.last_features: Tensor | None = None  # see capture_features
        self._capture_final = False
        self.last_final_hidden: Tensor | None = None  # see capture_final_hidden
        context_head = weights.context_head
        self._head_rows = None if context_head is None else context_head.sequence()  # see note_context_tokens

    @classmethod
    def over_ops(cls, ops: DecoderOps, *, max_context_length: int | None = None) -> CPURunner:
        """A sequence of this class over ``ops`` (whatever the class's own constructor takes)."""
        sequence = cls.__new__(cls)
        CPURunner.__init__(sequence, ops, max_context_length=max_context_length)
        return sequence

    @property
    def runs_block_kernels(self) -> bool:
        return self.ops.runs_block_kernels

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one position takes in this sequence's K and V caches: layers x 2 x kv_heads x
        head_dim x 4 (float32); the cache is allocated at ``max_context_length`` positions."""
        w = self.weights
        return len(w.layers) * 2 * w.num_kv_heads * w.head_dim * self._keys.element_size()

    def new_sequence(self) -> CPURunner:
        """Another sequence over the same weights and ops: its own empty KV cache of the same
        capacity (allocated, not touched: pages become resident as tokens are written)."""
        sequence = type(self).over_ops(self.ops, max_context_length=self.max_context_length)
        sequence.capture_features(self._feature_layers)
        return sequence

    def shares_weights_with(self, other: Runner) -> bool:
        """``other`` is a sequence of the same class over these very weights (one batched pass)."""
        return type(other) is type(self) and other.weights is self.weights

    def capture_features(self, layers: Sequence[int]) -> None:
        """From now on every pass of this sequence (``forward``, ``forward_tree``, ``forward_many``)
        sets :attr:`last_features` to float32 ``[rows of the pass, len(layers) * hidden_size]``:
        for every row (not only the logits rows), the hidden state entering each decoder layer in
        ``layers`` (:mod:`verispec.runners.features`' convention; 0: the embeddings), concatenated
        in the order given. ``()`` stops it (``last_features`` None). :meth:`new_sequence` copies
        the setting. The states are references the pass holds anyway, copied once per sequence:
        logits are unchanged bit for bit, and a row's features, like its logits, do not depend
        on the other rows of the pass.

        Raises:
            InvalidParameterError: a layer outside ``0 .. num_layers - 1``.
        """
        self._feature_layers = check_feature_layers(layers, len(self.weights.layers))
        self.last_features = None

    def capture_final_hidden(self, on: bool = True) -> None:
        """From now on (``on``) every pass sets :attr:`last_final_hidden` to float32 ``[rows of the
        pass, hidden_size]``: the final normed hidden state of every row, the LM head's input (what
        a head is distilled against, :func:`verispec.training.loop.runner_teacher`). Logits are
        unchanged; not copied by :meth:`new_sequence` (a training-time setting)."""
        self._capture_final = bool(on)
        self.last_final_hidden = None

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], num_logits: int | None = None) -> Tensor:
        return self._run([ForwardCall(self, token_ids, num_logits)])[0]

    @torch.inference_mode()
    def forward_tree(self, token_ids: Sequence[int], position_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Score a token tree in one pass (layout: :mod:`verispec.algorithms.tree`).

        Args:
            token_ids: ``[num_nodes]`` in topological order; node i goes to cache slot
                ``num_cached_tokens + i``.
            position_ids: ``[num_nodes]`` int64 RoPE positions (cached length + depth).
            attention_mask: ``[num_nodes, num_cached_tokens + num_nodes]`` bool.
        Returns:
            float32 ``[num_nodes, vocab_size]``. Node i attends exactly the slots its mask row
            allows, gathered in order, with the same op as a one-token step: a node on the
            accepted path gets the logits plain decoding would. Follow with
            :meth:`keep_tree_path`.
        """
        return self._run([ForwardCall(self, token_ids, None, position_ids, attention_mask)])[0]

    @staticmethod
    @torch.inference_mode()
    def forward_many(calls: Sequence[ForwardCall]) -> list[Tensor]:
        """Several sequences over the same weights in one pass (:func:`verispec.runners.forward_batch`):
        all their rows go through each linear layer together, attention runs per sequence over
        its own cache. Every op is row-local, so each sequence's logits are bit-identical to its
        own ``forward`` / ``forward_tree``. Raises ValueError as those do, before any cache changes."""
        return CPURunner._run(calls)

    @staticmethod
    def _run(calls: Sequence[ForwardCall]) -> list[Tensor]:
        """One decoder pass over ``calls`` (sequences of one class over the same weights): each
        call checked and placed, the pass, then each sequence's length and captures moved."""
        runners = [call.runner for call in calls]
        segments = [r._segment(call) for r, call in zip(runners, calls)]
        if len({id(r) for r in runners}) != len(runners):
            raise ValueError("a sequence appears twice in one pass")
        for r, call in zip(runners, calls):
            r.note_context_tokens(call.token_ids)
        logits = run_segments(runners[0].ops, segments)
        for r, seg in zip(runners, segments):
            r._num_cached = seg.start + len(seg.token_ids)
            if seg.feature_layers:
                r.last_features = seg.features
            if seg.capture_final:
                r.last_final_hidden = seg.final_hidden
        return logits

    def keep_tree_path(self, num_prefix_tokens: int, node_indices: Sequence[int]) -> None:
        """Keep ``num_prefix_tokens`` cache entries plus tree nodes ``node_indices`` (offsets after
        the prefix, in order), moved to contiguous slots. No recompute."""
        keep = torch.tensor(list(node_indices), dtype=torch.long) + num_prefix_tokens
        if keep.numel() and (int(keep.min()) < num_prefix_tokens or int(keep.max()) >= self._num_cached):
            raise ValueError(f"node indices {list(node_indices)} outside the cached tree")
        end = num_prefix_tokens + keep.numel()
        self._keys[:, :, num_prefix_tokens:end] = self._keys[:, :, keep]  # advanced indexing copies first
        self._values[:, :, num_prefix_tokens:end] = self._values[:, :, keep]
        self._num_cached = end

    def _segment(self, call: ForwardCall) -> Segment:
        """Check ``call`` against this cache and say where its rows go; nothing changes yet."""
        num_new, start = len(call.token_ids), self._num_cached
        if not call.is_tree:
            check_new_tokens(start, num_new, self.max_context_length)
            if call.num_logits is not None and not 0 <= call.num_logits <= num_new:
                raise ValueError(f"num_logits {call.num_logits} outside 0..{num_new}")
            positions, visible = torch.arange(start, start + num_new), None
        else:
            if num_new == 0:
                raise ValueError("forward_tree needs at least one node")
            mask, positions = call.attention_mask, call.position_ids
            if mask.shape != (num_new, start + num_new):
                raise ValueError(f"mask shape {tuple(mask.shape)} != ({num_new}, {start + num_new})")
            if start + num_new > self.max_context_length or int(positions.max()) >= self.max_context_length:
                raise ValueError(f"the tree does not fit the context length {self.max_context_length}")
            positions, visible = positions.long(), [row.nonzero().flatten() for row in mask]
        return Segment(
            self._keys,
            self._values,
            start,
            list(call.token_ids),
            positions,
            visible,
            call.num_logits if visible is None else None,
            self._feature_layers,
            self._capture_final,
            head_rows=self._head_rows,
        )

    def note_context_tokens(self, token_ids: Sequence[int]) -> None:
        """A reduced draft head with context rows (:mod:`verispec.runners.cpu.context_head`) adds the
        rows of ``token_ids`` for this sequence; every pass notes its own tokens, and a cache written
        otherwise (:meth:`import_kv`) is noted by whoever wrote it. Nothing otherwise."""
        if self._head_rows is not None:
            self._head_rows.add(token_ids)

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_cached:
            raise ValueError(f"cannot truncate a cache of {self._num_cached} tokens to {num_tokens}")
        self._num_cached = num_tokens  # entries past the length are overwritten before they are read

    def copy_prefix(self, source: CPURunner, num_tokens: int) -> None:
        """Hold ``source``'s first ``num_tokens`` cache entries and nothing after: ``source`` is
        another sequence over the same weights, and the entries are what a prefill of the same
        tokens would write here, bit for bit (each row of a pass is row-local, so neither the
        chunking nor the other sequences of a pass change them), for the cost of a copy. The
        scheduler prefills a prompt once for the ``n`` choices of a request this way.

        Raises:
            ValueError: ``source`` runs other weights, or holds fewer than ``num_tokens`` tokens.
        """
        if source.weights is not self.weights:
            raise ValueError("copy_prefix needs a sequence over the same weights")
        if not 0 <= num_tokens <= min(source._num_cached, self.max_context_length):
            raise ValueError(f"cannot copy {num_tokens} tokens from a cache of {source._num_cached}")
        self._keys[:, :, :num_tokens] = source._keys[:, :, :num_tokens]
        self._values[:, :, :num_tokens] = source._values[:, :, :num_tokens]
        self._num_cached = num_tokens
        if self._head_rows is not None:
            self._head_rows.copy_from(source._head_rows)

    def export_kv(self, start: int, end: int) -> Tensor:
        """Entries ``start .. end - 1`` of every layer's K and V caches, copied: float32 ``[2, layers,
        kv_heads, end - start, head_dim]``. Every op of a pass is row-local, so they are the bits
        any prefill of the same tokens writes (chunked or not, batched or alone).

        Raises:
            ValueError: the range is outside ``0 .. num_cached_tokens``.
        """
        if not 0 <= start <= end <= self._num_cached:
            raise ValueError(f"cannot export entries {start}..{end} of a cache of {self._num_cached} tokens")
        return torch.stack((self._keys[:, :, start:end], self._values[:, :, start:end]))

    def import_kv(self, kv: Tensor, start: int) -> None:
        """Keep ``start`` entries and write ``kv`` (``[2, layers, kv_heads, n, head_dim]`` float32,
        from :meth:`export_kv` of a sequence over the same weights) after them.

        Raises:
            ValueError: ``start`` past the cache, a shape that is not this model's, or past the capacity.
        """
        expected = (2, *self._keys.shape[:2], self._keys.shape[3])
        if (
            kv.dim() != 5
            or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != expected
            or kv.dtype != self._keys.dtype
        ):
            raise ValueError(f"KV entries of shape {tuple(kv.shape)} do not fit this model's cache {expected}")
        end = start + kv.shape[3]
        if not 0 <= start <= self._num_cached or end > self.max_context_length:
            raise ValueError(
                f"cannot write {kv.shape[3]} entries at {start} in a cache holding {self._num_cached} "
                f"of {self.max_context_length}"
            )
        self._keys[:, :, start:end] = kv[0]
        self._values[:, :, start:end] = kv[1]
        self._num_cached = end

    def release(self) -> None:
        """Empty the cache (``truncate(0)``) and hand the pages its tokens were written to back
        to the OS (:func:`verispec.runners.cpu.memory.release_pages`): a sequence waiting in a pool
        between requests holds no KV memory, instead of the pages of the longest request it ever
        held (8 pooled sequences of the default pair: 80 KiB per token each, target and draft).
        The next tokens written fault in fresh pages; entries are written before they are read."""
        self._num_cached = 0
        self.last_features = None
        if self._head_rows is not None:
            self._head_rows.reset()
        release_pages(self._keys)
        release_pages(self._values)
