"""The decoder pass of the int8 and gguf runners over one or several sequences' new rows.

Owns the order of a decoder layer as :class:`verispec.runners.cpu.gguf_arch.Architecture`
describes it: embedding (scaled or not), pre-norm, q/k/v (per-head q/k RMSNorm), RoPE and the KV
write, attention (causal, tree, sliding window), an optional norm of the attention output,
residual, norm, gated MLP (SwiGLU or GELU-tanh), an optional norm of the MLP output, residual; the
final norm and LM head. The row-local ops themselves (norms, RoPE, attention, activations) are the
runner's (:class:`verispec.runners.cpu.int8.Int8Runner` in torch,
:class:`verispec.runners.cpu.gguf_runner.GGUFRunner` in C++). Every op is row-local, so each
sequence's logits do not depend on the other rows of the pass. Knows nothing about drafting,
sampling or files.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.runners.features import concat_features
from verispec.runners.kernels import one_isa


@dataclass
class Segment:
    """One sequence's rows in a pass: tokens, RoPE positions ``[rows]``, tree slots or None."""

    runner: object  # an Int8Runner
    token_ids: list[int]
    positions: Tensor
    visible: list[Tensor] | None
    num_logits: int | None

    @property
    def num_rows(self) -> int:
        return len(self.token_ids) if self.num_logits is None else self.num_logits

    def windowed(self, start: int, window: int) -> list[Tensor]:
        """The tree rows' visible slots (``visible``) that lie inside a sliding ``window``: slots
        whose position is above the row's position - window (slot s < ``start`` holds position s;
        tree node j's slot ``start + j`` holds ``positions[j]``)."""
        slot_positions = torch.cat([torch.arange(start), self.positions])
        return [v[slot_positions[v] > int(self.positions[i]) - window] for i, v in enumerate(self.visible)]


def head_norms(ops, qkv: Tensor, layer, num_heads: int, num_kv_heads: int, head_dim: int) -> Tensor:
    """``qkv`` ``[rows, (heads + 2 kv_heads) * head_dim]`` with each q and k head RMS-normed by
    ``layer.q_norm`` / ``layer.k_norm`` ``[head_dim]`` (Qwen3, Gemma 3: before RoPE); v unchanged."""
    rows, q_width, k_width = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = ops._norm(qkv[:, :q_width].reshape(-1, head_dim), layer.q_norm).view(rows, q_width)
    k = ops._norm(qkv[:, q_width : q_width + k_width].reshape(-1, head_dim), layer.k_norm).view(rows, k_width)
    return torch.cat([q, k, qkv[:, q_width + k_width :]], dim=1)


def run_segments(segments: list[Segment]) -> list[Tensor]:
    """The decoder over every segment's new tokens (each at its cache's slots ``num_cached ..``):
    linear layers, norms and the LM head over all rows at once; RoPE, the cache write and
    attention per segment. Returns each segment's last ``num_rows`` logits rows ``[num_rows,
    vocab]`` float32, and sets each capturing runner's ``last_features`` to its own rows. On the
    compiled kernels, the pass runs on the ISA chosen as it starts (:func:`one_isa`)."""
    with one_isa() if segments and segments[0].runner.runs_block_kernels else contextlib.nullcontext():
        return _run_segments(segments)


def _run_segments(segments: list[Segment]) -> list[Tensor]:
    runners = [seg.runner for seg in segments]
    if len({id(r) for r in runners}) != len(runners):
        raise ValueError("a sequence appears twice in one pass")
    w = runners[0].weights
    arch = w.arch
    sizes = [len(seg.token_ids) for seg in segments]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    x = w.embed(torch.tensor([t for seg in segments for t in seg.token_ids], dtype=torch.long))  # [rows, hidden]
    if arch.embedding_scale != 1.0:
        x = x * arch.embedding_scale
    ropes = [r._rope_rows(seg.positions) for r, seg in zip(runners, segments)]  # once per pass
    trees = []  # per segment: window -> what _attend needs (None: causal)
    for r, seg in zip(runners, segments):
        windows = {0: None} if seg.visible is None else {0: r._tree_slots(seg.visible)}
        if seg.visible is not None:
            for window in arch.windows:
                windows[window] = r._tree_slots(seg.windowed(r._num_cached, window))
        trees.append(windows)
    wanted = {i for r in runners for i in r._feature_layers}
    states: dict[int, Tensor] = {}  # layer index -> the residual stream entering it, [rows, hidden]
    ops = runners[0]  # the runner class's row-local ops (norms, activations): the same for every segment
    normed = ops._norm(x, w.layers[0].input_norm)
    for index, layer in enumerate(w.layers):
        if index in wanted:
            states[index] = x  # a reference: x is rebound below, never written in place
        qkv = layer.qkv(normed)
        if layer.q_norm is not None:
            qkv = head_norms(ops, qkv, layer, w.num_heads, w.num_kv_heads, w.head_dim)
        window, local = arch.window(index), arch.uses_local_rope(index)
        parts = []
        for i, r in enumerate(runners):
            keys, values = r._keys[index], r._values[index]  # [kv_heads, capacity, head_dim]
            q = r._rope_store(qkv[bounds[i] : bounds[i + 1]], ropes[i], keys, values, r._num_cached, local)
            tree = trees[i].get(window, trees[i][0])
            parts.append(r._attend(q, keys, values, r._num_cached, tree, window))
        attended = layer.o(parts[0] if len(parts) == 1 else torch.cat(parts))
        if layer.attn_post_norm is not None:
            attended = ops._norm(attended, layer.attn_post_norm)
        x, normed = ops._add_norm(x, attended, layer.post_norm)
        delta = layer.down(ops._gated(layer.gate_up(normed)))
        if layer.ffn_post_norm is not None:
            delta = ops._norm(delta, layer.ffn_post_norm)
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
