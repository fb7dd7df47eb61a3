"""Runner over a transformers ``AutoModelForCausalLM`` (any architecture it loads, GGUF too).

Owns the model's ``DynamicCache`` for one sequence. Rollback crops the cache by the number of
discarded positions; the prefix is never recomputed. With :meth:`TransformersRunner.capture_features`
on, a pass also hands out chosen ``output_hidden_states`` (EAGLE-3 features,
:mod:`verispec.runners.features`). Knows nothing about drafting or sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import DynamicCache

from verispec.runners import Runner, check_new_tokens
from verispec.runners.features import check_feature_layers, concat_features


class TransformersRunner(Runner):
    """:class:`verispec.runners.Runner` over a transformers causal LM.

    Args:
        model: a transformers causal LM in eval mode (weights on one device).
        max_context_length: overrides the config's ``max_position_embeddings``.
    """

    def __init__(self, model: torch.nn.Module, *, max_context_length: int | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        config = model.config
        head = model.get_output_embeddings()  # nn.Linear or a quantized stand-in (out_features)
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        self.max_context_length = int(max_context_length or getattr(config, "max_position_embeddings", 2048))
        self._cache = DynamicCache(config=config)
        self._num_cached = 0
        self._feature_layers: tuple[int, ...] = ()
        self.last_features: Tensor | None = None  # see capture_features

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one position takes in the K and V caches: layers x 2 x kv_heads x head_dim x the
        model's bytes per element (the cache grows with the sequence, up to ``max_context_length``)."""
        config = self.model.config
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        element = next(self.model.parameters()).element_size()
        return int(config.num_hidden_layers) * 2 * kv_heads * head_dim * element

    def new_sequence(self) -> TransformersRunner:
        """Another sequence over the same model with its own empty cache (batched passes run
        one sequence after the other: :func:`verispec.runners.forward_batch`)."""
        sequence = TransformersRunner(self.model, max_context_length=self.max_context_length)
        sequence.capture_features(self._feature_layers)
        return sequence

    def capture_features(self, layers: Sequence[int]) -> None:
        """From now on every ``forward`` / ``forward_tree`` asks the model for
        ``output_hidden_states`` and sets :attr:`last_features` to float32 CPU ``[rows of the
        pass, len(layers) * hidden_size]``: ``hidden_states[i]`` of every row (not only the logits
        rows) for each ``i`` in ``layers``, concatenated in the order given
        (:mod:`verispec.runners.features`' convention; 0: the embeddings). ``()`` stops it
        (``last_features`` None, and the model is no longer asked). :meth:`new_sequence` copies
        the setting. The fp32 reference: not batch-invariant, unlike the int8 and gguf runners.

        Raises:
            InvalidParameterError: a layer outside ``0 .. num_hidden_layers - 1``.
        """
        self._feature_layers = check_feature_layers(layers, int(self.model.config.num_hidden_layers))
        self.last_features = None

    def _run(self, **inputs) -> Tensor:
        """One model call on this sequence's cache; keeps the features when capturing and returns
        the logits as float32 CPU ``[rows, vocab_size]``."""
        if self._feature_layers:
            inputs["output_hidden_states"] = True
        out = self.model(cache=self._cache, use_cache=True, **inputs)
        if self._feature_layers:
            states = [state[0] for state in out.hidden_states]  # [rows, hidden] each
            self.last_features = concat_features(states, self._feature_layers, 0, states[0].shape[0]).cpu()
        self._num_cached += inputs["input_ids"].shape[1]
        # Sampling and verification run on the CPU with the request's CPU generator; one
        # [k, vocab] copy per step is small next to a forward pass.
        return out.logits[0].float().cpu()

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], num_logits: int | None = None) -> Tensor:
        num_new = len(token_ids)
        check_new_tokens(self._num_cached, num_new, self.max_context_length)
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(self._num_cached, self._num_cached + num_new, device=self.device)
        return self._run(
            input_ids=input_ids,
            position_ids=positions[None, :],
            cache_position=positions,
            logits_to_keep=num_logits or 0,
        )

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_cached:
            raise ValueError(f"cannot truncate a cache of {self._num_cached} tokens to {num_tokens}")
        if num_tokens == 0:
            self._cache = DynamicCache(config=self.model.config)
        elif num_tokens < self._num_cached:
            self._cache.crop(num_tokens - self._num_cached)  # negative: number of tokens removed
        self._num_cached = num_tokens

    @torch.inference_mode()
    def forward_tree(self, token_ids: Sequence[int], position_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Score a token tree in one forward (see :mod:`verispec.algorithms.tree` for the layout).

        Args:
            token_ids: ``[num_nodes]`` tokens in topological order.
            position_ids: ``[num_nodes]`` int64, cached length + depth of each node.
            attention_mask: ``[num_nodes, num_cached_tokens + num_nodes]`` bool.
        Returns:
            float32 ``[num_nodes, vocab_size]``. All nodes enter the cache; follow with
            :meth:`keep_tree_path` to keep only the accepted path.
        """
        num_new = len(token_ids)
        if attention_mask.shape != (num_new, self._num_cached + num_new):
            raise ValueError(f"mask shape {tuple(attention_mask.shape)} != ({num_new}, {self._num_cached + num_new})")
        if int(position_ids.max()) >= self.max_context_length:
            raise ValueError(f"tree positions exceed the context length {self.max_context_length}")
        dtype = next(self.model.parameters()).dtype
        additive = torch.zeros(attention_mask.shape, dtype=dtype)
        additive.masked_fill_(~attention_mask, torch.finfo(dtype).min)
        slots = torch.arange(self._num_cached, self._num_cached + num_new, device=self.device)
        return self._run(
            input_ids=torch.tensor([list(token_ids)], dtype=torch.long, device=self.device),
            position_ids=position_ids.to(self.device)[None, :],
            cache_position=slots,
            attention_mask=additive.to(self.device)[None, None, :, :],
        )

    def keep_tree_path(self, num_prefix_tokens: int, node_indices: Sequence[int]) -> None:
        """Keep the first ``num_prefix_tokens`` entries, then the tree nodes ``node_indices``
        (offsets after the prefix, in order), compacted into contiguous positions. No recompute.
        """
        keep = torch.tensor(list(node_indices), dtype=torch.long, device=self.device) + num_prefix_tokens
        if keep.numel() and (int(keep.min()) < num_prefix_tokens or int(keep.max()) >= self._num_cached):
            raise ValueError(f"node indices {list(node_indices)} outside the cached tree")
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            layer.keys = torch.cat([layer.keys[..., :num_prefix_tokens, :], layer.keys[..., keep, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :num_prefix_tokens, :], layer.values[..., keep, :]], dim=-2)
        self._num_cached = num_prefix_tokens + keep.numel()
