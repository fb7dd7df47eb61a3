"""The one generate loop: propose -> verify -> commit -> rollback.

Plain decoding is the same loop with no drafter (zero draft tokens per step), so the baseline
and every speculative method share prefill, sampling, stops and metrics. Knows nothing about
tokenization beyond handing token ids to :class:`verispec.output.OutputBuilder`, and nothing
about how a runner or drafter computes.

Invariant between steps: the target's KV cache holds every committed token except the last one
(``pending``), whose logits are computed by the next verify pass together with the draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch

from verispec.errors import ContextLengthError, InvalidParameterError
from verispec.metrics import RequestMetrics, RequestTimes, SpecDecodeStats
from verispec.output import Detokenizer, OutputBuilder
from verispec.proposers import DraftOutput, DraftRequest, Proposer
from verispec.runners import Runner, prefill
from verispec.sampling import ProcessedRows, SamplingParams, process_logits, sample_from
from verispec.verify import VerifyResult, greedy_verify, pad_vocab, rejection_sample

METHODS = ("none", "draft")
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate for one request.

    Attributes:
        method: ``"none"`` (plain decoding) or the name of a loaded drafter (``"draft"``).
        num_speculative_tokens: tokens drafted per target pass, 1..64 (ignored for ``none``).
    Raises:
        InvalidParameterError: unknown method or out-of-range ``num_speculative_tokens``.
    """

    method: str = "draft"
    num_speculative_tokens: int = 5

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidParameterError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidParameterError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}"
            )


@dataclass
class GenerationOutput:
    """Result of one request: ``token_ids`` ``[output_tokens]``, its text, why it ended, metrics."""

    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(),
        }


@dataclass
class StreamChunk:
    """What one verify step committed: new visible text and token ids; ``output`` on the last."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    output: GenerationOutput | None = None


class SpeculativeEngine:
    """Generates with a target runner and optional drafters, losslessly.

    Args:
        target: the target model's runner; its output defines the result.
        tokenizer: decodes token ids to text (``decode(ids, skip_special_tokens=True)``).
        eos_token_ids: tokens that end generation.
        proposers: drafters by method name (e.g. ``{"draft": DraftModelProposer(...)}``).
    """

    def __init__(
        self,
        target: Runner,
        tokenizer: Detokenizer,
        *,
        eos_token_ids: Sequence[int],
        proposers: Mapping[str, Proposer] | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.proposers = dict(proposers or {})

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        spec: SpeculativeConfig | None = None,
    ) -> GenerationOutput:
        """Run a request to completion; see :meth:`stream` for arguments and errors."""
        for chunk in self.stream(prompt_token_ids, params, spec):
            if chunk.output is not None:
                return chunk.output
        raise AssertionError("stream ended without an output")  # pragma: no cover

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        spec: SpeculativeConfig | None = None,
    ) -> Iterator[StreamChunk]:
        """Generate, yielding a chunk per target pass; the last chunk carries the output.

        Greedy output is token-identical to plain greedy decoding; sampled output has the
        target's distribution (see :mod:`verispec.verify`).

        Raises:
            InvalidParameterError: empty prompt, or a method whose drafter is not loaded.
            ContextLengthError: the prompt leaves no room in the target's context window.
        """
        params = params or SamplingParams()
        spec = spec or SpeculativeConfig()
        prompt = [int(t) for t in prompt_token_ids]
        proposer = self._check_request(prompt, spec)
        generator = torch.Generator()
        generator.manual_seed(params.seed) if params.seed is not None else generator.seed()
        out = OutputBuilder(
            self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            stop=params.stop,
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
        )
        stats = SpecDecodeStats()
        times = RequestTimes(start=time.perf_counter())

        logits = self._timed_target(times, lambda: prefill(self.target, prompt)[None, :])
        pending = _pick(process_logits(logits, params, prompt, []), generator)
        out.append(pending)
        times.first_token = time.perf_counter()
        committed = list(out.token_ids)

        while not out.finished:
            yield StreamChunk(out.take_delta(), committed)
            cached = self.target.num_cached_tokens
            room = self.target.max_context_length - cached - 2  # new tokens land at cached+1...
            if room < 0:
                committed = []
                out.finish("length")
                break
            remaining = params.max_tokens - len(out.token_ids)
            num_draft = min(spec.num_speculative_tokens, remaining - 1, room) if proposer else 0
            draft = DraftOutput()
            if num_draft > 0:
                request = DraftRequest(prompt, out.token_ids, params, generator)
                start = time.perf_counter()
                draft = proposer.propose(request, num_draft)
                times.draft_s += time.perf_counter() - start
            draft_token_ids = draft.draft_token_ids[:num_draft]
            logits = self._timed_target(times, lambda: self.target.forward([pending] + draft_token_ids))
            result = self._verify(logits, draft_token_ids, draft, params, prompt, out.token_ids, generator)
            self.target.truncate(cached + 1 + result.num_accepted_tokens)
            stats.record(len(draft_token_ids), result.num_accepted_tokens, output_position=len(out.token_ids))
            if proposer is not None and draft_token_ids:
                proposer.observe(result.num_accepted_tokens)
            num_before = len(out.token_ids)
            for token_id in result.token_ids:
                if out.append(token_id):
                    break
            committed = out.token_ids[num_before:]
            pending = result.token_ids[-1]

        times.end = time.perf_counter()
        metrics = RequestMetrics.from_times(times, len(prompt), len(out.token_ids), stats)
        output = GenerationOutput(list(out.token_ids), out.text, out.finish_reason or "length", metrics)
        yield StreamChunk(out.take_delta(), committed, output)

    def _check_request(self, prompt: list[int], spec: SpeculativeConfig) -> Proposer | None:
        if not prompt:
            raise InvalidParameterError("the prompt is empty: give at least one token")
        if len(prompt) >= self.target.max_context_length:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the target's context window is "
                f"{self.target.max_context_length}: shorten the prompt"
            )
        if spec.method == "none":
            return None
        if spec.method not in self.proposers:
            loaded = ", ".join(sorted(self.proposers)) or "none"
            raise InvalidParameterError(f"method {spec.method!r} needs its drafter loaded (loaded: {loaded})")
        return self.proposers[spec.method]

    def _timed_target(self, times: RequestTimes, call):
        start = time.perf_counter()
        logits = call()
        times.target_s += time.perf_counter() - start
        times.num_target_forwards += 1
        return logits

    @staticmethod
    def _verify(
        logits: torch.Tensor,  # [num_draft + 1, vocab]
        draft_token_ids: list[int],
        draft: DraftOutput,
        params: SamplingParams,
        prompt: list[int],
        output_token_ids: list[int],
        generator: torch.Generator,
    ) -> VerifyResult:
        rows = process_logits(logits, params, prompt, output_token_ids, draft_token_ids)
        if rows.probs is None:
            return greedy_verify(draft_token_ids, rows.greedy_token_ids)
        target_probs, draft_probs = rows.probs, draft.draft_probs
        if draft_probs is not None:
            draft_probs = draft_probs[: len(draft_token_ids)]
            width = max(target_probs.shape[-1], draft_probs.shape[-1])
            target_probs, draft_probs = pad_vocab(target_probs, width), pad_vocab(draft_probs, width)
        return rejection_sample(draft_token_ids, draft_probs, target_probs, generator)


def _pick(rows: ProcessedRows, generator: torch.Generator) -> int:
    """The token plain decoding takes from a single processed row."""
    if rows.greedy_token_ids is not None:
        return int(rows.greedy_token_ids[0])
    return sample_from(rows.probs[0], generator)
