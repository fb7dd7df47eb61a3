"""Self-speculation by early exit: the target's first L layers, its final norm and LM head draft.

Owns the construction of a shallow model that *shares* the target's modules (embedding, first L
decoder layers, rotary embedding, final norm, LM head): no weight is copied and neither the
target model nor its config is touched; the shallow model has its own config copy and its own
KV cache for its L layers. Drafting itself is :class:`DraftModelProposer` over that runner,
which keeps the cache consistent with the committed context by prefix rollback.
Knows nothing about verification.
"""

from __future__ import annotations

import copy

import torch

from verispec.errors import InvalidParameterError
from verispec.proposers.base import DrafterSources
from verispec.proposers.declared import AutoRole, Declaration, Kind, Needs
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners.torch_runner import TransformersRunner

DEFAULT_LAYER_SKIP_FRACTION = 4  # layer skip drafts with the first 1/4 of the target's layers
LAYER_SKIP_HINT = (
    "layer skip runs the first layers of the target's float model, which the gguf and llama.cpp "
    "runners (and int8 from a GGUF file) do not hold: use --runner torch"
)


def early_exit_model(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A causal LM running the first ``num_layers`` decoder layers of ``model``, sharing its weights.

    Works for transformers decoders laid out as ``model.model.{embed_tokens, layers, norm,
    rotary_emb}`` + ``model.lm_head`` (Llama, Qwen2, Mistral, ...). The result is built on the
    meta device from a *copy* of the config with ``num_hidden_layers = num_layers``, then its
    modules are replaced by the target's own module objects. (Self-speculative decoding:
    Zhang et al. 2024 "Draft & Verify"; LayerSkip, Elhoushi et al. 2024, §4 early-exit drafting.)

    Raises:
        InvalidParameterError: ``num_layers`` outside ``[1, num_hidden_layers]``, or a model
            whose layout is not the one above.
    """
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, p) for p in parts) or not hasattr(model, "lm_head"):
        raise InvalidParameterError(f"layer skip needs a model.model.{{{', '.join(parts)}}} + lm_head decoder")
    total = len(base.layers)
    if not 1 <= num_layers <= total:
        raise InvalidParameterError(f"layer-skip layers must be in [1, {total}], got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    with torch.device("meta"):
        shallow = type(model)(config)
    shallow.model.embed_tokens = base.embed_tokens
    shallow.model.layers = torch.nn.ModuleList(base.layers[:num_layers])
    shallow.model.norm = base.norm
    shallow.model.rotary_emb = base.rotary_emb
    shallow.lm_head = model.lm_head
    _check_shared(shallow, model)
    return shallow.eval()


def _check_shared(shallow: torch.nn.Module, model: torch.nn.Module) -> None:
    """Every tensor of ``shallow`` must be one of ``model``'s (nothing left on meta, nothing copied)."""
    owned = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    for name, tensor in list(shallow.named_parameters()) + list(shallow.named_buffers()):
        if id(tensor) not in owned:
            raise InvalidParameterError(f"layer skip: {name} is not shared with the target (unsupported layout)")


class LayerSkipProposer(DraftModelProposer):
    """Drafts with the target's first ``num_layers`` layers (an early-exit draft model).

    Args:
        model: the target's transformers model (shared, never modified).
        num_layers: decoder layers used for drafting, ``1 .. num_hidden_layers``.
        max_context_length: the target's context window.
    """

    declaration = Declaration(
        "layer-skip",
        Kind.MODEL,
        Needs.FLOAT_TARGET,
        LAYER_SKIP_HINT,
        auto=AutoRole.FALLBACK,
        priority=50,
        summary="the target's first quarter of layers; --runner torch",
    )

    @classmethod
    def build(cls, sources: DrafterSources) -> LayerSkipProposer | None:
        """:func:`layer_skip_drafter` over the target with the options' layer count."""
        return layer_skip_drafter(sources.target, sources.options.layer_skip_layers)

    def __init__(self, model: torch.nn.Module, num_layers: int, *, max_context_length: int | None = None) -> None:
        self.num_layers = num_layers
        super().__init__(TransformersRunner(early_exit_model(model, num_layers), max_context_length=max_context_length))


def layer_skip_drafter(target, num_layers: int | None) -> LayerSkipProposer | None:
    """The layer-skip drafter over ``target`` (a :class:`verispec.models.loading.LoadedModel`);
    None when disabled (0) or, by default (None: a quarter of the layers), when the target's
    layout does not support it. An explicit layer count on an unsupported model, or on a target
    the runner holds no float model of (gguf, llama.cpp, int8 from a GGUF file: ``target.model``
    is None), raises InvalidParameterError."""
    if num_layers == 0:
        return None
    if getattr(target.model, "config", None) is None:
        if num_layers is None:
            return None
        raise InvalidParameterError(
            f"layer skip (layer_skip_layers={num_layers}) " + LAYER_SKIP_HINT.removeprefix("layer skip ")
        )
    try:
        total = int(target.model.config.num_hidden_layers)
        layers = max(1, total // DEFAULT_LAYER_SKIP_FRACTION) if num_layers is None else num_layers
        return LayerSkipProposer(target.model, layers, max_context_length=target.context_length)
    except (InvalidParameterError, AttributeError, TypeError):
        if num_layers is None:
            return None
        raise
