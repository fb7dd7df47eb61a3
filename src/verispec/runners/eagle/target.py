"""What an EAGLE head borrows from its target and knows it by (:class:`HeadTarget`): the token
embedding, the shapes, and the digest of the final norm that tells two targets of the same shapes
apart. Reads a transformers model or an int8 / gguf runner; knows nothing about the head's layers
(:mod:`verispec.runners.eagle.head`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from verispec.errors import InvalidParameterError
from verispec.runners import Runner


def norm_digest(final_norm: Tensor) -> str:
    """sha256 of the target's final RMSNorm weight as float32 bytes: what tells two targets of the
    same shapes apart (a base model and its instruct fine-tune, two fine-tunes) whatever runner
    holds them (GGUF keeps norms in float32; a bf16 checkpoint converts to the same float32 bits)."""
    return hashlib.sha256(final_norm.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


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
    output_rows: Callable[[Tensor], Tensor] | None = (
        None  # int64 [n] -> float32 [n, hidden] LM-head rows; None: not lent
    )

    def check_head(self, shape, state: dict[str, Tensor], path) -> dict[str, Tensor]:
        """``state`` of the head file ``path`` (shape ``shape``: a ``HeadShape``) ready to load on
        this target: with ``lm_head.weight`` lent by the target where the head shares its LM head.

        Raises:
            InvalidParameterError: the head was trained for a target of another architecture,
                hidden size, vocabulary or depth, or for another target of the same shapes (its
                :func:`norm_digest` differs), or it shares an LM head this target does not lend.
        """
        mismatched = [
            f"{name} {mine} != {theirs}"
            for name, mine, theirs in (
                ("hidden_size", shape.hidden_size, self.hidden_size),
                ("vocab_size", shape.vocab_size, self.vocab_size),
                ("num_target_layers", shape.num_target_layers, self.num_layers),
                ("target_model_type", shape.target_model_type, self.model_type or shape.target_model_type),
            )
            if mine != theirs
        ]
        if mismatched:
            raise InvalidParameterError(f"the EAGLE head {path} belongs to another target ({'; '.join(mismatched)})")
        if shape.target_norm_sha256 and self.norm_sha256 and shape.target_norm_sha256 != self.norm_sha256:
            raise InvalidParameterError(
                f"the EAGLE head {path} was trained for another target of the same shapes (its final norm weights "
                f"differ: another fine-tune or model); train one for this target (verispec train-head)"
            )
        if shape.lm_head_from_target:
            if self.output_rows is None:
                raise InvalidParameterError(
                    f"the EAGLE head {path} borrows the target's LM-head rows, which this runner does not lend "
                    "(use the gguf or torch runner)"
                )
            return {**state, "lm_head.weight": self.output_rows(torch.as_tensor(state["d2t"]).long()).float()}
        return state

    @classmethod
    def of(cls, target: object) -> HeadTarget:
        """The facts of a transformers causal LM, a :class:`~verispec.runners.torch_runner.TransformersRunner`
        (its ``model``) or an int8 / gguf runner (its ``weights``: the embedding as the runner
        stores it, de-quantized per lookup).

        Raises:
            InvalidParameterError: ``target`` hands out no token embedding.
        """
        model = target if isinstance(target, nn.Module) else target.model if isinstance(target, Runner) else None
        if isinstance(model, nn.Module) and hasattr(model, "get_input_embeddings"):
            config, embedding = model.config, model.get_input_embeddings()
            norm = final_norm(model)
            output = model.get_output_embeddings()
            rows = None if output is None else (lambda ids: output.weight.detach()[ids].float())
            return cls(
                embedding,
                int(config.hidden_size),
                int(embedding.weight.shape[0]),
                int(config.num_hidden_layers),
                getattr(config, "model_type", None),
                None if norm is None else norm_digest(norm),
                rows,
            )
        weights = target.weights if isinstance(target, Runner) else None
        if weights is not None:
            width = int(weights.embed(torch.zeros(1, dtype=torch.long)).shape[-1])
            norm = getattr(weights, "final_norm", None)
            return cls(
                weights.embed,
                width,
                int(weights.vocab_size),
                len(weights.layers),
                None,
                None if norm is None else norm_digest(norm),
                getattr(weights, "output_rows", None),
            )
        raise InvalidParameterError(
            f"an EAGLE head cannot borrow the token embedding of a {type(target).__name__}: "
            "use the gguf, int8 or torch runner"
        )
