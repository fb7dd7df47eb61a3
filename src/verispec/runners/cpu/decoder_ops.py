"""The interface between the decoder pass and a runner's row-local ops: :class:`DecoderOps`.

Owns the contract, nothing else: which ops :mod:`verispec.runners.cpu.decoder` calls, with which
shapes and dtypes, and what each must guarantee (every row of every op depends on its own row
only). Two families implement it: :class:`verispec.runners.cpu.int8.Int8Ops` (torch) and
:class:`verispec.runners.cpu.gguf_runner.GGUFOps` (the compiled kernels). Knows nothing about
weights' formats, KV caches or drafting.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor


class DecoderOps(Protocol):
    """The row-local ops of one model's decoder pass over its ``weights``.

    Every tensor is float32 unless said otherwise; ``rows`` is the number of new rows of a pass (or
    of one sequence's part of it), ``hidden`` the model's width, ``heads`` / ``kv_heads`` /
    ``head_dim`` the attention's shape (``weights.num_heads`` ...). Each op computes row i from row
    i of its inputs only, in a fixed order: a k-row pass gives the bits k one-row passes give. An
    instance holds no per-sequence state, so every sequence over the same weights may share it.

    Attributes:
        weights: the model the ops run (:class:`verispec.runners.cpu.int8_weights.Int8Weights` or
            :class:`verispec.runners.cpu.gguf_weights.GGUFWeights`): ``embed``, ``layers``,
            ``final_norm``, ``lm_head``, ``arch``, ``head_token_ids``, ``context_head``, the
            attention's shape.
        runs_block_kernels: the ops run on the compiled kernels (a pass pins their ISA,
            :func:`verispec.runners.kernels.one_isa`).
    """

    weights: Any
    runs_block_kernels: bool

    def rope_rows(self, positions: Tensor) -> Any:
        """What :meth:`rope_store` needs for the RoPE positions ``positions`` ``[rows]`` int64,
        computed once per pass and sequence (an opaque value: table rows, or the positions)."""
        ...

    def tree_slots(self, visible: list[Tensor]) -> Any:
        """What :meth:`attend` needs for a tree pass, once per pass and window: ``visible`` holds,
        per row, the int64 cache slots it attends, in order (an opaque value)."""
        ...

    def rope_store(self, qkv: Tensor, rope: Any, keys: Tensor, values: Tensor, start: int, local: bool) -> Tensor:
        """RoPE on the q and k parts of ``qkv`` ``[rows, (heads + 2 kv_heads) * head_dim]`` at
        ``rope`` (from :meth:`rope_rows`; ``local``: the local layers' table); the rotated k and
        the v rows go to the layer's cache ``keys`` / ``values`` ``[kv_heads, capacity,
        head_dim]`` at slots ``start .. start + rows - 1``. Returns q ``[rows, heads, head_dim]``."""
        ...

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """RMSNorm of ``x`` ``[rows, width]`` with ``weight`` ``[width]``: ``[rows, width]``."""
        ...

    def add_norm(self, x: Tensor, delta: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """A residual step: ``(x + delta, norm(x + delta, weight))``, both ``[rows, hidden]``, the
        sum torch's add bit for bit. ``x`` is not written."""
        ...

    def gated(self, gate_up: Tensor) -> Tensor:
        """``act(gate) * up`` of ``gate_up`` ``[rows, 2 * ffn]`` (gate first): ``[rows, ffn]``, the
        activation SiLU or GELU-tanh as ``weights.arch.activation`` says."""
        ...

    def run_layers(self, x: Tensor, caches: list[tuple[Tensor, Tensor, int, Tensor]]) -> Tensor | None:
        """Every decoder layer over causal rows in one call, or None where these ops do not (the
        decoder then runs the layer ops one by one). ``x`` ``[rows, hidden]``: the embedded rows of
        each sequence in turn; ``caches``: per sequence ``(keys, values, start, positions)``, its
        caches ``[layers, kv_heads, capacity, head_dim]``, first new slot and RoPE positions
        ``[its rows]`` int64. Returns the residual stream after the last layer, the bits the ops
        one by one give."""
        ...

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, start: int, tree: Any, window: int) -> Tensor:
        """Grouped-query attention of ``q`` ``[rows, heads, head_dim]`` over one layer's cache
        ``keys`` / ``values`` ``[kv_heads, capacity, head_dim]`` holding slots ``0 .. start + rows
        - 1``: row i sees slots ``0 .. start + i`` (``tree`` None; with a sliding ``window`` > 0
        the last ``window`` of them) or its slots in ``tree`` (from :meth:`tree_slots`, windowed
        by the caller). Scores scaled by ``weights``' attention scale. Returns ``[rows, heads *
        head_dim]``; row i is what a one-row pass at its position returns."""
        ...
