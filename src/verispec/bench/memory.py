"""The benchmark's memory figures: RSS snapshots around loading each model, parameter bytes,
the draft's overhead in percent (the ``memory`` section of results.json)."""

from __future__ import annotations

import dataclasses

from verispec.bench.figures import percent
from verispec.engine.loader import DrafterOptions, SpeculativePipeline
from verispec.metrics import current_rss_bytes, peak_rss_bytes
from verispec.models.loading import load_model
from verispec.runners.select import RunnerOptions


def load_measured(
    target: str,
    draft: str | None,
    dtype: str,
    runner: str = "torch",
    *,
    drafters: DrafterOptions | None = None,
    runners: RunnerOptions | None = None,
) -> tuple[SpeculativePipeline, dict]:
    """Load the pair like :meth:`SpeculativePipeline.load`, noting RSS before and after each model.
    ``drafters``, ``runners``: as ``load`` takes them (``runners.kind`` is replaced by ``runner``).

    Returns the pipeline and ``{"rss_before_load_bytes", "rss_after_target_bytes",
    "rss_after_draft_bytes"}`` (None where /proc is unavailable, and ``rss_after_target_bytes``
    for runners other than torch, which load both models together). Raises as ``load`` does.
    """
    before = current_rss_bytes()
    options = dataclasses.replace(runners or RunnerOptions(), kind=runner)
    if runner != "torch":
        pipe = SpeculativePipeline.load(target, draft, dtype=dtype, drafters=drafters, runners=options)
        return pipe, {
            "rss_before_load_bytes": before,
            "rss_after_target_bytes": None,
            "rss_after_draft_bytes": current_rss_bytes(),
        }
    target_model = load_model(target, dtype=dtype)
    after_target = current_rss_bytes()
    draft_model = load_model(draft, dtype=dtype) if draft else None
    after_draft = current_rss_bytes()
    pipe = SpeculativePipeline(target_model, draft_model, drafters, runners=options)
    return pipe, {
        "rss_before_load_bytes": before,
        "rss_after_target_bytes": after_target,
        "rss_after_draft_bytes": after_draft,
    }


def memory_facts(pipe: SpeculativePipeline, rss: dict | None = None) -> dict:
    """Memory section of results.json: parameter bytes, RSS snapshots, peak RSS, draft overhead %."""
    rss = rss or {}
    target_bytes = pipe.target.param_bytes
    draft_bytes = pipe.draft.param_bytes if pipe.draft is not None else 0
    before, after_target, after_draft = (
        rss.get(k) for k in ("rss_before_load_bytes", "rss_after_target_bytes", "rss_after_draft_bytes")
    )
    rss_overhead = None
    if None not in (before, after_target, after_draft):
        rss_overhead = percent(after_draft - after_target, after_target - before)
    return {
        "target_param_bytes": target_bytes,
        "draft_param_bytes": draft_bytes,
        "draft_overhead_pct": percent(draft_bytes, target_bytes),
        "rss_before_load_bytes": before,
        "rss_after_target_bytes": after_target,
        "rss_after_draft_bytes": after_draft,
        "draft_rss_overhead_pct": rss_overhead,
        "peak_rss_bytes": peak_rss_bytes(),
    }
