"""What a decoder's GGUF header declares about its structure, read once: :class:`Architecture`.

Owns turning a GGUF header (metadata and tensor names, no tensor data) into one frozen description
of the decoder the gguf and int8 runners run: q/k norms, biases, norm placement, activation,
embedding scale, RoPE (base, scaling, partial rotary dims, a base of its own for local layers),
sliding windows per layer, attention scale; and refusing, before anything is loaded, a header that
declares something the forward pass does not implement (one line naming it). The family facts a
header does not carry (Gemma 3's GELU, its scaled embedding and its local/global layer pattern)
are rows of the one table of architectures (:data:`verispec.models.architectures.ARCHITECTURES`), as
llama.cpp's ``llama-model.cpp`` sets them. Knows
nothing about tensors' contents or the forward pass (:mod:`verispec.runners.cpu.decoder`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from verispec.errors import InvalidParameterError
from verispec.models.architectures import ARCHITECTURES, GGUF_ARCHITECTURES, Family
from verispec.models.gguf_file import GGUFHeader

FAMILIES = {name: f for name, f in ARCHITECTURES.items() if f.gguf}  # the rows of the one table the gguf runner reads
SUPPORTED_ARCHITECTURES = GGUF_ARCHITECTURES
ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclass(frozen=True)
class RoPE:
    """Rotary embedding (Su et al. 2021, half-split layout): ``dims`` rotated dimensions of each head
    (partial rotary when below head_dim), ``base``; ``scaling`` ``"linear"`` divides positions by
    ``factor``; ``freq_factors``: the file's ``rope_freqs.weight`` divides each frequency (llama3
    scaling as llama.cpp applies it); ``local_base``: local (sliding-window) layers' own base, never
    scaled (Gemma 3)."""

    dims: int
    base: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    freq_factors: bool = False
    local_base: float | None = None


@dataclass(frozen=True)
class Architecture:
    """One decoder's structure as the forward pass reads it.

    ``layer_windows``: per layer, the sliding window in positions (a row at position p sees keys at
    positions above p - window; 0: every earlier position). ``local_rope``: per layer, whether it
    uses :attr:`RoPE.local_base`'s table. ``query_pre_attn_scalar``: attention scores are scaled by
    its ``-0.5`` power (None: head_dim's).
    """

    name: str = "llama"
    rope: RoPE | None = None  # None: the module's own tables (the int8 runner from transformers)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    qkv_bias: bool = False
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add (Gemma 3)
    activation: str = "swiglu"
    embedding_scale: float = 1.0
    layer_windows: tuple[int, ...] = ()
    local_rope: tuple[bool, ...] = ()
    query_pre_attn_scalar: float | None = None
    tied_output: bool = False
    fused_qkv: bool = False  # one attn_qkv matrix (Phi-3)
    fused_gate_up: bool = False  # ffn_up holds gate and up (Phi-3)
    permuted_qk: bool = False

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def uses_local_rope(self, layer: int) -> bool:
        return bool(self.local_rope) and self.local_rope[layer]

    @property
    def windows(self) -> set[int]:
        """The distinct non-zero windows of the layers."""
        return {w for w in self.layer_windows if w}


def read_architecture(header: GGUFHeader) -> Architecture:
    """The :class:`Architecture` ``header`` declares.

    Raises:
        InvalidParameterError: one line naming what the header declares that the gguf and int8
            runners (one forward) do not implement (another architecture, a mixture of experts,
            YaRN or LongRoPE scaling, logit soft-capping, keys and values of different widths,
            partial rotary on permuted q/k rows).
    """
    name = header.architecture
    family = FAMILIES.get(name)
    if family is None:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise InvalidParameterError(
            f"the gguf and int8 runners support {supported} models, not {name!r}: use --runner llamacpp or torch"
        )
    tensors = header.tensors

    def refuse(what: str) -> None:
        raise InvalidParameterError(
            f"the gguf and int8 runners do not implement {what} ({name}): use --runner llamacpp"
        )  # both run the one forward (decoder.py)

    if int(header.arch_value("expert_count", 0) or 0) > 0:
        refuse("mixture-of-experts layers")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if float(header.arch_value(key, 0.0) or 0.0) != 0.0:
            refuse(f"logit soft-capping ({name}.{key})")
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        refuse("LongRoPE factors (rope_factors_long/short)")
    hidden = int(header.arch_value("embedding_length"))
    heads = int(header.arch_value("attention.head_count"))
    num_layers = int(header.arch_value("block_count"))
    head_dim = int(header.arch_value("attention.key_length", hidden // heads))
    if int(header.arch_value("attention.value_length", head_dim)) != head_dim:
        refuse("values of another width than keys")
    windows, local = _layer_windows(header, family, num_layers)
    scalar = None
    if name == "gemma3":  # llama.cpp: 1 / sqrt(head_dim), but hidden / heads for the 62-layer 27B
        scalar = float(hidden // heads) if num_layers == 62 else float(head_dim)
    return Architecture(
        name=name,
        rope=_rope(header, family, head_dim, bool(local), refuse),
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        post_norms="blk.0.post_attention_norm.weight" in tensors,
        activation=family.activation,
        embedding_scale=float(math.sqrt(hidden)) if family.scaled_embedding else 1.0,
        layer_windows=windows,
        local_rope=local,
        query_pre_attn_scalar=scalar,
        tied_output="output.weight" not in tensors,
        fused_qkv="blk.0.attn_qkv.weight" in tensors,
        fused_gate_up="blk.0.ffn_gate.weight" not in tensors,
        permuted_qk=family.permuted_qk,
    )


def _layer_windows(header: GGUFHeader, family: Family, num_layers: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Per layer, the sliding window (``()``: none anywhere) and whether it is a local layer (its
    own RoPE base; ``()``: none is)."""
    window = int(header.arch_value("attention.sliding_window", 0) or 0)
    windows = tuple(window for _ in range(num_layers)) if window > 0 else ()
    local = ()
    if windows and family.global_every:
        windows = tuple(0 if (i + 1) % family.global_every == 0 else window for i in range(num_layers))
        local = tuple(w > 0 for w in windows)
    return windows, local


def _rope(header: GGUFHeader, family: Family, head_dim: int, has_local: bool, refuse: Callable[[str], None]) -> RoPE:
    """The :class:`RoPE` ``header`` declares (``has_local``: some layers are local); ``refuse``
    what the forward does not implement."""
    tensors = header.tensors
    dims = int(header.arch_value("rope.dimension_count", head_dim))
    if dims > head_dim or dims % 2:
        refuse(f"{dims} rotary dimensions with head_dim {head_dim}")
    if dims != head_dim and family.permuted_qk:
        refuse("partial rotary embeddings on llama.cpp-permuted q/k rows")
    scaling = str(header.arch_value("rope.scaling.type", "none") or "none")
    if scaling not in ROPE_SCALINGS:
        refuse(f"RoPE scaling {scaling!r}")
    freq_factors = "rope_freqs.weight" in tensors
    if scaling == "llama3" and not freq_factors:
        refuse("llama3 RoPE scaling without its rope_freqs tensor")
    factor = float(header.arch_value("rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
    local_base = header.arch_value("rope.freq_base_swa", family.local_rope_base) if has_local else None
    return RoPE(
        dims=dims,
        base=float(header.arch_value("rope.freq_base", 10000.0)),
        scaling=scaling,
        factor=factor,
        freq_factors=freq_factors,
        local_base=None if local_base is None else float(local_base),
    )
