"""The batch-invariant 4-bit CPU runner: a GGUF file's own quantized blocks, read straight from disk.

Owns the gguf runner's forward ops on the compiled kernels (:class:`GGUFOps`, a
:class:`verispec.runners.cpu.decoder_ops.DecoderOps`): RoPE and the KV store in one C++ call,
RMSNorm (fused with the residual add), SwiGLU or GELU-tanh, and attention one (row, head) at a time
over the KV cache (or its sliding window) or a tree's slots. The weights (the file's blocks repacked
into the kernels' tiles) are :mod:`verispec.runners.cpu.gguf_weights`'; the layer order is
:mod:`verispec.runners.cpu.decoder`'s; the KV cache, tree verification and rollback are
:class:`verispec.runners.cpu.runner.CPURunner`'s: every op is row-local and the block products
(:mod:`verispec.runners.kernels`) accumulate in one fixed order, so a k-token verify pass gives
bit-identical logits to k one-token steps. Knows nothing about drafting or sampling.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from verispec.models.gguf_file import read_gguf_header
from verispec.runners.cpu.gguf_blocks import GGUFLinear, loaded_kernels
from verispec.runners.cpu.gguf_weights import GGUFWeights
from verispec.runners.cpu.int8 import attention_scale
from verispec.runners.cpu.int8_weights import DEFAULT_MAX_CONTEXT
from verispec.runners.cpu.runner import CPURunner
from verispec.runners.kernels import kernel_isa_number, set_kernel_isa


def set_kernel_implementation(name: str) -> None:
    """Force the kernels' instruction set (``"auto"``, ``"portable"``, ``"avx2"``, ``"avxvnni"``,
    ``"avx512"``, ``"neon"``): every path gives the same bits; tests use this to check it. Raises
    InvalidParameterError for an unknown name or one this CPU cannot run."""
    set_kernel_isa(None if name == "auto" else name)


class GGUFOps:
    """:class:`verispec.runners.cpu.decoder_ops.DecoderOps` on the compiled kernels over
    ``weights`` (GGUF-block layers): what :class:`GGUFRunner` runs. Same contracts, same
    row-local arithmetic as :class:`verispec.runners.cpu.int8.Int8Ops`, their own bits."""

    runs_block_kernels = True
    fuses_layers = True  # run_layers in one C++ call where the architecture allows (tests compare both ways)

    def __init__(self, weights: GGUFWeights) -> None:
        self.weights = weights
        self._stack = None  # the layers as one C++ LayerStack, built at the first pass (None: not fusable)
        self._stack_checked = False  # fusable() asked once, not at every pass

    def run_layers(self, x: Tensor, caches: list[tuple[Tensor, Tensor, int, Tensor]]) -> Tensor | None:
        """The C++ ``LayerStack``: the same kernel calls as the decoder's loop, without the Python
        between them; None where an architecture needs more than it does (sliding windows, local
        RoPE, q/k norms, post norms) or :attr:`fuses_layers` is off."""
        if not self.fuses_layers:
            return None
        if not self._stack_checked:
            self._stack = layer_stack(self.weights) if fusable(self.weights) else None
            self._stack_checked = True
        if self._stack is None:
            return None
        keys, values, starts, positions = (list(column) for column in zip(*caches))
        counts = [len(p) for p in positions]
        return self._stack.run(x, keys, values, starts, counts, positions, kernel_isa_number())

    def rope_rows(self, positions: Tensor) -> Tensor:
        return positions  # the C++ op reads the full tables at these positions

    def tree_slots(self, visible: list[Tensor]) -> tuple[Tensor, Tensor]:
        """``slots`` ``[rows, width]`` int64 (row i's first ``lengths[i]`` entries) and ``lengths`` ``[rows]``."""
        lengths = torch.tensor([len(v) for v in visible], dtype=torch.int64)
        slots = torch.zeros(len(visible), int(lengths.max()), dtype=torch.int64)
        for i, v in enumerate(visible):
            slots[i, : len(v)] = v
        return slots, lengths

    def rope_store(
        self, qkv: Tensor, rope: Tensor, keys: Tensor, values: Tensor, start: int, local: bool = False
    ) -> Tensor:
        """:meth:`Int8Ops.rope_store` in one C++ call (same formula, same row-local arithmetic)."""
        w = self.weights
        cos, sin = (w.local_cos, w.local_sin) if local else (w.cos, w.sin)
        return loaded_kernels().rope_store(qkv, rope, cos, sin, keys, values, start, w.num_heads)

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """The C++ RMSNorm: 16 partial sums of squares in a fixed order (not torch's), row-local."""
        return loaded_kernels().rms_norm(x, weight, self.weights.rms_norm_eps)

    def add_norm(self, x: Tensor, delta: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """``(x + delta, self.norm(x + delta, weight))`` in one C++ call (the sum is torch's add bit for bit)."""
        total, normed = loaded_kernels().add_rms_norm(x, delta, weight, self.weights.rms_norm_eps)
        return total, normed

    def gated(self, gate_up: Tensor) -> Tensor:
        """The C++ ``silu(gate) * up`` or ``gelu_tanh(gate) * up`` (exp_clamped, the same bits on every ISA)."""
        if self.weights.arch.activation == "gelu_tanh":
            return loaded_kernels().gelu_mul(gate_up, kernel_isa_number())
        return loaded_kernels().silu_mul(gate_up, kernel_isa_number())

    def attend(
        self,
        q: Tensor,
        keys: Tensor,
        values: Tensor,
        start: int,
        tree: tuple[Tensor, Tensor] | None = None,
        window: int = 0,
    ) -> Tensor:
        """The C++ kernel's attention: same contract as :meth:`Int8Ops.attend` (row i over
        slots ``0 .. start + i``, the last ``window`` of them, or its tree slots from
        :meth:`tree_slots`, in order), parallel over (row, head)."""
        slots, lengths = (_EMPTY, _EMPTY) if tree is None else tree
        scale = attention_scale(self.weights)
        return loaded_kernels().attention(q, keys, values, start, slots, lengths, scale, kernel_isa_number(), window)


def fusable(weights: GGUFWeights) -> bool:
    """The decoder's layers are what ``LayerStack`` runs: pre-norm causal attention with global
    RoPE, SwiGLU or GELU-tanh, every matrix in GGUF blocks."""
    arch = weights.arch
    return (
        not arch.windows
        and not any(arch.uses_local_rope(i) for i in range(len(weights.layers)))
        and all(
            layer.q_norm is None
            and layer.attn_post_norm is None
            and layer.ffn_post_norm is None
            and all(isinstance(m, GGUFLinear) for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
            for layer in weights.layers
        )
    )


def layer_stack(weights: GGUFWeights):
    """The kernels' ``LayerStack`` over ``weights``' layers (their tensors shared, not copied)."""
    kernels = loaded_kernels()

    def packed(linear: GGUFLinear):
        return kernels.PackedLinear(
            [p for p, _, _ in linear.parts],
            [q for _, q, _ in linear.parts],
            [r for _, _, r in linear.parts],
            linear.bias,
        )

    w = weights
    stack = kernels.LayerStack(
        w.num_heads, w.rms_norm_eps, attention_scale(w), w.arch.activation == "gelu_tanh", w.cos, w.sin
    )
    for layer in w.layers:
        stack.add_layer(
            packed(layer.qkv),
            packed(layer.o),
            packed(layer.gate_up),
            packed(layer.down),
            layer.input_norm,
            layer.post_norm,
        )
    return stack


class GGUFRunner(CPURunner):
    """:class:`verispec.runners.Runner` over a GGUF file's own blocks (``--runner gguf``): a
    :class:`CPURunner` over :class:`GGUFOps`.

    Args:
        weights: from :meth:`GGUFWeights.from_file` (shared by runners with their own caches).
        max_context_length: KV capacity in tokens (at most the RoPE table's length).
    """

    def __init__(self, weights: GGUFWeights, *, max_context_length: int | None = None) -> None:
        super().__init__(GGUFOps(weights), max_context_length=max_context_length)

    @classmethod
    def from_file(
        cls,
        path: Path,
        *,
        context_length: int | None = None,
        max_context_length: int | None = None,
        head_token_ids: Tensor | None = None,
        context_rows: bool = False,
        requantize: str | None = None,
        cache_dir: Path | None = None,
    ) -> GGUFRunner:
        """Load ``path``; capacity defaults to min(the model's context length, 4096); ``head_token_ids``,
        ``context_rows``, ``requantize``, ``cache_dir``: see :meth:`GGUFWeights.from_file`."""
        if max_context_length is None:
            header_length = context_length or int(
                read_gguf_header(Path(path)).arch_value("context_length", DEFAULT_MAX_CONTEXT)
            )
            max_context_length = min(header_length, DEFAULT_MAX_CONTEXT)
        weights = GGUFWeights.from_file(
            Path(path),
            int(max_context_length),
            head_token_ids=head_token_ids,
            context_rows=context_rows,
            requantize=requantize,
            cache_dir=cache_dir,
        )
        return cls(weights, max_context_length=int(max_context_length))


_EMPTY = torch.empty(0, dtype=torch.int64)
