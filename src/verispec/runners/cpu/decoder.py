"""The decoder pass of the int8 and gguf runners over one or several sequences' new rows.

Owns the order of a decoder layer as :class:`verispec.runners.cpu.gguf_arch.Architecture`
describes it: embedding (scaled or not), pre-norm, q/k/v (per-head q/k RMSNorm), RoPE and the KV
write, attention (causal, tree, sliding window), an optional norm of the attention output,
residual, norm, gated MLP (SwiGLU or GELU-tanh), an optional norm of the MLP output, residual; the
final norm and LM head. The row-local ops themselves (norms, RoPE, attention, activations) come
through :class:`verispec.runners.cpu.decoder_ops.DecoderOps` (:class:`verispec.runners.cpu.int8.Int8Ops`
in torch, :class:`verispec.runners.cpu.gguf_runner.GGUFOps` in C++), the caches through
:class:`Segment`s. Every op is row-local, so each sequence's logits do not depend on the other rows
of the pass. Knows nothing about drafting, sampling, files or a runner's own state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.runners.cpu.context_head import SequenceHeadRows
from verispec.runners.cpu.decoder_ops import DecoderOps
from verispec.runners.features import concat_features
from verispec.runners.kernels import one_isa


@dataclass
class Segment:
    """One sequence's rows in a pass: its tokens and RoPE positions ``[rows]`` int64, tree slots or
    None, and its cache: ``keys`` / ``values`` ``[layers, kv_heads, capacity, head_dim]`` holding
    ``start`` slots (the new rows go to ``start ..``). ``feature_layers`` / ``capture_final``: what
    the pass hands back in ``features`` / ``final_hidden`` (None when not asked); ``head_rows``:
    the extra rows of a reduced head this sequence's logits rows get."""

    keys: Tensor
    values: Tensor
    start: int
    token_ids: list[int]
    positions: Tensor
    visible: list[Tensor] | None
    num_logits: int | None
    feature_layers: tuple[int, ...] = ()
    capture_final: bool = False
    features: Tensor | None = None  # set by the pass: [rows, len(feature_layers) * hidden]
    final_hidden: Tensor | None = None  # set by the pass: [rows, hidden]
    head_rows: SequenceHeadRows | None = None  # a reduced head's extra rows for this sequence

    @property
    def num_rows(self) -> int:
        return len(self.token_ids) if self.num_logits is None else self.num_logits

    def windowed(self, window: int) -> list[Tensor]:
        """The tree rows' visible slots (``visible``) that lie inside a sliding ``window``: slots
        whose position is above the row's position - window (slot s < ``start`` holds position s;
        tree node j's slot ``start + j`` holds ``positions[j]``)."""
        slot_positions = torch.cat([torch.arange(self.start), self.positions])
        return [v[slot_positions[v] > int(self.positions[i]) - window] for i, v in enumerate(self.visible)]


def head_norms(ops: DecoderOps, qkv: Tensor, layer, num_heads: int, num_kv_heads: int, head_dim: int) -> Tensor:
    """``qkv`` ``[rows, (heads + 2 kv_heads) * head_dim]`` with each q and k head RMS-normed by
    ``layer.q_norm`` / ``layer.k_norm`` ``[head_dim]`` (Qwen3, Gemma 3: before RoPE); v unchanged."""
    rows, q_width, k_width = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = ops.norm(qkv[:, :q_width].reshape(-1, head_dim), layer.q_norm).view(rows, q_width)
    k = ops.norm(qkv[:, q_width : q_width + k_width].reshape(-1, head_dim), layer.k_norm).view(rows, k_width)
    return torch.cat([q, k, qkv[:, q_width + k_width :]], dim=1)


def run_segments(ops: DecoderOps, segments: list[Segment]) -> list[Tensor]:
    """The decoder of ``ops.weights`` over every segment's new tokens (each at its cache's slots
    ``start ..``; each segment a cache of its own): linear layers, norms and the LM head over all
    rows at once; RoPE, the cache write and attention per segment. Returns each segment's last
    ``num_rows`` logits rows ``[num_rows, vocab]`` float32, and sets each capturing segment's
    ``features`` / ``final_hidden`` to its own rows; the caller moves its caches' lengths. On the
    compiled kernels, the pass runs on the ISA chosen as it starts (:func:`one_isa`)."""
    with one_isa() if ops.runs_block_kernels else contextlib.nullcontext():
        return _run_segments(ops, segments)


