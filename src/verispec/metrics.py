"""Every metric verispec reports, each defined once here with its formula.

Owns: speculative-decoding counters (drafts, drafted, accepted, per position, histogram) and the
per-request latency/throughput figures derived from timestamps. Knows nothing about models or
how tokens were produced; the engine feeds it counts and monotonic times (seconds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

OUTPUT_BUCKET_TOKENS = 64


@dataclass
class SpecDecodeStats:
    """Counters of one request (or many, via :meth:`merge`).

    A *draft* is one verify step that had at least one drafted token.

    - acceptance_rate = num_accepted_tokens / num_draft_tokens
    - mean_acceptance_length = 1 + num_accepted_tokens / num_drafts (tokens emitted per target
      pass: accepted ones plus the recovered or bonus token)
    - accepted_per_position[i] = drafts whose token at position i was accepted
      (only the accepted prefix counts); drafted_per_position[i] = drafts that had position i
    - accepted_length_histogram[n] = drafts with exactly n accepted tokens
    - accepted_by_output_bucket[b] / drafted_by_output_bucket[b]: the same counts for drafts
      that started at output position ``b * OUTPUT_BUCKET_TOKENS ...`` (long-text decay)
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

    def record(self, num_draft_tokens: int, num_accepted_tokens: int, output_position: int = 0) -> None:
        """Record one verify step. A step with no drafted token is plain decoding: not a draft.

        ``output_position`` is the number of output tokens before the draft's first token.
        """
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} not in [0, {num_draft_tokens}]")
        if num_draft_tokens == 0:
            return
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

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts (bonus or recovered token included); None without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

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

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["acceptance_rate"] = self.acceptance_rate
        data["mean_acceptance_length"] = self.mean_acceptance_length
        data["acceptance_rate_per_position"] = self.acceptance_rate_per_position
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

    @classmethod
    def from_times(cls, times: RequestTimes, prompt_tokens: int, output_tokens: int, spec: SpecDecodeStats) -> RequestMetrics:
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
        )

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "spec"}
        data["spec"] = self.spec.to_dict()
        return data
