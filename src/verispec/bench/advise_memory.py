"""The advisor's memory figures: weights and KV caches of target, draft and EAGLE head at a context
length, against a budget (the ``memory`` section of ``verispec advise``).

Owns the KV-cache arithmetic per runner kind (which element size each runner keeps) and the head's
share of the target's memory (:data:`HEAD_MEMORY_LIMIT_PCT`). Knows nothing about decoding or the
advisor's speedup model (:mod:`verispec.bench.advise`).
"""

from __future__ import annotations


def kv_cache_bytes(model_config, context_length: int, bytes_per_element: int) -> int:
    """Bytes of one sequence's K and V caches at ``context_length`` tokens:
    ``2 * layers * kv_heads * head_dim * context_length * bytes_per_element``."""
    heads = int(model_config.num_attention_heads)
    kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(model_config, "head_dim", None) or model_config.hidden_size // heads)
    return 2 * int(model_config.num_hidden_layers) * kv_heads * head_dim * context_length * bytes_per_element


def kv_geometry(loaded, runner_kind: str):
    """(a config with the KV cache's shape, bytes per cached element) for ``loaded`` on a runner.

    torch keeps the model's dtype; the gguf and int8 runners keep float32; llama.cpp float16. The
    shape comes from the torch model's config, else from the GGUF header.
    """
    from types import SimpleNamespace

    element = {"llamacpp": 2, "gguf": 4, "int8": 4}.get(runner_kind)
    if loaded.model is not None:
        return loaded.model.config, element or loaded.model.dtype.itemsize
    from verispec.models.gguf_file import read_gguf_header

    header = read_gguf_header(loaded.path)
    heads = int(header.arch_value("attention.head_count"))
    hidden = int(header.arch_value("embedding_length"))
    config = SimpleNamespace(
        num_attention_heads=heads,
        num_key_value_heads=int(header.arch_value("attention.head_count_kv", heads)),
        head_dim=int(header.arch_value("attention.key_length", hidden // heads)),
        num_hidden_layers=int(header.arch_value("block_count")),
        hidden_size=hidden,
    )
    return config, element or 4


HEAD_MEMORY_LIMIT_PCT = 10.0  # an EAGLE head's weights + KV cache, as a share of the target's (issue 28)


def head_kv_bytes(head, context_length: int) -> int:
    """An EAGLE head's KV cache at ``context_length`` tokens: one layer, float32 keys and values."""
    shape = head.shape
    return 2 * shape.num_key_value_heads * shape.head_dim * context_length * 4


def memory_advice(
    target_config,
    draft_config,
    target_param_bytes: int,
    draft_param_bytes: int,
    context_length: int,
    bytes_per_element: int,
    budget_bytes: int | None,
    head_param_bytes: int = 0,
    head_kv: int = 0,
) -> dict:
    """Weights and KV caches (bytes) of target, draft and EAGLE head at ``context_length``; fits the budget?

    ``target_config`` / ``draft_config``: model configs (or :func:`kv_geometry`'s) giving the
    KV cache's shape; ``draft_config`` None: no draft. ``head_param_bytes``, ``head_kv``: a loaded
    head's weights (:func:`verispec.runners.eagle.blocks.head_nbytes`) and KV cache
    (:func:`head_kv_bytes`), 0 without one; ``head_overhead_pct`` is their share of the target's
    weights + KV, ``head_within_limit`` whether it is <= :data:`HEAD_MEMORY_LIMIT_PCT`."""
    target_kv = kv_cache_bytes(target_config, context_length, bytes_per_element)
    draft_kv = kv_cache_bytes(draft_config, context_length, bytes_per_element) if draft_config is not None else 0
    target_total, draft_total = target_param_bytes + target_kv, draft_param_bytes + draft_kv
    head_total = head_param_bytes + head_kv
    total = target_total + draft_total + head_total
    head_pct = 100.0 * head_total / target_total if head_total and target_total else None
    return {
        "context_length": context_length,
        "target_param_bytes": target_param_bytes,
        "target_kv_bytes": target_kv,
        "draft_param_bytes": draft_param_bytes,
        "draft_kv_bytes": draft_kv,
        "total_bytes": total,
        "draft_overhead_pct": 100.0 * draft_total / target_total if target_total else None,
        "head_param_bytes": head_param_bytes,
        "head_kv_bytes": head_kv,
        "head_overhead_pct": head_pct,
        "head_within_limit": None if head_pct is None else head_pct <= HEAD_MEMORY_LIMIT_PCT,
        "budget_bytes": budget_bytes,
        "fits": None if budget_bytes is None else total <= budget_bytes,
        "fits_without_draft": None if budget_bytes is None else target_total <= budget_bytes,
    }