def _run_segments(ops: DecoderOps, segments: list[Segment]) -> list[Tensor]:
    w = ops.weights
    sizes = [len(seg.token_ids) for seg in segments]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    x = w.embed(torch.tensor([t for seg in segments for t in seg.token_ids], dtype=torch.long))  # [rows, hidden]
    if w.arch.embedding_scale != 1.0:
        x = x * w.arch.embedding_scale
    wanted = {i for seg in segments for i in seg.feature_layers}
    states: dict[int, Tensor] = {}  # layer index -> the residual stream entering it, [rows, hidden]
    fused = None
    if not wanted and all(seg.visible is None for seg in segments):  # causal rows, no features: maybe one call
        fused = ops.run_layers(x, [(seg.keys, seg.values, seg.start, seg.positions) for seg in segments])
    x = _layers(ops, x, segments, bounds, wanted, states) if fused is None else fused
    for i, seg in enumerate(segments):
        if seg.feature_layers:
            seg.features = concat_features(states, seg.feature_layers, bounds[i], bounds[i + 1])
        if seg.capture_final:
            seg.final_hidden = ops.norm(x[bounds[i] : bounds[i + 1]], w.final_norm)
    counts = [seg.num_rows for seg in segments]
    if sum(counts) == 0:
        return [torch.empty(0, w.vocab_size) for _ in segments]
    if len(segments) == 1:
        last = x[bounds[1] - counts[0] :]
    else:
        last = x[torch.cat([torch.arange(bounds[i + 1] - n, bounds[i + 1]) for i, n in enumerate(counts)])]
    normed = ops.norm(last, w.final_norm)
    logits = w.lm_head(normed)
    if w.head_token_ids is not None:
        full = torch.full((logits.shape[0], w.vocab_size), float("-inf"))
        full[:, w.head_token_ids] = logits  # tokens outside the kept set get probability 0
        logits = full
        ends = [sum(counts[: i + 1]) for i in range(len(counts))]
        for seg, end, n in zip(segments, ends, counts):
            if seg.head_rows is not None and n:
                seg.head_rows.logits(normed[end - n : end], logits[end - n : end])
    return list(logits.split(counts)) if len(segments) > 1 else [logits]


def _layers(
    ops: DecoderOps, x: Tensor, segments: list[Segment], bounds: list[int], wanted: set[int], states: dict[int, Tensor]
) -> Tensor:
    """Every decoder layer, one op at a time, over the embedded rows ``x``: the residual stream
    after the last layer; ``states`` gets the stream entering each layer in ``wanted``."""
    w = ops.weights
    arch = w.arch
    ropes = [ops.rope_rows(seg.positions) for seg in segments]  # once per pass
    trees = []  # per segment: window -> what ops.attend needs (None: causal)
    for seg in segments:
        windows = {0: None} if seg.visible is None else {0: ops.tree_slots(seg.visible)}
        if seg.visible is not None:
            for window in arch.windows:
                windows[window] = ops.tree_slots(seg.windowed(window))
        trees.append(windows)
    norm, add_norm, gated, rope_store, attend = ops.norm, ops.add_norm, ops.gated, ops.rope_store, ops.attend
    normed = norm(x, w.layers[0].input_norm)
    for index, layer in enumerate(w.layers):
        if index in wanted:
            states[index] = x  # a reference: x is rebound below, never written in place
        qkv = layer.qkv(normed)
        if layer.q_norm is not None:
            qkv = head_norms(ops, qkv, layer, w.num_heads, w.num_kv_heads, w.head_dim)
        window, local = arch.window(index), arch.uses_local_rope(index)
        parts = []
        for i, seg in enumerate(segments):
            keys, values = seg.keys[index], seg.values[index]  # [kv_heads, capacity, head_dim]
            q = rope_store(qkv[bounds[i] : bounds[i + 1]], ropes[i], keys, values, seg.start, local)
            tree = trees[i].get(window, trees[i][0])
            parts.append(attend(q, keys, values, seg.start, tree, window))
        attended = layer.o(parts[0] if len(parts) == 1 else torch.cat(parts))
        if layer.attn_post_norm is not None:
            attended = norm(attended, layer.attn_post_norm)
        x, normed = add_norm(x, attended, layer.post_norm)
        delta = layer.down(gated(layer.gate_up(normed)))
        if layer.ffn_post_norm is not None:
            delta = norm(delta, layer.ffn_post_norm)
        if index + 1 < len(w.layers):
            x, normed = add_norm(x, delta, w.layers[index + 1].input_norm)
        else:
            x = x + delta
    return x
