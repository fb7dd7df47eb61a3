"""The benchmark's arithmetic: per-prompt speedups, geometric means, pooled acceptance, percentages.

Pure functions over :class:`RunRecord` lists, so they can be checked on synthetic records.
Acceptance figures pool the counters of all prompts through
:class:`verispec.metrics.SpecDecodeStats` (its definitions, not new ones). Speedup follows
Spec-Bench (Xia et al. 2024, §5.1): over plain decoding of the same runner, one ratio per prompt,
then the geometric mean. Knows nothing about models or files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from verispec.bench.records import SPEC_COUNT_FIELDS, RunRecord, plain_method, reference_participant
from verispec.metrics import SpecDecodeStats

LLAMA_CPP_PLAIN = "llama.cpp:plain"  # the peer every runner is also compared with, when it ran

ALL = "all"  # the category row that pools every prompt


def geometric_mean(values: Iterable[float]) -> float | None:
    """exp(mean(log v)); None for no values. Raises ValueError on a value <= 0."""
    values = list(values)
    if not values:
        return None
    if any(v <= 0 for v in values):
        raise ValueError(f"geometric mean needs positive values, got {min(values)}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def mean(values: Iterable[float | None]) -> float | None:
    """Arithmetic mean of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def percent(part: float, whole: float) -> float | None:
    """100 * part / whole; None when whole is 0."""
    return 100.0 * part / whole if whole else None


def ratios(counts: Sequence[int], totals: Sequence[int]) -> list[float | None]:
    """counts[i] / totals[i] for each i (None where totals[i] is 0)."""
    return [c / t if t else None for c, t in zip(counts, totals)]


def per_prompt_speedups(
    records: Sequence[RunRecord], key: str = "total_tokens_per_s", baseline: str | None = None
) -> dict[tuple[str, str], float]:
    """``{(runner, prompt_id): record.key / baseline.key}`` for every record with a positive
    pair of values. The baseline is plain decoding of the record's own family, or the runner
    named ``baseline`` (e.g. ``verispec:none`` to compare peers with verispec)."""
    by_prompt = {(r.runner, r.prompt_id): r for r in records}
    out = {}
    for r in records:
        base_name = baseline or f"{r.family}:{plain_method(r.family)}"
        base = by_prompt.get((base_name, r.prompt_id))
        mine, theirs = getattr(r, key), getattr(base, key) if base else None
        if mine and theirs and mine > 0 and theirs > 0:
            out[(r.runner, r.prompt_id)] = mine / theirs
    return out


def pooled_spec(records: Iterable[RunRecord]) -> SpecDecodeStats:
    """The speculative counters of ``records`` added up."""
    total = SpecDecodeStats()
    for r in records:
        if r.spec:
            total.merge(
                SpecDecodeStats(
                    **{k: (list(v) if isinstance(v, list) else v) for k, v in r.spec.items() if k in SPEC_COUNT_FIELDS}
                )
            )
    return total


@dataclass
class SummaryRow:
    """Figures of one runner over one category (or ``all``). Means over prompts; ms and tokens/s.

    - speedup / decode_speedup: geometric mean over prompts of total (end-to-end) / decode
      tokens/s divided by that of plain decoding of the same family on the same prompt
    - speedup_vs_reference: the same against plain decoding of the first verispec runner
      (:func:`verispec.bench.records.reference_participant`; puts every runner and peer on one scale)
    - speedup_vs_llama_cpp: the same against the llama.cpp peer's plain decoding (None without it)
    - acceptance_rate, mean_acceptance_length, acceptance_per_position,
      acceptance_by_output_bucket: pooled counters (metrics.py definitions); None without drafts
    - tokens_per_target_forward = output tokens / target forwards (prefill included)
    - exact_checked / exact_equal / mismatched_prompts: greedy token equality with plain decoding
      of the same family
    """

    runner: str
    family: str
    method: str
    category: str
    num_prompts: int
    speedup: float | None
    decode_speedup: float | None
    speedup_vs_reference: float | None
    speedup_vs_llama_cpp: float | None
    decode_tokens_per_s: float | None
    total_tokens_per_s: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    output_tokens: float | None
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    acceptance_per_position: list[float] = field(default_factory=list)
    acceptance_by_output_bucket: list[float | None] = field(default_factory=list)
    tokens_per_target_forward: float | None = None
    exact_checked: int = 0
    exact_equal: int = 0
    mismatched_prompts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[RunRecord]) -> list[SummaryRow]:
    """One row per runner and category (categories in first-seen order), then per runner ``all``."""
    speedups = per_prompt_speedups(records)
    decode = per_prompt_speedups(records, key="decode_tokens_per_s")
    vs_reference = per_prompt_speedups(records, baseline=reference_participant(r.runner for r in records))
    vs_peer = per_prompt_speedups(records, baseline=LLAMA_CPP_PLAIN)
    runners = list(dict.fromkeys(r.runner for r in records))
    categories = list(dict.fromkeys(r.category for r in records))
    rows = []
    for category in categories + [ALL]:
        for runner in runners:
            mine = [r for r in records if r.runner == runner and category in (ALL, r.category)]
            if mine:
                rows.append(_row(mine, category, speedups, decode, vs_reference, vs_peer))
    return rows


def _row(records: list[RunRecord], category: str, speedups, decode, vs_reference, vs_peer) -> SummaryRow:
    first = records[0]
    keys = [(r.runner, r.prompt_id) for r in records]
    spec = pooled_spec(records)
    forwards = sum(r.num_target_forwards for r in records)
    checked = [r for r in records if r.matches_plain is not None]
    return SummaryRow(
        runner=first.runner,
        family=first.family,
        method=first.method,
        category=category,
        num_prompts=len(records),
        speedup=geometric_mean(speedups[k] for k in keys if k in speedups),
        decode_speedup=geometric_mean(decode[k] for k in keys if k in decode),
        speedup_vs_reference=geometric_mean(vs_reference[k] for k in keys if k in vs_reference),
        speedup_vs_llama_cpp=geometric_mean(vs_peer[k] for k in keys if k in vs_peer),
        decode_tokens_per_s=mean(r.decode_tokens_per_s for r in records),
        total_tokens_per_s=mean(r.total_tokens_per_s for r in records),
        ttft_ms=mean(r.ttft_ms for r in records),
        tpot_ms=mean(r.tpot_ms for r in records),
        output_tokens=mean(r.output_tokens for r in records),
        acceptance_rate=spec.acceptance_rate,
        mean_acceptance_length=spec.mean_acceptance_length,
        acceptance_per_position=spec.acceptance_rate_per_position,
        acceptance_by_output_bucket=ratios(spec.accepted_by_output_bucket, spec.drafted_by_output_bucket),
        tokens_per_target_forward=sum(r.output_tokens for r in records) / forwards if forwards else None,
        exact_checked=len(checked),
        exact_equal=sum(r.matches_plain for r in checked),
        mismatched_prompts=[r.prompt_id for r in checked if not r.matches_plain],
    )
