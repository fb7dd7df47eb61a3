"""The advisor's cost figures: cost per million tokens on a machine of a given monthly cost, plain
and with the advised method, measured end to end or estimated with a share of each prompt read
from the prefix cache (:mod:`verispec.engine.prefix_cache`)."""

from __future__ import annotations

from verispec.bench.figures import SummaryRow

SECONDS_PER_MONTH = 30 * 24 * 3600


def cost_per_million_tokens(cost_per_month: float, tokens_per_s: float) -> float | None:
    """Cost of a million tokens on a machine costing ``cost_per_month`` (30-day month) that
    produces ``tokens_per_s`` around the clock; None at 0 tokens/s."""
    return cost_per_month / (tokens_per_s * SECONDS_PER_MONTH / 1e6) if tokens_per_s > 0 else None


def tokens_per_s_with_cache(row: SummaryRow, cached_prompt_fraction: float) -> float | None:
    """End-to-end tokens/s of ``row`` when the prefix cache serves ``cached_prompt_fraction`` of
    each prompt (a chat's earlier turns, a system prompt every client shares): the measured
    tokens/s scaled by the request time ``TTFT + (n - 1) TPOT`` over the same time with the TTFT's
    prefill cut to the uncached share (an estimate: the TTFT is taken as the prompt's prefill,
    linear in its length). ``cached_prompt_fraction`` 0 gives the measured figure; None when the
    row lacks a figure."""
    measured = row.total_tokens_per_s
    if measured is None or cached_prompt_fraction == 0.0:
        return measured
    if row.ttft_ms is None or row.tpot_ms is None or row.output_tokens is None:
        return None
    decode_ms = row.tpot_ms * max(row.output_tokens - 1.0, 0.0)
    whole, cached = row.ttft_ms + decode_ms, row.ttft_ms * (1.0 - cached_prompt_fraction) + decode_ms
    return measured * whole / cached if cached > 0 else None


def cost_estimate(
    cost_per_month: float,
    method: str | None,
    plain: SummaryRow,
    chosen: SummaryRow | None,
    cached_prompt_fraction: float = 0.0,
) -> dict:
    """The cost figures of the advice: plain decoding's row and the advised ``method``'s (None:
    plain is advised), end-to-end tokens/s (:func:`tokens_per_s_with_cache`) and the cost of a
    million tokens at ``cost_per_month`` before and after."""
    plain_tokens_per_s = tokens_per_s_with_cache(plain, cached_prompt_fraction) or 0.0
    fast = plain_tokens_per_s
    if chosen is not None:
        fast = tokens_per_s_with_cache(chosen, cached_prompt_fraction) or 0.0
    return {
        "gpu_cost_per_month": cost_per_month,
        "cached_prompt_fraction": cached_prompt_fraction,
        "method": method or "none",
        "plain_tokens_per_s": plain_tokens_per_s,
        "chosen_tokens_per_s": fast,
        "before_per_million_tokens": cost_per_million_tokens(cost_per_month, plain_tokens_per_s),
        "after_per_million_tokens": cost_per_million_tokens(cost_per_month, fast),
    }
