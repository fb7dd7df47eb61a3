"""Quality audit: re-decode a fraction of requests with plain decoding and count agreements.

Owns the choice of audited requests (a Bernoulli draw per request with its own seeded
``random.Random``), a bounded queue of pending audits, the comparison (greedy: token by token;
sampling: the target's mean log-probability of the emitted tokens beside that of a plain
sample, since speculative and plain sampling consume randomness differently and cannot be
compared token by token) and the counters. Audits run only when the caller asks
(:meth:`QualityAuditor.run_pending`), after the audited response was delivered, so they never
slow it; a full queue drops the audit rather than wait. Knows nothing about HTTP or the CLI.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from verispec.algorithms.sampling import SamplingParams, apply_penalties, logits_to_probs
from verispec.engine import GenerationOutput, SpeculativeConfig, SpeculativeEngine
from verispec.errors import InvalidParameterError
from verispec.runners import Runner

MAX_DISAGREEMENTS_KEPT = 20
PLAIN = SpeculativeConfig(method="none")


def first_difference(token_ids: Sequence[int], plain_token_ids: Sequence[int]) -> int | None:
    """Index of the first position where the two token lists differ (a missing token counts
    as a difference); None when they are equal."""
    for i, (a, b) in enumerate(zip(token_ids, plain_token_ids)):
        if a != b:
            return i
    return None if len(token_ids) == len(plain_token_ids) else min(len(token_ids), len(plain_token_ids))


def target_logprobs(
    runner: Runner, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], params: SamplingParams
) -> torch.Tensor:
    """Log-probability of each emitted token under the target's sampling distribution.

    One target pass over ``prompt + output[:-1]``; each row goes through the same penalties,
    temperature, top-k and top-p as plain decoding (:func:`verispec.algorithms.sampling.process_logits`).
    Returns float32 ``[len(output_token_ids)]`` (``-inf`` for a token outside top-k/top-p).
    Empties the runner's cache afterwards. Raises InvalidParameterError for greedy params.
    """
    if params.is_greedy:
        raise InvalidParameterError("greedy output has no sampling distribution: compare tokens instead")
    prompt, output = list(prompt_token_ids), list(output_token_ids)
    if not output:
        return torch.zeros(0)
    runner.truncate(0)
    try:
        logits = runner.forward(prompt + output[:-1], num_logits=len(output))  # [len(output), vocab]
    finally:
        runner.truncate(0)
    # row i is scored after prompt + output[:i], exactly as verification scores a draft
    probs = logits_to_probs(apply_penalties(logits.float(), params, prompt, [], output), params)
    return torch.log(probs[torch.arange(len(output)), torch.tensor(output)])


@dataclass
class AuditResult:
    """One audit. Greedy: ``agreed`` and ``first_difference``. Sampling: the summed target
    log-probability (nats) of the audited output's tokens and of the plain sample's tokens."""

    greedy: bool
    agreed: bool | None = None
    first_difference: int | None = None
    output_logprob_sum: float = 0.0
    output_tokens: int = 0
    plain_logprob_sum: float = 0.0
    plain_tokens: int = 0


@dataclass
class AuditCounts:
    """Counters of the audits so far.

    - agreement_rate = agreed / (agreed + disagreed) over greedy audits
    - mean_output_logprob / mean_plain_logprob: per-token target log-probability of the audited
      (speculative) outputs and of their plain re-decodes over sampling audits; lossless
      speculation makes the two agree up to sampling noise
    - dropped: selected while the pending queue was full (never waited for)
    """

    requests: int = 0
    selected: int = 0
    dropped: int = 0
    audited: int = 0
    agreed: int = 0
    disagreed: int = 0
    sampled: int = 0
    failed: int = 0
    output_logprob_sum: float = 0.0
    output_logprob_tokens: int = 0
    plain_logprob_sum: float = 0.0
    plain_logprob_tokens: int = 0
    disagreements: list[dict] = field(default_factory=list)

    @property
    def agreement_rate(self) -> float | None:
        checked = self.agreed + self.disagreed
        return self.agreed / checked if checked else None

    @property
    def mean_output_logprob(self) -> float | None:
        return self.output_logprob_sum / self.output_logprob_tokens if self.output_logprob_tokens else None

    @property
    def mean_plain_logprob(self) -> float | None:
        return self.plain_logprob_sum / self.plain_logprob_tokens if self.plain_logprob_tokens else None

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            agreement_rate=self.agreement_rate,
            mean_output_logprob=self.mean_output_logprob,
            mean_plain_logprob=self.mean_plain_logprob,
        )
        return data


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output: GenerationOutput


class QualityAuditor:
    """Chooses requests to audit, queues them, and runs the audits when told to.

    Args:
        rate: fraction of requests audited, in [0, 1] (a Bernoulli draw per request).
        seed: seed of the selection draws (None: fresh).
        max_pending: audits queued at most; a selected request beyond it is dropped.
    Raises:
        InvalidParameterError: ``rate`` outside [0, 1] or ``max_pending`` < 1.
    """

    def __init__(self, rate: float, seed: int | None = None, max_pending: int = 64) -> None:
        if not 0.0 <= rate <= 1.0:
            raise InvalidParameterError(f"audit rate must be in [0, 1], got {rate}")
        if max_pending < 1:
            raise InvalidParameterError(f"max_pending must be >= 1, got {max_pending}")
        self.rate = rate
        self.counts = AuditCounts()
        self._random = random.Random(seed)
        self._pending: deque[_Pending] = deque()
        self._max_pending = max_pending
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def snapshot(self) -> AuditCounts:
        """A consistent copy of :attr:`counts` (safe while another thread runs audits)."""
        with self._lock:
            return dataclasses.replace(self.counts, disagreements=[dict(d) for d in self.counts.disagreements])

    def select(self) -> bool:
        """Count one request and draw whether to audit it (probability ``rate``)."""
        with self._lock:
            self.counts.requests += 1
            chosen = self.rate > 0 and self._random.random() < self.rate
            self.counts.selected += chosen
            return chosen

    def submit(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, output: GenerationOutput, request_id: str = ""
    ) -> bool:
        """Count a delivered request; queue it for audit if drawn. Returns whether it was queued."""
        if not self.select():
            return False
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self.counts.dropped += 1
                return False
            self._pending.append(_Pending(request_id, list(prompt_token_ids), params, output))
            return True

    def run_pending(self, engine: SpeculativeEngine, max_audits: int | None = None) -> list[AuditResult]:
        """Run queued audits (all, or ``max_audits``) on ``engine``; call it when the engine is idle."""
        results = []
        while max_audits is None or len(results) < max_audits:
            with self._lock:
                if not self._pending:
                    break
                job = self._pending.popleft()
            results.append(self.audit(engine, job.prompt_token_ids, job.params, job.output, request_id=job.request_id))
        return results

    def audit(
        self,
        engine: SpeculativeEngine,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        output: GenerationOutput,
        plain: GenerationOutput | None = None,
        request_id: str = "",
    ) -> AuditResult:
        """Audit one delivered ``output`` now and count it.

        ``plain``: the request's plain decoding when the caller already has it (a benchmark),
        otherwise it is decoded here with ``method="none"`` and the same parameters (seed too).
        A failure (e.g. the context no longer fits) is counted in ``failed`` and re-raised.
        """
        try:
            plain = plain or engine.generate(prompt_token_ids, params, PLAIN, learn=False)  # not a user's request
            if params.is_greedy:
                diff = first_difference(output.token_ids, plain.token_ids)
                result = AuditResult(greedy=True, agreed=diff is None, first_difference=diff)
            else:
                ours = target_logprobs(engine.target, prompt_token_ids, output.token_ids, params)
                theirs = target_logprobs(engine.target, prompt_token_ids, plain.token_ids, params)
                result = AuditResult(
                    greedy=False,
                    output_logprob_sum=float(ours.sum()),
                    output_tokens=len(ours),
                    plain_logprob_sum=float(theirs.sum()),
                    plain_tokens=len(theirs),
                )
        except Exception:
            with self._lock:
                self.counts.failed += 1
            raise
        with self._lock:
            self._count(result, request_id)
        return result

    def _count(self, result: AuditResult, request_id: str) -> None:
        counts = self.counts
        counts.audited += 1
        if not result.greedy:
            counts.sampled += 1
            counts.output_logprob_sum += result.output_logprob_sum
            counts.output_logprob_tokens += result.output_tokens
            counts.plain_logprob_sum += result.plain_logprob_sum
            counts.plain_logprob_tokens += result.plain_tokens
        elif result.agreed:
            counts.agreed += 1
        else:
            counts.disagreed += 1
            if len(counts.disagreements) < MAX_DISAGREEMENTS_KEPT:
                counts.disagreements.append({"request": request_id, "first_difference": result.first_difference})


def describe_audit(result: AuditResult) -> str:
    """One line for people: agreement (greedy) or the two log-probabilities (sampling)."""
    if result.greedy:
        if result.agreed:
            return "output equals plain decoding token for token"
        return f"output DIFFERS from plain decoding from token {result.first_difference} on"
    ours = result.output_logprob_sum / result.output_tokens if result.output_tokens else float("nan")
    theirs = result.plain_logprob_sum / result.plain_tokens if result.plain_tokens else float("nan")
    return (
        f"target log-prob per token: output {ours:.3f}, plain sample {theirs:.3f} "
        "(sampling: not compared token by token)"
    )
