"""The one generate loop: propose -> verify -> commit -> rollback.

Plain decoding is the same loop with no drafter (zero draft tokens per step), so the baseline
and every speculative method share prefill, sampling, stops and metrics. Which drafter drafts
and how many tokens is decided per step by a :class:`verispec.policy.DraftPolicy`. Knows nothing about
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

from verispec.control import SCHEDULES, ControllerConfig, CostModel
from verispec.errors import ContextLengthError, InvalidParameterError
from verispec.metrics import RequestMetrics, RequestTimes, SpecDecodeStats
from verispec.output import Detokenizer, OutputBuilder
from verispec.policy import DraftPolicy, make_policy
from verispec.proposers import DraftOutput, DraftRequest, Proposer
from verispec.proposers.ngram import NgramProposer, NgramTreeProposer
from verispec.runners import Runner, prefill
from verispec.sampling import ProcessedRows, SamplingParams, process_logits, sample_from
from verispec.tree import (
    TokenTree,
    TreeVerifyResult,
    greedy_tree_verify,
    tree_attention_mask,
    tree_position_ids,
    tree_rejection_sample,
)
from verispec.verify import VerifyResult, greedy_verify, pad_vocab, rejection_sample

METHODS = ("none", "draft", "ngram", "layer-skip", "auto", "tree")
MAX_SPECULATIVE_TOKENS = 64
TARGET_SOURCE = "target"  # token_sources entry of a token the target chose (not a draft token)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate for one request.

    Attributes:
        method: ``"none"`` (plain decoding), the name of a loaded drafter (``"draft"``,
            ``"ngram"``, ``"layer-skip"``) or ``"auto"`` (n-gram lookup when it matches, else
            the draft model, else layer skip; decided per step) or ``"tree"`` (token trees:
            n-gram branches when the lookup matches, else the draft model's tree; per step).
        num_speculative_tokens: tokens drafted per target pass, 1..64 (ignored for ``none``):
            the draft length of the ``constant`` schedule, the upper bound of the others; for
            ``tree``, the number of tree nodes verified per target pass.
        schedule: ``"constant"``, ``"heuristic"`` (+2 after a full accept, -1 otherwise) or
            ``"cost"`` (the k maximising expected tokens per unit of measured time; may switch
            speculation off; for ``tree``, the node budget maximising the realised accepted
            length per unit time, also switching off: :class:`verispec.control_tree.TreeBudgetSchedule`);
            see :mod:`verispec.control`.
        draft_stop_threshold: a model drafter stops drafting once its own top probability for
            the token it just drafted is below this, in [0, 1); 0 disables.
    Raises:
        InvalidParameterError: unknown method or schedule, or an out-of-range number.
    """

    method: str = "draft"
    num_speculative_tokens: int = 5
    schedule: str = "constant"
    draft_stop_threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidParameterError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidParameterError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}"
            )
        if self.schedule not in SCHEDULES:
            raise InvalidParameterError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not 0.0 <= self.draft_stop_threshold < 1.0:
            raise InvalidParameterError(f"draft_stop_threshold must be in [0, 1), got {self.draft_stop_threshold}")


