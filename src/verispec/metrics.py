"""Every metric verispec reports, each defined once here with its formula.

Owns: speculative-decoding counters (drafts, drafted, accepted, per position, histogram) and the
per-request latency/throughput figures derived from timestamps. Knows nothing about models or
how tokens were produced; the engine feeds it counts and monotonic times (seconds).
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass, field
from typing import Any

OUTPUT_BUCKET_TOKENS = 64


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float | None:
    """accepted / drafted; None when nothing was drafted."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else None


def mean_acceptance_length(num_accepted_tokens: int, num_drafts: int) -> float | None:
    """1 + accepted / drafts (bonus or recovered token included); None without drafts."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else None


class _AcceptanceFigures:
    """The two rates of any counters with ``num_drafts``, ``num_draft_tokens`` and
    ``num_accepted_tokens``."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None when nothing was drafted."""
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts (bonus or recovered token included); None without drafts."""
        return mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)


@dataclass
class DrafterStats(_AcceptanceFigures):
    """Drafts, drafted and accepted tokens of one drafter, with the rates defined above."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["acceptance_rate"] = self.acceptance_rate
        data["mean_acceptance_length"] = self.mean_acceptance_length
        return data


@dataclass
class SpecDecodeStats(_AcceptanceFigures):
    """Counters of one request (or many, via :meth:`merge`).

    A *draft* is one verify step that had at least one drafted token. An *accepted* token is a
    drafted token the target accepted that became a token of the completion: an accepted
    end-of-sequence token (not part of the completion) or one past a stop string or ``max_tokens``
    is drafted but not accepted, so ``num_accepted_tokens`` <= ``output_tokens`` (the usage's
    ``completion_tokens``) and the completion's other tokens are the target's own (the first, and
    each pass's recovered or bonus token).

    - acceptance_rate = num_accepted_tokens / num_draft_tokens
    - mean_acceptance_length = 1 + num_accepted_tokens / num_drafts (tokens emitted per target
      pass: accepted ones plus the recovered or bonus token)
    - accepted_per_position[i] = drafts whose token at position i was accepted
      (only the accepted prefix counts); drafted_per_position[i] = drafts that had position i
    - accepted_length_histogram[n] = drafts with exactly n accepted tokens
    - accepted_by_output_bucket[b] / drafted_by_output_bucket[b]: the same counts for drafts
      that started at output position ``b * OUTPUT_BUCKET_TOKENS ...`` (long-text decay)
    - per_drafter[name]: the same drafts / drafted / accepted counts for one drafter (``auto``
      mixes drafters step by step)
    - chosen_k: the draft length the controller chose at each verify step (0 = plain step)
    - predicted_speedup = predicted_tokens / predicted_cost: the controller's expected tokens
      per plain-step time over the steps it predicted; realised_speedup = realised_tokens /
      realised_cost: tokens emitted per measured step time (draft + target pass), both in units
      of the measured plain decoding step
    (vLLM v1/spec_decode/metrics.py; gpt-fast's accept-count histogram.)
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_bonus_tokens: int = 0
    num_recovered_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_length_histogram: list[int] = field(default_factory=list)
    accepted_by_output_bucket: list[int] = field(default_factory=list)
    drafted_by_output_bucket: list[int] = field(default_factory=list)
    per_drafter: dict[str, DrafterStats] = field(default_factory=dict)
    chosen_k: list[int] = field(default_factory=list)
    predicted_tokens: float = 0.0
    predicted_cost: float = 0.0
    realised_tokens: float = 0.0
    realised_cost: float = 0.0

    def record(
        self, num_draft_tokens: int, num_accepted_tokens: int, output_position: int = 0, drafter: str | None = None
    ) -> None:
        """Record one verify step. A step with no drafted token is plain decoding: not a draft.

        ``output_position`` is the number of output tokens before the draft's first token;
        ``drafter`` names the drafter that proposed the draft.
        """
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} not in [0, {num_draft_tokens}]")
        if num_draft_tokens == 0:
            return
        if drafter is not None:
            mine = self.per_drafter.setdefault(drafter, DrafterStats())
            mine.num_drafts += 1
            mine.num_draft_tokens += num_draft_tokens
            mine.num_accepted_tokens += num_accepted_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if num_accepted_tokens == num_draft_tokens:
            self.num_bonus_tokens += 1
        else:
            self.num_recovered_tokens += 1
        _grow(self.drafted_per_position, num_draft_tokens)
        _grow(self.accepted_per_position, num_draft_tokens)
        _grow(self.accepted_length_histogram, num_draft_tokens + 1)
        for position in range(num_draft_tokens):
            self.drafted_per_position[position] += 1
            if position < num_accepted_tokens:
                self.accepted_per_position[position] += 1
        self.accepted_length_histogram[num_accepted_tokens] += 1
        bucket = output_position // OUTPUT_BUCKET_TOKENS
        _grow(self.accepted_by_output_bucket, bucket + 1)
        _grow(self.drafted_by_output_bucket, bucket + 1)
        self.accepted_by_output_bucket[bucket] += num_accepted_tokens
        self.drafted_by_output_bucket[bucket] += num_draft_tokens

    def record_control(
        self,
        chosen_k: int,
        predicted: tuple[float, float] | None = None,
        realised: tuple[float, float] | None = None,
    ) -> None:
        """Record the controller's side of one verify step.

        ``predicted`` and ``realised`` are ``(tokens, cost in plain steps)``; they are added
        only when both are known, so the two speedups cover the same steps.
        """
        self.chosen_k.append(chosen_k)
        if predicted is not None and realised is not None:
            self.predicted_tokens += predicted[0]
            self.predicted_cost += predicted[1]
            self.realised_tokens += realised[0]
            self.realised_cost += realised[1]

    @property
    def predicted_speedup(self) -> float | None:
        return self.predicted_tokens / self.predicted_cost if self.predicted_cost > 0 else None

    @property
    def realised_speedup(self) -> float | None:
        return self.realised_tokens / self.realised_cost if self.realised_cost > 0 else None

    @property
    def chosen_k_histogram(self) -> list[int]:
        """chosen_k_histogram[k] = verify steps for which the controller chose k."""
        histogram: list[int] = []
        for k in self.chosen_k:
            _grow(histogram, k + 1)
            histogram[k] += 1
        return histogram

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """accepted_per_position[i] / drafted_per_position[i] for each draft position i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def merge(self, other: SpecDecodeStats) -> None:
        """Add another request's counters into this one."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_bonus_tokens += other.num_bonus_tokens
        self.num_recovered_tokens += other.num_recovered_tokens
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.drafted_per_position, other.drafted_per_position),
            (self.accepted_length_histogram, other.accepted_length_histogram),
            (self.accepted_by_output_bucket, other.accepted_by_output_bucket),
            (self.drafted_by_output_bucket, other.drafted_by_output_bucket),
        ):
            _grow(mine, len(theirs))
            for i, value in enumerate(theirs):
                mine[i] += value
        for name, theirs in other.per_drafter.items():
            mine = self.per_drafter.setdefault(name, DrafterStats())
            mine.num_drafts += theirs.num_drafts
            mine.num_draft_tokens += theirs.num_draft_tokens
            mine.num_accepted_tokens += theirs.num_accepted_tokens
        self.chosen_k.extend(other.chosen_k)
        self.predicted_tokens += other.predicted_tokens
        self.predicted_cost += other.predicted_cost
        self.realised_tokens += other.realised_tokens
        self.realised_cost += other.realised_cost

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["acceptance_rate"] = self.acceptance_rate
        data["mean_acceptance_length"] = self.mean_acceptance_length
        data["acceptance_rate_per_position"] = self.acceptance_rate_per_position
        data["per_drafter"] = {name: stats.to_dict() for name, stats in self.per_drafter.items()}
        data["chosen_k_histogram"] = self.chosen_k_histogram
        data["predicted_speedup"] = self.predicted_speedup
        data["realised_speedup"] = self.realised_speedup
        return data


def _grow(values: list[int], length: int) -> None:
    values.extend([0] * (length - len(values)))


@dataclass
class RequestTimes:
    """Monotonic timestamps (seconds) and accumulated forward times of one request."""

    start: float = 0.0
    first_token: float | None = None
    end: float | None = None
    draft_s: float = 0.0
    target_s: float = 0.0
    num_target_forwards: int = 0


@dataclass
class RequestMetrics:
    """Per-request figures. Times in ms, rates in tokens/s.

    - ttft_ms = first token time - request start (prefill and first sampling included)
    - tpot_ms = (end - first token) / (output_tokens - 1); None for a single output token
    - decode_tokens_per_s = (output_tokens - 1) / (end - first token)
    - total_tokens_per_s = output_tokens / (end - start)
    - e2e_ms = end - start
    - draft_ms, target_ms: time inside drafter proposals and target forwards (prefill included)
    - cached_tokens: prompt tokens read from the prefix cache, not computed (OpenAI's
      ``usage.prompt_tokens_details.cached_tokens``)
    """

    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    tpot_ms: float | None
    decode_tokens_per_s: float | None
    total_tokens_per_s: float
    e2e_ms: float
    draft_ms: float
    target_ms: float
    num_target_forwards: int
    spec: SpecDecodeStats
    cached_tokens: int = 0

    @classmethod
    def from_times(
        cls,
        times: RequestTimes,
        prompt_tokens: int,
        output_tokens: int,
        spec: SpecDecodeStats,
        cached_tokens: int = 0,
    ) -> RequestMetrics:
        end = times.end if times.end is not None else times.start
        first = times.first_token if times.first_token is not None else end
        decode_s = end - first
        decoded_after_first = max(output_tokens - 1, 0)
        return cls(
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            ttft_ms=(first - times.start) * 1e3,
            tpot_ms=decode_s * 1e3 / decoded_after_first if decoded_after_first else None,
            decode_tokens_per_s=decoded_after_first / decode_s if decoded_after_first and decode_s > 0 else None,
            total_tokens_per_s=output_tokens / (end - times.start) if end > times.start else 0.0,
            e2e_ms=(end - times.start) * 1e3,
            draft_ms=times.draft_s * 1e3,
            target_ms=times.target_s * 1e3,
            num_target_forwards=times.num_target_forwards,
            spec=spec,
            cached_tokens=cached_tokens,
        )

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "spec"}
        data["spec"] = self.spec.to_dict()
        return data


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int | None:
    """Resident set size of this process now, bytes (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None
