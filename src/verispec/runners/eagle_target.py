"""What an EAGLE head borrows from its target and knows it by (:class:`HeadTarget`): the token
embedding, the shapes, and the digest of the final norm that tells two targets of the same shapes
apart. Reads a transformers model or an int8 / gguf runner; knows nothing about the head's layers
(:mod:`verispec.runners.eagle_head`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from verispec.errors import InvalidParameterError


def norm_digest(final_norm: Tensor) -> str:
    """sha256 of the target's final RMSNorm weight as float32 bytes: what tells two targets of the
    same shapes apart (a base model and its instruct fine-tune, two fine-tunes) whatever runner
    holds them (GGUF keeps norms in float32; a bf16 checkpoint converts to the same float32 bits)."""
    return hashlib.sha256(final_norm.detach().float().contiguous().numpy().tobytes()).hexdigest()


def final_norm(model: nn.Module) -> Tensor | None:
    """The final norm weight of a transformers causal LM (``model.model.norm``), else None."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    return getattr(norm, "weight", None)


@dataclass(frozen=True)
class HeadTarget:
    """What a head borrows from its target and is checked against when it loads.

    ``embed_tokens``: the target's token embedding, int64 ``[n]`` -> float ``[n, hidden_size]``;
    ``model_type``: None where the runner does not know it (then not compared).
    """

    embed_tokens: Callable[[Tensor], Tensor]
    hidden_size: int
    vocab_size: int
    num_layers: int
    model_type: str | None
    norm_sha256: str | None = None  # norm_digest; None where the target does not show its final norm
    output_rows: Callable[[Tensor], Tensor] | None = None  # int64 [n] -> float32 [n, hidden] LM-head rows; None: not lent

    @classmethod
    def of(cls, target: object) -> HeadTarget:
        """The facts of a transformers causal LM, a :class:`~verispec.runners.torch_runner.TransformersRunner`
        (its ``model``) or an int8 / gguf runner (its ``weights``: the embedding as the runner
        stores it, de-quantized per lookup).

        Raises:
            InvalidParameterError: ``target`` hands out no token embedding.
        """
        model = target if isinstance(target, nn.Module) else getattr(target, "model", None)
        if model is not None and hasattr(model, "get_input_embeddings"):
            config, embedding = model.config, model.get_input_embeddings()
            norm = final_norm(model)
            output = model.get_output_embeddings()
            rows = None if output is None else (lambda ids: output.weight.detach()[ids].float())
            return cls(embedding, int(config.hidden_size), int(embedding.weight.shape[0]), int(config.num_hidden_layers),
                       getattr(config, "model_type", None), None if norm is None else norm_digest(norm), rows)
        weights = getattr(target, "weights", None)
        if weights is not None and hasattr(weights, "embed"):
            width = int(weights.embed(torch.zeros(1, dtype=torch.long)).shape[-1])
            norm = getattr(weights, "final_norm", None)
            return cls(weights.embed, width, int(weights.vocab_size), len(weights.layers), None,
                       None if norm is None else norm_digest(norm), getattr(weights, "output_rows", None))
        raise InvalidParameterError(
            f"an EAGLE head cannot borrow the token embedding of a {type(target).__name__}: use the gguf, int8 or torch runner"
        )
