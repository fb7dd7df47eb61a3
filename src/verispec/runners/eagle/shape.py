"""The dimensions of an EAGLE-3 head (:class:`HeadShape`), copied from its target's config and
stored in the head's file. Knows nothing about the head's weights or arithmetic
(:mod:`verispec.runners.eagle.head`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError
from verispec.models.architectures import EAGLE_MODEL_TYPES

SUPPORTED_MODEL_TYPES = EAGLE_MODEL_TYPES  # the one table's rows heads support: decoder-only, RMSNorm, SwiGLU


@dataclass(frozen=True)
class HeadShape:
    """The head's dimensions, copied from the target's config (all ints but ``rope_theta`` and
    ``rms_norm_eps``); ``vocab_size`` and ``num_target_layers`` are the target's."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    num_target_layers: int
    feature_layers: tuple[int, ...]
    draft_vocab_size: int
    target_model_type: str
    target_norm_sha256: str = ""  # norm_digest of the target (heads written before it: "", not compared)
    lm_head_from_target: bool = False  # lm_head = the target's rows of d2t, frozen, not stored in the file
    rope_scaling: str = ""  # JSON of a published head's RoPE scaling (rope_inv_freq: linear, llama3); "" none
    norm_before_residual: bool = False  # vLLM's flag: the residual is hidden_norm(hidden), not hidden

    @staticmethod
    def from_fields(stored: Mapping[str, object]) -> HeadShape:
        """The shape from a head file's stored fields (GGUF keeps bools as ints, lists for
        tuples); fields a file written before them lacks take their defaults. Raises TypeError
        or KeyError for a field set that is not a shape's."""
        kinds = {f.name: f.type for f in fields(HeadShape)}
        values = {k: v for k, v in stored.items() if k != "architecture"}
        for name, value in values.items():
            if kinds[name] == "bool":
                values[name] = bool(value)
        return HeadShape(**{**values, "feature_layers": tuple(int(i) for i in values["feature_layers"])})

    @staticmethod
    def of_target(config, feature_layers: Sequence[int], draft_vocab_size: int) -> HeadShape:
        """The shape for a transformers ``config``. Raises InvalidParameterError for an
        architecture other than :data:`SUPPORTED_MODEL_TYPES`, a non-SiLU MLP or bad layers."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES or getattr(config, "hidden_act", "silu") != "silu":
            supported = ", ".join(SUPPORTED_MODEL_TYPES)
            raise InvalidParameterError(f"EAGLE heads support {supported} targets with a SiLU MLP, not {model_type!r}")
        num_layers = int(config.num_hidden_layers)
        layers = tuple(int(i) for i in feature_layers)
        if not layers or any(not 0 <= i < num_layers for i in layers):
            raise InvalidParameterError(
                f"feature layers {layers} must be hidden-state indices in [0, {num_layers - 1}]"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        heads = int(config.num_attention_heads)
        return HeadShape(
            hidden_size=int(config.hidden_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate_size=int(config.intermediate_size),
            rope_theta=float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            vocab_size=int(config.vocab_size),
            num_target_layers=num_layers,
            feature_layers=layers,
            draft_vocab_size=int(draft_vocab_size),
            target_model_type=str(model_type),
        )


ROPE_SCALINGS = ("linear", "llama3")  # what rope_inv_freq computes; the published heads' others are refused


def rope_inv_freq(shape: HeadShape) -> Tensor:
    """float32 ``[head_dim // 2]`` rotary frequencies of the head's attention: ``rope_theta ** (-2i /
    head_dim)`` (Su et al. 2021, RoFormer §3.4.2), scaled as ``shape.rope_scaling`` says, the way
    transformers' ``modeling_rope_utils`` (and vLLM's ``get_rope``) scale them: ``linear`` divides
    every frequency by ``factor`` (positions / factor); ``llama3`` (Llama 3.1) divides the low
    frequencies (wavelength above ``original_max_position_embeddings / low_freq_factor``) by
    ``factor``, keeps the high ones (below ``... / high_freq_factor``) and blends in between.

    Raises:
        InvalidParameterError: a scaling type other than :data:`ROPE_SCALINGS`.
    """
    dim = shape.head_dim
    inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = json.loads(shape.rope_scaling) if shape.rope_scaling else {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        context = float(scaling["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= context / high) & (wavelength <= context / low)
        inv_freq = torch.where(medium, blended, scaled)
    elif kind != "default":
        raise InvalidParameterError(
            f"RoPE scaling {kind!r} is not supported for EAGLE heads (supported: {', '.join(ROPE_SCALINGS)})"
        )
    return inv_freq.float()
