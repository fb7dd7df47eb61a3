"""The one generate loop: propose -> verify -> commit -> rollback.

Plain decoding is the same loop with no drafter (zero draft tokens per step), so the baseline
and every speculative method share prefill, sampling, stops and metrics. Which drafter drafts
and how many tokens is decided per step by a :class:`verispec.engine.policy.DraftPolicy`. Knows nothing about
tokenization beyond handing token ids to :class:`verispec.output.OutputBuilder`, and nothing
about how a runner or drafter computes.

Invariant between steps: the target's KV cache holds every committed token except the last one
(``pending``), whose logits are computed by the next verify pass together with the draft.
:meth:`SpeculativeEngine.step` advances several requests (each on its own sequence slot) by one
target pass; a single request is a batch of one, so there is one loop for both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from verispec.algorithms.control import ControllerConfig, CostModel
from verispec.algorithms.sampling import SamplingParams
from verispec.engine.commit import Plan, commit, finish, verify_call
from verispec.engine.constraints import GrammarCompiler, TokenConstraints, cut_draft
from verispec.engine.policy import DraftStep, drafter_order, make_policy
from verispec.engine.request import (
    GenerationOutput,
    SpeculativeConfig,
    StreamChunk,
)
from verispec.engine.state import RequestState, Slot
from verispec.errors import ContextLengthError, IncompatibleDraftError, InvalidParameterError
from verispec.output import Detokenizer, OutputBuilder
from verispec.proposers.base import DraftRequest, Proposer
from verispec.proposers.factory import for_new_sequence, with_lookup_drafters, with_own_suffix_cache
from verispec.runners import ForwardCall, Runner, forward_batch

DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # prompt tokens per pass while others decode (vLLM's name)


class SpeculativeEngine:
    """Generates with a target runner and optional drafters, losslessly.

    Args:
        target: the target model's runner; its output defines the result.
        tokenizer: decodes token ids to text (``decode(ids, skip_special_tokens=True)``).
        eos_token_ids: tokens that end generation.
        proposers: drafters by method name (e.g. ``{"draft": DraftModelProposer(...)}``);
            ``"ngram"`` (prompt lookup, no model) is added with default n-gram sizes if absent.
        controller: knobs of the draft-length controller (:class:`ControllerConfig`).
        max_num_batched_tokens: prompt tokens prefilled per pass when other requests share it
            (chunked prefill, first come first served: a long prompt does not stall the batch,
            and the first request's first token does not wait for the others' prompts); a
            request alone prefills its whole prompt in one pass.
    """

    def __init__(
        self,
        target: Runner,
        tokenizer: Detokenizer,
        *,
        eos_token_ids: Sequence[int],
        proposers: Mapping[str, Proposer] | None = None,
        controller: ControllerConfig | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> None:
        if not isinstance(target, Runner):
            raise InvalidParameterError(
                f"the target is a {type(target).__name__}: runners subclass verispec.runners.Runner"
            )
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.proposers = with_lookup_drafters(proposers)  # n-gram and suffix lookup, and their trees
        check_draft_widths(target, self.proposers, tokenizer)
        capture_features(target, self.proposers.values())
        self.controller = controller or ControllerConfig()
        self.cost_model = CostModel(weight=self.controller.cost_weight)  # machine facts: kept across requests
        if max_num_batched_tokens < 1:
            raise InvalidParameterError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slot = Slot(target, self.proposers)
        self.last_pass_rows = 0  # rows of the last pass: prefill chunks and verify rows
        self.last_pass_num_seqs = 0  # sequences in the last pass
        self._grammar_compiler: GrammarCompiler | None = None

    def with_own_suffix_cache(self) -> SpeculativeEngine:
        """Another engine over the same target, drafters, controller and measured costs, whose
        suffix drafter has its own empty cache (same settings and datastore).

        Benchmarks give each method one: a method run after another on the same prompt must not
        be drafted from the other's answer (a cache shared across methods would be).
        """
        engine = SpeculativeEngine(
            self.target,
            self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            proposers=with_own_suffix_cache(self.proposers),
            controller=self.controller,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        engine.cost_model = self.cost_model  # the machine's measured costs, as this engine's requests see them
        return engine

    @property
    def supports_batching(self) -> bool:
        """The target runner and every drafter can hold more sequences (:meth:`new_slot`)."""
        return self.target.holds_sequences and all(p.holds_sequences for p in self.proposers.values())

    def new_slot(self) -> Slot:
        """Another sequence slot over the same models: a new target sequence, each drafter's own.

        Raises:
            InvalidParameterError: the target runner or a drafter holds one sequence only.
        """
        if not self.supports_batching:
            raise InvalidParameterError(
                f"the {type(self.target).__name__} (or a drafter) holds one sequence: batching needs the gguf, "
                "int8 or torch runner (or --max-num-seqs 1)"
            )
        return Slot(self.target.new_sequence(), for_new_sequence(self.proposers))

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        spec: SpeculativeConfig | None = None,
        *,
        learn: bool = True,
    ) -> GenerationOutput:
        """Run a request to completion; see :meth:`stream` for arguments and errors."""
        for chunk in self.stream(prompt_token_ids, params, spec, learn=learn):
            if chunk.output is not None:
                return chunk.output
        raise AssertionError("stream ended without an output")  # pragma: no cover

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        spec: SpeculativeConfig | None = None,
        *,
        learn: bool = True,
    ) -> Iterator[StreamChunk]:
        """Generate, yielding a chunk per target pass; the last chunk carries the output.

        A batch of one through :meth:`step`. Greedy output is token-identical to plain greedy
        decoding; sampled output has the target's distribution (see :mod:`verispec.algorithms.verify`).
        ``learn``: the suffix drafter's cache keeps the answer, and the cost model its length
        (False for warm-ups, audits and other runs that are not users' requests).

        Raises:
            InvalidParameterError: empty prompt, or a method whose drafter is not loaded.
            ContextLengthError: the prompt leaves no room in the target's context window.
        """
        state = self.start(prompt_token_ids, params, spec, learn=learn)
        while True:
            chunk = self.step([state])[0]
            if chunk is not None:
                yield chunk
            if state.finished:
                return

    def start(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        spec: SpeculativeConfig | None = None,
        slot: Slot | None = None,
        *,
        learn: bool = True,
    ) -> RequestState:
        """A new request on ``slot`` (default: the engine's own), to be advanced by :meth:`step`;
        ``learn``: as for :meth:`stream`.

        Raises:
            InvalidParameterError: empty prompt, or a method whose drafter is not loaded.
            ContextLengthError: the prompt leaves no room in the target's context window.
        """
        params = params or SamplingParams()
        spec = spec or SpeculativeConfig()
        slot = slot or self.slot
        prompt = [int(t) for t in prompt_token_ids]
        self.check_request(prompt, spec)
        policy = make_policy(
            spec.method,
            slot.proposers,
            spec.schedule,
            spec.num_speculative_tokens,
            self.cost_model,
            self.controller,
            trees=self.target.supports_trees,
        )
        generator = torch.Generator()
        generator.manual_seed(params.seed) if params.seed is not None else generator.seed()
        out = OutputBuilder(
            self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            stop=params.stop,
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
        )
        return RequestState(prompt, params, spec, slot, policy, generator, out, self._constraints(params), learn=learn)

    def _constraints(self, params: SamplingParams) -> TokenConstraints:
        """The request's masks; its grammar compiled against the target's tokenizer (built once).

        Raises:
            InvalidParameterError: the structured output does not compile.
        """
        matcher = None
        if params.structured_output is not None:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.target.vocab_size, self.eos_token_ids)
            matcher = self._grammar_compiler.matcher(params.structured_output)
        stop_ids = () if params.ignore_eos else self.eos_token_ids
        return TokenConstraints(
            self.target.vocab_size, stop_ids, params.min_tokens, matcher, end_token_ids=self.eos_token_ids
        )

    def step(self, states: Sequence[RequestState]) -> list[StreamChunk | None]:
        """One target pass over every unfinished request of ``states`` (each on its own slot).

        Each request drafts with its own policy (its draft length chosen for a pass holding the
        other requests' rows too), then one :func:`verispec.runners.forward_batch` scores every
        prefill chunk, draft chain and draft tree; each request then verifies, commits, rolls
        back and stops on its own. On a batch-invariant runner each request's rows are the rows
        it would get alone, so its output is the output it would have alone.

        Returns, per state, the chunk this pass committed (the last one of a request carries
        ``output``), or None (a prefill chunk that is not the prompt's last, or finished before).
        """
        plans, chunks = [], {}
        decoding = [s for s in states if not s.finished and not s.prefilling]
        alone = sum(not s.finished for s in states) == 1
        prefill_budget = None if alone else self.max_num_batched_tokens  # a request alone prefills at once
        for state in states:
            if state.finished:
                continue
            if state.prefilling:
                plan = self._plan_prefill(state, prefill_budget)
                if plan is None:
                    continue
                if prefill_budget is not None:
                    prefill_budget -= len(plan.call.token_ids)
            else:
                plan = self._plan_decode(state, len(decoding))
                if plan is None:  # no room left in the context window
                    chunks[id(state)] = finish(state, self.cost_model, [])
                    continue
            plans.append(plan)
        self._run_deferred_drafts([plan for plan in plans if plan.step is not None and plan.step.deferred])
        for plan in plans:
            if plan.step is not None:
                plan.state.times.draft_s += plan.step.draft_s
                plan.step = self._constrain_draft(plan.state, plan.step)
                plan.call = verify_call(plan)
        if plans:
            start = time.perf_counter()
            logits = forward_batch([plan.call for plan in plans])
            pass_s = time.perf_counter() - start
            rows = sum(len(plan.call.token_ids) for plan in plans)
            if all(plan.step is not None for plan in plans):  # a verify pass (prefill passes are not)
                self.cost_model.record_verify(rows - 1, pass_s)  # rows of all requests: once per pass
            self.last_pass_rows, self.last_pass_num_seqs = rows, len(plans)
            for plan, plan_logits in zip(plans, logits):
                plan.state.times.target_s += pass_s
                plan.state.times.num_target_forwards += 1
                chunk = commit(plan, plan_logits, pass_s, rows - len(plan.call.token_ids), self.cost_model)
                if chunk is not None:
                    chunks[id(plan.state)] = chunk
        return [chunks.get(id(state)) for state in states]

    def _plan_prefill(self, state: RequestState, budget: int | None) -> Plan | None:
        if budget is not None and budget <= 0:
            return None
        if state.num_prefilled == 0:
            state.slot.target.truncate(0)
        end = len(state.prompt) if budget is None else min(len(state.prompt), state.num_prefilled + budget)
        chunk = state.prompt[state.num_prefilled : end]
        num_logits = 1 if end == len(state.prompt) else 0
        if state.params.prompt_logprobs is not None:
            num_logits = len(chunk)  # every row scores the next prompt token
        return Plan(state, ForwardCall(state.slot.target, chunk, num_logits=num_logits))

    def _plan_decode(self, state: RequestState, batch_size: int) -> Plan | None:
        """The request's draft decision (a model drafter's proposal deferred to
        :meth:`_run_deferred_drafts`); None when the context window is full."""
        target, out = state.slot.target, state.out
        cached = target.num_cached_tokens
        room = target.max_context_length - cached - 2  # new tokens land at cached+1...
        if room < 0:
            return None
        limit = min(state.params.max_tokens - len(out.token_ids) - 1, room)  # draft tokens that fit
        request = DraftRequest(
            state.prompt,
            out.token_ids,
            state.params,
            state.generator,
            state.spec.draft_stop_threshold,
            state.constraints if state.constraints.active else None,
            target.vocab_size,
        )
        step = state.policy.draft(request, limit, batch_size=batch_size, defer=state.slot.batched_drafters)
        return Plan(state, None, cached, limit, step, request)

    @staticmethod
    def _run_deferred_drafts(plans: list[Plan]) -> None:
        """The draft model's chains of every request that chose it, one draft pass per position
        (:meth:`verispec.proposers.base.Proposer.propose_batch`, by drafter type); each request's share of the time."""
        if not plans:
            return
        start = time.perf_counter()
        items = [(plan.state.policy.proposer(plan.step.drafter), plan.request, plan.step.deferred) for plan in plans]
        groups: dict = {}  # drafters that batch together: the same propose_batch
        for index, item in enumerate(items):
            groups.setdefault(type(item[0]).propose_batch, []).append(index)
        drafts: list = [None] * len(items)
        for propose_batch, indices in groups.items():
            for index, draft in zip(indices, propose_batch([items[i] for i in indices])):
                drafts[index] = draft
        share = (time.perf_counter() - start) / len(plans)
        for plan, draft in zip(plans, drafts):
            plan.step = plan.state.policy.complete(plan.step, draft, share, plan.request, alone=len(plans) == 1)

    @staticmethod
    def _constrain_draft(state: RequestState, step: DraftStep) -> DraftStep:
        """The step with its chain cut where the request's constraints refuse a token
        (:func:`verispec.engine.constraints.cut_draft`)."""
        if not state.constraints.active:
            return step
        draft = cut_draft(state.constraints, len(state.out.token_ids), step.draft, state.params.is_greedy)
        return step if draft is step.draft else dataclasses.replace(step, draft=draft)

    def check_request(self, prompt: Sequence[int], spec: SpeculativeConfig) -> None:
        """What :meth:`start` refuses, checked without starting anything (a grammar is compiled,
        and refused, only by :meth:`start`).

        Raises:
            InvalidParameterError: empty prompt, trees on a runner without them, or a method whose
                drafter is not loaded.
            ContextLengthError: the prompt leaves no room in the target's context window.
        """
        if not prompt:
            raise InvalidParameterError("the prompt is empty: give at least one token")
        if len(prompt) >= self.target.max_context_length:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the target's context window is "
                f"{self.target.max_context_length}: shorten the prompt"
            )
        if spec.method in ("tree", "eagle-tree") and not self.target.supports_trees:
            raise InvalidParameterError(
                f"the {type(self.target).__name__} cannot verify token trees: use a chain method or another runner"
            )
        drafter_order(spec.method, list(self.proposers), self.target.supports_trees)


def capture_features(target: Runner, proposers) -> None:
    """Make ``target`` record the hidden states the feature drafters read (EAGLE heads), for
    every row of every pass, where any drafter asks for them (``Proposer.feature_layers``).

    Raises:
        InvalidParameterError: drafters asking for different layers, or a runner that cannot
            hand out its hidden states.
    """
    layers = {tuple(p.feature_layers) for p in proposers if p.feature_layers}
    if not layers:
        return
    if len(layers) > 1:
        raise InvalidParameterError(
            f"the drafters read different target layers ({sorted(layers)}): load one feature drafter"
        )
    if not target.supports_features:
        raise InvalidParameterError(
            f"the {type(target).__name__} cannot hand its hidden states to a feature drafter (EAGLE head): "
            "use the gguf, int8 or torch runner"
        )
    target.capture_features(next(iter(layers)))


def check_draft_widths(target: Runner, proposers: Mapping[str, Proposer], tokenizer: Detokenizer) -> None:
    """Refuse a model drafter whose logits rows are not the target's width, unless both cover the
    tokenizer (``len(tokenizer)``; padded rows, as in Qwen2.5-7B's 152064 against 0.5B's 151936).

    Otherwise a token id of one model past the other's rows would end generation with an
    IndexError mid-request (:func:`verispec.models.compat.check_draft_compatibility` checks the
    tokenizers themselves when a pipeline loads).

    Raises:
        IncompatibleDraftError: naming the drafter and both widths.
    """
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    for name, proposer in proposers.items():
        runner = proposer.runner
        if runner is None or runner is target or runner.vocab_size == target.vocab_size:
            continue
        width = runner.vocab_size
        if size is None or min(width, target.vocab_size) < size:
            covered = "" if size is None else f" and the tokenizer has {size} tokens"
            raise IncompatibleDraftError(
                f"the {name} drafter's logits are {width} wide, the target's {target.vocab_size}{covered}: "
                "the draft must share the target's vocabulary"
            )
