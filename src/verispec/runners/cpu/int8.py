"""Fast batch-invariant CPU runner: int8 weights, a lean forward.

Owns the row-local ops of a forward pass written in torch for a decoder's int8 weights
(:class:`verispec.runners.cpu.int8_weights.Int8Weights`): RMSNorm, RoPE, grouped-query attention,
SwiGLU / GELU-tanh (:class:`Int8Ops`, a :class:`verispec.runners.cpu.decoder_ops.DecoderOps`), and
the int8 runner (:class:`Int8Runner`: a :class:`verispec.runners.cpu.runner.CPURunner` over them,
its KV cache, trees, batching, features and rollback there; the layer order is
:mod:`verispec.runners.cpu.decoder`'s). Every row of every op depends on its own token only: the
linear layers use per-row activation scales with exact int32 accumulation
(:mod:`verispec.runners.cpu.int8_ops`), norms and activations are row-wise, and attention runs one
query at a time over exactly the keys it sees, with the same shapes as a one-token decode step. So a
k-token verify pass gives bit-identical logits and KV entries to k one-token steps, and speculative
greedy output equals plain greedy output of this runner. Knows nothing about drafting or sampling.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

from verispec.runners.cpu.int8_weights import DEFAULT_MAX_CONTEXT, Int8Weights
from verispec.runners.cpu.runner import CPURunner


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
    """RoPE, half-split layout (Su et al. 2021): ``x`` ``[rows, heads, head_dim]``, ``cos``/``sin``
    ``[rows, rot]``: each head's first ``rot`` dimensions rotate, the others pass (partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention_scale(weights) -> float:
    """The factor of attention scores: ``query_pre_attn_scalar ** -0.5`` (Gemma), else ``head_dim ** -0.5``."""
    return (weights.arch.query_pre_attn_scalar or weights.head_dim) ** -0.5


class Int8Ops:
    """:class:`verispec.runners.cpu.decoder_ops.DecoderOps` in torch over ``weights`` (an
    :class:`Int8Weights`, or :class:`verispec.runners.cpu.gguf_weights.GGUFWeights` with int8
    layers): what :class:`Int8Runner` runs."""

    runs_block_kernels = False

    def __init__(self, weights: Int8Weights) -> None:
        self.weights = weights

    def run_layers(self, x: Tensor, caches: list) -> None:
        """None: torch runs the layer ops one by one (the decoder's loop)."""
        return None

    def rope_rows(self, positions: Tensor):
        """What :meth:`rope_store` needs for ``positions`` ``[rows]``, computed once per pass:
        here the ``cos``, ``sin`` rows ``[rows, rot]`` of the global table and of the local one."""
        w = self.weights
        local = None if w.local_cos is None else (w.local_cos[positions], w.local_sin[positions])
        return (w.cos[positions], w.sin[positions]), local

    def tree_slots(self, visible: list[Tensor]):
        """What :meth:`attend` needs for a tree pass, once per pass: here the per-row slot lists."""
        return visible

    def rope_store(self, qkv: Tensor, rope, keys: Tensor, values: Tensor, start: int, local: bool = False) -> Tensor:
        """RoPE on the q and k parts of ``qkv`` ``[rows, (heads + 2 kv_heads) * head_dim]`` with
        ``rope`` from :meth:`rope_rows` (``local``: the local layers' table); k and v go to cache
        slots ``start ..``; returns q ``[rows, heads, head_dim]``."""
        w = self.weights
        rows, q_width, kv_width = qkv.shape[0], w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
        cos, sin = rope[1] if local else rope[0]
        qk = rotate(qkv[:, : q_width + kv_width].view(rows, w.num_heads + w.num_kv_heads, w.head_dim), cos, sin)
        v = qkv[:, q_width + kv_width :].view(rows, w.num_kv_heads, w.head_dim)
        keys[:, start : start + rows] = qk[:, w.num_heads :].transpose(0, 1)
        values[:, start : start + rows] = v.transpose(0, 1)
        return qk[:, : w.num_heads]

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """Row-local RMSNorm of ``x`` ``[rows, hidden]`` float32 with ``weight`` ``[hidden]``."""
        return rms_norm(x, weight, self.weights.rms_norm_eps)

    def add_norm(self, x: Tensor, delta: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """A residual step: ``(x + delta, self.norm(x + delta, weight))``, both ``[rows, hidden]``."""
        x = x + delta
        return x, self.norm(x, weight)

    def gated(self, gate_up: Tensor) -> Tensor:
        """``act(gate) * up`` of ``gate_up`` ``[rows, 2 * ffn]`` (Shazeer 2020), row-local: SiLU
        (SwiGLU) or GELU-tanh (GeGLU) as the architecture says."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.weights.arch.activation == "gelu_tanh":
            return torch.nn.functional.gelu(gate, approximate="tanh") * up
        return torch.nn.functional.silu(gate) * up

    def attend(
        self, q: Tensor, keys: Tensor, values: Tensor, start: int, visible: list[Tensor] | None = None, window: int = 0
    ) -> Tensor:
        """GQA attention, one query at a time over exactly its visible keys.

        ``q`` ``[rows, heads, head_dim]``; ``keys``/``values`` ``[kv_heads, capacity, head_dim]``
        holding slots ``0 .. start + rows - 1``. Row i sees slots ``0 .. start + i`` (causal; with a
        sliding ``window``, the last ``window`` of them) or ``visible[i]`` (tree, windowed by the
        caller). Scores are scaled by :func:`attention_scale`. Returns ``[rows, heads * head_dim]``.
        Query i runs the same op with the same shapes as a one-token step at its position would,
        which is what makes verify passes batch-invariant. Runs on one thread: these ops are
        small, and a parallel region per op costs more than it saves (far more on a busy CPU).
        """
        w = self.weights
        out = torch.empty(q.shape[0], w.num_heads * w.head_dim)
        keys, values = keys[None], values[None]  # [1, kv_heads, capacity, head_dim]
        with single_thread():
            for i in range(q.shape[0]):
                if visible is None:
                    first = max(0, start + i + 1 - window) if window else 0
                    seen_keys, seen_values = keys[:, :, first : start + i + 1], values[:, :, first : start + i + 1]
                else:
                    seen_keys, seen_values = keys[:, :, visible[i]], values[:, :, visible[i]]
                attended = torch.nn.functional.scaled_dot_product_attention(
                    q[i, :, None, :][None], seen_keys, seen_values, scale=attention_scale(w), enable_gqa=True
                )  # [1, heads, 1, head_dim]
                out[i] = attended.view(-1)
        return out


class Int8Runner(CPURunner):
    """:class:`verispec.runners.Runner` over :class:`Int8Weights` with a static KV cache: a
    :class:`CPURunner` over :class:`Int8Ops`.

    Args:
        weights: the quantized model.
        max_context_length: KV cache capacity in tokens (at most the RoPE table's length).
    """

    def __init__(self, weights: Int8Weights, *, max_context_length: int | None = None) -> None:
        super().__init__(Int8Ops(weights), max_context_length=max_context_length)

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
