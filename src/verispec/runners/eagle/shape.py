"""The dimensions of an EAGLE-3 head (:class:`HeadShape`), copied from its target's config and
stored in the head's file. Knows nothing about the head's weights or arithmetic
(:mod:`verispec.runners.eagle.head`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verispec.errors import InvalidParameterError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # decoder-only, RMSNorm, SwiGLU


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
