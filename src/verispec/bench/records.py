"""What a benchmark run records: one :class:`RunRecord` per runner and prompt, the participants as
results.json lists them, and the greedy exactness marks (each record against plain decoding of its
own runner family, and against the reference runner).

Owns the record's fields and the participant names (``family:method``; which family's plain
method is the baseline). Knows nothing about running the benchmark (:mod:`verispec.bench.run`),
figures or file formats.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from verispec.algorithms.sampling import SamplingParams
from verispec.bench.workload import WorkloadItem
from verispec.engine import GenerationOutput

REFERENCE_RUNNER = "verispec:none"  # results written before runners were named by kind
VERISPEC_FAMILIES = ("verispec", "gguf", "int8", "llamacpp", "torch")  # verispec's engine on each runner
SPEC_COUNT_FIELDS = (
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_bonus_tokens",
    "num_recovered_tokens",
    "accepted_per_position",
    "drafted_per_position",
    "accepted_length_histogram",
    "accepted_by_output_bucket",
    "drafted_by_output_bucket",
)


def plain_method(family: str) -> str:
    """The plain-decoding method of a runner family (verispec calls it ``none``)."""
    return "none" if family in VERISPEC_FAMILIES else "plain"


def reference_participant(names: Iterable[str]) -> str:
    """The baseline every runner is also compared with: plain decoding of the first verispec
    runner in ``names`` (``gguf:none`` in ``gguf:none, gguf:draft, int8:none, ...``)."""
    for name in names:
        family, _, method = name.partition(":")
        if family in VERISPEC_FAMILIES and method == "none":
            return name
    return REFERENCE_RUNNER


class Participant(Protocol):
    """One contender of a benchmark run: a verispec method on one runner kind, or a peer."""

    name: str  # "family:method", e.g. "verispec:draft"
    family: str
    method: str
    settings: dict

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> GenerationOutput: ...


@dataclass
class RunRecord:
    """One runner on one prompt. Times in ms, rates in tokens/s (:class:`RequestMetrics`).

    ``spec``: the speculative counters (:data:`SPEC_COUNT_FIELDS`), empty for peers.
    ``matches_plain``: tokens equal those of plain decoding of the same family, greedy or sampled by
    coupling with the same seed (None for the plain run itself and for rejection sampling);
    ``matches_reference``: greedy tokens equal to verispec's plain.
    ``kernel_isa``: the gguf runner's kernel path (``avx512``, ``avx2``, ``portable``, ...), None
    for other runners.
    """

    prompt_id: str
    category: str
    runner: str
    family: str
    method: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    ttft_ms: float
    tpot_ms: float | None
    decode_tokens_per_s: float | None
    total_tokens_per_s: float
    e2e_ms: float
    draft_ms: float
    target_ms: float
    num_target_forwards: int
    spec: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    matches_plain: bool | None = None
    matches_reference: bool | None = None
    kernel_isa: str | None = None

    @classmethod
    def of(cls, item: WorkloadItem, runner: Participant, output: GenerationOutput) -> RunRecord:
        m = output.metrics
        spec = m.spec.to_dict()
        return cls(
            prompt_id=item.id,
            category=item.category,
            runner=runner.name,
            family=runner.family,
            method=runner.method,
            prompt_tokens=m.prompt_tokens,
            output_tokens=m.output_tokens,
            finish_reason=output.finish_reason,
            ttft_ms=m.ttft_ms,
            tpot_ms=m.tpot_ms,
            decode_tokens_per_s=m.decode_tokens_per_s,
            total_tokens_per_s=m.total_tokens_per_s,
            e2e_ms=m.e2e_ms,
            draft_ms=m.draft_ms,
            target_ms=m.target_ms,
            num_target_forwards=m.num_target_forwards,
            spec={k: spec[k] for k in SPEC_COUNT_FIELDS} if m.spec.num_drafts else {},
            token_ids=list(output.token_ids),
            text=output.text,
            kernel_isa=runner.settings.get("kernel_isa"),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunRecord:
        return cls(**data)


@dataclass
class ParticipantInfo:
    """A benchmark participant as results.json lists it (its ``runners`` entry): ``status`` is ``ok``,
    ``not installed`` or ``skipped: why``."""

    name: str
    family: str
    method: str
    status: str = "ok"
    settings: dict = field(default_factory=dict)
    load_time_s: float | None = None


def mark_exactness(batch: list[RunRecord], *, across_runners: bool = True) -> None:
    """Set ``matches_plain`` (and, with ``across_runners``, ``matches_reference``) on the records of
    one prompt: greedy, or sampled by coupling with one seed (then only within a runner family, whose
    plain run drew the same noise; another runner's logits differ, so its sampled text may too)."""
    by_name = {r.runner: r for r in batch}
    reference = by_name.get(reference_participant(by_name))
    for record in batch:
        plain = by_name.get(f"{record.family}:{plain_method(record.family)}")
        if plain is not None and plain is not record:
            record.matches_plain = record.token_ids == plain.token_ids
        if across_runners and reference is not None and reference is not record:
            record.matches_reference = record.token_ids == reference.token_ids
