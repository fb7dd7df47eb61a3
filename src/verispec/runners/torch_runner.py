"""Runner over a transformers ``AutoModelForCausalLM`` (any architecture it loads, GGUF too).

Owns the model's ``DynamicCache`` for one sequence. Rollback crops the cache by the number of
discarded positions; the prefix is never recomputed. Knows nothing about drafting or sampling.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from transformers import DynamicCache


class TransformersRunner:
    """:class:`verispec.runners.Runner` over a transformers causal LM.

    Args:
        model: a transformers causal LM in eval mode (weights on one device).
        max_context_length: overrides the config's ``max_position_embeddings``.
    """

    def __init__(self, model: torch.nn.Module, *, max_context_length: int | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context_length = int(max_context_length or getattr(config, "max_position_embeddings", 2048))
        self._cache = DynamicCache(config=config)
        self._num_cached = 0

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], num_logits: int | None = None) -> Tensor:
        num_new = len(token_ids)
        if num_new == 0:
            raise ValueError("forward needs at least one token")
        if self._num_cached + num_new > self.max_context_length:
            raise ValueError(
                f"{self._num_cached + num_new} positions exceed the context length {self.max_context_length}"
            )
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(self._num_cached, self._num_cached + num_new, device=self.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions[None, :],
            cache_position=positions,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=num_logits or 0,
        )
        self._num_cached += num_new
        return out.logits[0].float()

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_cached:
            raise ValueError(f"cannot truncate a cache of {self._num_cached} tokens to {num_tokens}")
        if num_tokens == 0:
            self._cache = DynamicCache(config=self.model.config)
        elif num_tokens < self._num_cached:
            self._cache.crop(num_tokens - self._num_cached)  # negative: number of tokens removed
        self._num_cached = num_tokens
