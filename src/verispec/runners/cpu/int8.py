"""Fast batch-invariant CPU runner for the Llama/Qwen2 family: int8 weights, a lean forward.

Owns a static KV cache per sequence over a decoder's int8 weights
(:class:`verispec.runners.cpu.int8_weights.Int8Weights`) and a forward pass written for them
(RMSNorm, RoPE, grouped-query attention, SwiGLU), over one or several sequences. Every row of
every op depends on its own token only: the linear layers use per-row activation scales with
exact int32 accumulation (:mod:`verispec.runners.cpu.int8_ops`), norms and activations are
row-wise, and attention runs one query at a time over exactly the keys it sees,
with the same shapes as a one-token decode step. So a k-token verify pass gives bit-identical
logits and KV entries to k one-token steps, and speculative greedy output equals plain greedy
output of this runner. With :meth:`Int8Runner.capture_features` on, a pass also hands out the
hidden states of chosen layers for every row (EAGLE-3 features, :mod:`verispec.runners.features`),
which are as batch-invariant as the logits. Rollback moves a length. Knows nothing about drafting
or sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.runners import ForwardCall, Runner, check_new_tokens
from verispec.runners.cpu.int8_weights import DEFAULT_MAX_CONTEXT, Int8Weights
from verispec.runners.cpu.memory import release_pages
from verispec.runners.features import check_feature_layers, concat_features


@contextmanager
def single_thread():
    """Run the enclosed torch ops on one intra-op thread, then restore the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Row-wise RMSNorm of ``x`` ``[rows, hidden]`` float32 (Zhang & Sennrich 2019)."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE, half-split layout (Su et al. 2021).

    ``x`` ``[rows, heads, head_dim]``, ``cos``/``sin`` ``[rows, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Int8Runner(Runner):
    """:class:`verispec.runners.Runner` over :class:`Int8Weights` with a static KV cache.

    Args:
        weights: the quantized model.
        max_context_length: KV cache capacity in tokens (at most the RoPE table's length).
    """

    def __init__(self, weights: Int8Weights, *, max_context_length: int | None = None) -> None:
        capacity = int(max_context_length or weights.cos.shape[0])
        if capacity > weights.cos.shape[0]:
            raise ValueError(f"max_context_length {capacity} exceeds the {weights.cos.shape[0]} prepared positions")
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

    @classmethod
    def from_module(
        cls,
        model: torch.nn.Module,
        *,
        max_context_length: int | None = None,
        kernel: str = "auto",
        head_token_ids: Tensor | None = None,
    ) -> Int8Runner:
        """Quantize a transformers Qwen2/Llama model; capacity defaults to min(model's, 4096).

        ``head_token_ids`` ``[kept]``: a reduced-vocabulary LM head (drafts only; see
        :mod:`verispec.runners.cpu.reduced_vocab`).
        """
        capacity = int(max_context_length or min(int(model.config.max_position_embeddings), DEFAULT_MAX_CONTEXT))
        weights = Int8Weights.from_module(model, capacity, kernel=kernel, head_token_ids=head_token_ids)
        return cls(weights, max_context_length=capacity)

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one position takes in this sequence's K and V caches: layers x 2 x kv_heads x
        head_dim x 4 (float32); the cache is allocated at ``max_context_length`` positions."""
        w = self.weights
        return len(w.layers) * 2 * w.num_kv_heads * w.head_dim * self._keys.element_size()

    def new_sequence(self) -> Int8Runner:
        """Another sequence over the same weights: its own empty KV cache of the same capacity
        (allocated, not touched: pages become resident as tokens are written)."""
        sequence = type(self)(self.weights, max_context_length=self.max_context_length)
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
        return _run_segments([self._segment(ForwardCall(self, token_ids, num_logits))])[0]

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
        return _run_segments([self._segment(ForwardCall(self, token_ids, None, position_ids, attention_mask))])[0]

    @staticmethod
    @torch.inference_mode()
    def forward_many(calls: Sequence[ForwardCall]) -> list[Tensor]:
        """Several sequences over the same weights in one pass (:func:`verispec.runners.forward_batch`):
        all their rows go through each linear layer together, attention runs per sequence over
        its own cache. Every op is row-local, so each sequence's logits are bit-identical to its
        own ``forward`` / ``forward_tree``. Raises ValueError as those do, before any cache changes."""
        return _run_segments([call.runner._segment(call) for call in calls])

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

    def _segment(self, call: ForwardCall) -> _Segment:
        """Check ``call`` against this cache and say where its rows go; nothing changes yet."""
        num_new, start = len(call.token_ids), self._num_cached
        if not call.is_tree:
            check_new_tokens(start, num_new, self.max_context_length)
            if call.num_logits is not None and not 0 <= call.num_logits <= num_new:
                raise ValueError(f"num_logits {call.num_logits} outside 0..{num_new}")
            return _Segment(self, list(call.token_ids), torch.arange(start, start + num_new), None, call.num_logits)
        if num_new == 0:
            raise ValueError("forward_tree needs at least one node")
        mask, positions = call.attention_mask, call.position_ids
        if mask.shape != (num_new, start + num_new):
            raise ValueError(f"mask shape {tuple(mask.shape)} != ({num_new}, {start + num_new})")
        if start + num_new > self.max_context_length or int(positions.max()) >= self.max_context_length:
            raise ValueError(f"the tree does not fit the context length {self.max_context_length}")
        visible = [row.nonzero().flatten() for row in mask]
        return _Segment(self, list(call.token_ids), positions.long(), visible, None)

    def _rope_rows(self, positions: Tensor):
        """What :meth:`_rope_store` needs for ``positions`` ``[rows]``, computed once per pass:
        here the ``cos``, ``sin`` rows ``[rows, head_dim]``."""
        return self.weights.cos[positions], self.weights.sin[positions]

    def _tree_slots(self, visible: list[Tensor]):
        """What :meth:`_attend` needs for a tree pass, once per pass: here the per-row slot lists."""
        return visible

    def _rope_store(self, qkv: Tensor, rope, keys: Tensor, values: Tensor, start: int) -> Tensor:
        """RoPE on the q and k parts of ``qkv`` ``[rows, (heads + 2 kv_heads) * head_dim]`` with
        ``rope`` from :meth:`_rope_rows`; k and v go to cache slots ``start ..``; returns q
        ``[rows, heads, head_dim]``."""
        w = self.weights
        rows, q_width, kv_width = qkv.shape[0], w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
        cos, sin = rope
        qk = rotate(qkv[:, : q_width + kv_width].view(rows, w.num_heads + w.num_kv_heads, w.head_dim), cos, sin)
        v = qkv[:, q_width + kv_width :].view(rows, w.num_kv_heads, w.head_dim)
        keys[:, start : start + rows] = qk[:, w.num_heads :].transpose(0, 1)
        values[:, start : start + rows] = v.transpose(0, 1)
        return qk[:, : w.num_heads]

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """Row-local RMSNorm of ``x`` ``[rows, hidden]`` float32 with ``weight`` ``[hidden]``."""
        return rms_norm(x, weight, self.weights.rms_norm_eps)

    def _add_norm(self, x: Tensor, delta: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """A residual step: ``(x + delta, self._norm(x + delta, weight))``, both ``[rows, hidden]``."""
        x = x + delta
        return x, self._norm(x, weight)

    def _swiglu(self, gate_up: Tensor) -> Tensor:
        """``silu(gate) * up`` of ``gate_up`` ``[rows, 2 * ffn]`` (Shazeer 2020), row-local."""
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def _attend(
        self, q: Tensor, keys: Tensor, values: Tensor, start: int, visible: list[Tensor] | None = None
    ) -> Tensor:
        """GQA attention, one query at a time over exactly its visible keys.

        ``q`` ``[rows, heads, head_dim]``; ``keys``/``values`` ``[kv_heads, capacity, head_dim]``
        holding slots ``0 .. start + rows - 1``. Row i sees slots ``0 .. start + i`` (causal) or
        ``visible[i]`` (tree). Returns ``[rows, heads * head_dim]``. Query i runs the same op with
        the same shapes as a one-token step at its position would, which is what makes verify
        passes batch-invariant. Runs on one thread: these ops are small, and a parallel region
        per op costs more than it saves (far more on a busy CPU).
        """
        w = self.weights
        out = torch.empty(q.shape[0], w.num_heads * w.head_dim)
        keys, values = keys[None], values[None]  # [1, kv_heads, capacity, head_dim]
        with single_thread():
            for i in range(q.shape[0]):
                if visible is None:
                    seen_keys, seen_values = keys[:, :, : start + i + 1], values[:, :, : start + i + 1]
                else:
                    seen_keys, seen_values = keys[:, :, visible[i]], values[:, :, visible[i]]
                attended = torch.nn.functional.scaled_dot_product_attention(
                    q[i, :, None, :][None], seen_keys, seen_values, scale=w.head_dim**-0.5, enable_gqa=True
                )  # [1, heads, 1, head_dim]
                out[i] = attended.view(-1)
        return out

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_cached:
            raise ValueError(f"cannot truncate a cache of {self._num_cached} tokens to {num_tokens}")
        self._num_cached = num_tokens  # entries past the length are overwritten before they are read

    def copy_prefix(self, source: Int8Runner, num_tokens: int) -> None:
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

    def release(self) -> None:
        """Empty the cache (``truncate(0)``) and hand the pages its tokens were written to back
        to the OS (:func:`verispec.runners.cpu.memory.release_pages`): a sequence waiting in a pool
        between requests holds no KV memory, instead of the pages of the longest request it ever
        held (8 pooled sequences of the default pair: 80 KiB per token each, target and draft).
        The next tokens written fault in fresh pages; entries are written before they are read."""
        self._num_cached = 0
        self.last_features = None
        release_pages(self._keys)
        release_pages(self._values)


@dataclass
class _Segment:
    """One sequence's rows in a pass: tokens, RoPE positions ``[rows]``, tree slots or None."""

    runner: Int8Runner
    token_ids: list[int]
    positions: Tensor
    visible: list[Tensor] | None
    num_logits: int | None

    @property
    def num_rows(self) -> int:
        return len(self.token_ids) if self.num_logits is None else self.num_logits


def _run_segments(segments: list[_Segment]) -> list[Tensor]:
    """The decoder over every segment's new tokens (each at its cache's slots ``num_cached ..``):
    linear layers, norms and the LM head over all rows at once; RoPE, the cache write and
    attention per segment. Returns each segment's last ``num_rows`` logits rows, and sets each
    capturing runner's ``last_features`` to its own rows (:meth:`Int8Runner.capture_features`)."""
    runners = [seg.runner for seg in segments]
    if len({id(r) for r in runners}) != len(runners):
        raise ValueError("a sequence appears twice in one pass")
    w = runners[0].weights
    sizes = [len(seg.token_ids) for seg in segments]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    x = w.embed(torch.tensor([t for seg in segments for t in seg.token_ids], dtype=torch.long))  # [rows, hidden]
    ropes = [r._rope_rows(seg.positions) for r, seg in zip(runners, segments)]  # once per pass
    trees = [None if seg.visible is None else r._tree_slots(seg.visible) for r, seg in zip(runners, segments)]
    wanted = {i for r in runners for i in r._feature_layers}
    states: dict[int, Tensor] = {}  # layer index -> the residual stream entering it, [rows, hidden]
    ops = runners[0]  # the runner class's row-local ops (norms, SwiGLU): the same for every segment
    normed = ops._norm(x, w.layers[0].input_norm)
    for index, layer in enumerate(w.layers):
        if index in wanted:
            states[index] = x  # a reference: x is rebound below, never written in place
        qkv = layer.qkv(normed)
        parts = []
        for i, r in enumerate(runners):
            keys, values = r._keys[index], r._values[index]  # [kv_heads, capacity, head_dim]
            q = r._rope_store(qkv[bounds[i] : bounds[i + 1]], ropes[i], keys, values, r._num_cached)
            parts.append(r._attend(q, keys, values, r._num_cached, trees[i]))
        x, normed = ops._add_norm(x, layer.o(parts[0] if len(parts) == 1 else torch.cat(parts)), layer.post_norm)
        delta = layer.down(ops._swiglu(layer.gate_up(normed)))
        if index + 1 < len(w.layers):
            x, normed = ops._add_norm(x, delta, w.layers[index + 1].input_norm)
        else:
            x = x + delta
    for i, (r, size) in enumerate(zip(runners, sizes)):
        r._num_cached += size
        if r._feature_layers:
            r.last_features = concat_features(states, r._feature_layers, bounds[i], bounds[i + 1])
        if r._capture_final:
            r.last_final_hidden = ops._norm(x[bounds[i] : bounds[i + 1]], w.final_norm)
    counts = [seg.num_rows for seg in segments]
    if sum(counts) == 0:
        return [torch.empty(0, runners[0].vocab_size) for _ in segments]
    if len(segments) == 1:
        last = x[bounds[1] - counts[0] :]
    else:
        last = x[torch.cat([torch.arange(bounds[i + 1] - n, bounds[i + 1]) for i, n in enumerate(counts)])]
    logits = w.lm_head(ops._norm(last, w.final_norm))
    if w.head_token_ids is not None:
        full = torch.full((logits.shape[0], runners[0].vocab_size), float("-inf"))
        full[:, w.head_token_ids] = logits  # tokens outside the kept set get probability 0
        logits = full
    return list(logits.split(counts)) if len(segments) > 1 else [logits]