@dataclass
class GenerationOutput:
    """Result of one request: ``token_ids`` ``[output_tokens]``, its text, why it ended, metrics.

    ``token_sources`` ``[output_tokens]``: for each output token, the drafter whose accepted
    draft token it was, or ``"target"`` (first token, recovered and bonus tokens, plain steps).
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    token_sources: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(),
            "token_sources": self.token_sources,
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
        proposers: drafters by method name (e.g. ``{"draft": DraftModelProposer(...)}``);
            ``"ngram"`` (prompt lookup, no model) is added with default n-gram sizes if absent.
        controller: knobs of the draft-length controller (:class:`ControllerConfig`).
    """

    def __init__(
        self,
        target: Runner,
        tokenizer: Detokenizer,
        *,
        eos_token_ids: Sequence[int],
        proposers: Mapping[str, Proposer] | None = None,
        controller: ControllerConfig | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.proposers = dict(proposers or {})
        self.proposers.setdefault("ngram", NgramProposer())
        if isinstance(self.proposers["ngram"], NgramProposer):  # method "tree": its branches first
            self.proposers.setdefault("ngram-tree", NgramTreeProposer(self.proposers["ngram"]))
        self.controller = controller or ControllerConfig()
        self.cost_model = CostModel(weight=self.controller.cost_weight)  # machine facts: kept across requests

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
        policy = self._check_request(prompt, spec)
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
        sources = [TARGET_SOURCE] * len(out.token_ids)

        while not out.finished:
            yield StreamChunk(out.take_delta(), committed)
            cached = self.target.num_cached_tokens
            room = self.target.max_context_length - cached - 2  # new tokens land at cached+1...
            if room < 0:
                committed = []
                out.finish("length")
                break
            limit = min(params.max_tokens - len(out.token_ids) - 1, room)  # draft tokens that fit
            request = DraftRequest(prompt, out.token_ids, params, generator, spec.draft_stop_threshold)
            step = policy.draft(request, limit)
            times.draft_s += step.draft_s
            draft_token_ids = step.draft.draft_token_ids
            start = time.perf_counter()
            if step.draft.tree is None:
                logits = self._timed_target(times, lambda: self.target.forward([pending] + draft_token_ids))
                result = self._verify(logits, draft_token_ids, step.draft, params, prompt, out.token_ids, generator)
                self.target.truncate(cached + 1 + result.num_accepted_tokens)
            else:
                result = self._verify_tree(step.draft.tree, times, params, prompt, out.token_ids, generator)
            verify_s = time.perf_counter() - start
            accepted_nodes = result.accepted_nodes if step.draft.tree is not None else None
            realised = policy.observe(step, result.num_accepted_tokens, verify_s, accepted_nodes)
            stats.record(len(draft_token_ids), result.num_accepted_tokens, len(out.token_ids), step.drafter)
            if policy.active and limit > 0:  # a step with no room to draft says nothing about control
                stats.record_control(step.chosen_k, step.predicted, realised)
            num_before = len(out.token_ids)
            for i, token_id in enumerate(result.token_ids):
                finished = out.append(token_id)
                if len(out.token_ids) > len(sources):
                    sources.append(step.drafter if i < result.num_accepted_tokens else TARGET_SOURCE)
                if finished:
                    break
            committed = out.token_ids[num_before:]
            pending = result.token_ids[-1]

        times.end = time.perf_counter()
        metrics = RequestMetrics.from_times(times, len(prompt), len(out.token_ids), stats)
        output = GenerationOutput(list(out.token_ids), out.text, out.finish_reason or "length", metrics, sources)
        yield StreamChunk(out.take_delta(), committed, output)

    def _check_request(self, prompt: list[int], spec: SpeculativeConfig) -> DraftPolicy:
        if not prompt:
            raise InvalidParameterError("the prompt is empty: give at least one token")
        if len(prompt) >= self.target.max_context_length:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the target's context window is "
                f"{self.target.max_context_length}: shorten the prompt"
            )
        if spec.method == "tree" and not hasattr(self.target, "forward_tree"):
            raise InvalidParameterError(
                f"the {type(self.target).__name__} cannot verify token trees: use a chain method or another runner"
            )
        return make_policy(
            spec.method, self.proposers, spec.schedule, spec.num_speculative_tokens, self.cost_model, self.controller,
            trees=hasattr(self.target, "forward_tree"),
        )

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


    def _verify_tree(
        self,
        tree: TokenTree,
        times: RequestTimes,
        params: SamplingParams,
        prompt: list[int],
        output_token_ids: list[int],
        generator: torch.Generator,
    ) -> TreeVerifyResult:
        """Score every node of ``tree`` in one target pass, verify, keep the accepted path's KV."""
        cached = self.target.num_cached_tokens
        if not hasattr(self.target, "forward_tree"):
            raise InvalidParameterError("the target runner cannot verify token trees: use a chain method")
        logits = self._timed_target(
            times,
            lambda: self.target.forward_tree(
                list(tree.token_ids), tree_position_ids(tree, cached), tree_attention_mask(tree, cached)
            ),
        )
        if params.has_penalties:  # each node's penalties see its own path, as plain decoding would
            rows = [
                process_logits(
                    logits[i : i + 1], params, prompt,
                    list(output_token_ids) + [tree.token_ids[j] for j in tree.path_to(i)],
                )
                for i in range(tree.num_nodes)
            ]
            greedy = rows[0].greedy_token_ids is not None
            processed = torch.cat([r.greedy_token_ids if greedy else r.probs for r in rows])
        else:
            rows1 = process_logits(logits, params, prompt, output_token_ids)
            greedy = rows1.greedy_token_ids is not None
            processed = rows1.greedy_token_ids if greedy else rows1.probs
        if greedy:
            result = greedy_tree_verify(tree, processed)
        else:
            result = tree_rejection_sample(tree, processed, generator)
        self.target.keep_tree_path(cached, [0] + result.accepted_nodes)
        return result


def _pick(rows: ProcessedRows, generator: torch.Generator) -> int:
    """The token plain decoding takes from a single processed row."""
    if rows.greedy_token_ids is not None:
        return int(rows.greedy_token_ids[0])
    return sample_from(rows.probs[0], generator)
