"""The one generate loop: a step is plan -> draft -> forward -> verify -> commit.

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

import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from verispec.algorithms.control import ControllerConfig, CostModel
from verispec.algorithms.sampling import SamplingParams
from verispec.engine.commit import Plan, commit, commit_prefill, draft_plans, finish, report, verify
from verispec.engine.constraints import GrammarCompiler, TokenConstraints
from verispec.engine.methods import drafter_order, needs_trees
from verispec.engine.policy import make_policy
from verispec.engine.prefix_cache import PrefixCache
from verispec.engine.prefix_reuse import end_request, keep_finished, keep_prompt, new_prefix_state, read_prefix
from verispec.engine.request import (
    GenerationOutput,
    SpeculativeConfig,
    StreamChunk,
)
from verispec.engine.state import RequestState, Slot, capture_features, check_draft_widths
from verispec.errors import ContextLengthError, InvalidParameterError
from verispec.output import Detokenizer, OutputBuilder
from verispec.proposers.base import DraftRequest, Proposer
from verispec.proposers.factory import for_new_sequence, with_lookup_drafters
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
            request alone prefills in passes of the target's :attr:`Runner.prefill_chunk_rows`.
        prefix_cache: automatic prefix caching across requests
            (:class:`verispec.engine.prefix_cache.PrefixCache`): a request reads the longest prefix
            of its prompt that an earlier or running request computed, and prefills only the rest;
            its prompt and answer are kept for the next. None: every prompt is computed. The output
            is the same bits either way (batch-invariant runners: :attr:`Runner.exports_kv`).

    Raises:
        InvalidParameterError: a target that is not a :class:`Runner`, ``max_num_batched_tokens``
            below 1, or a prefix cache over a target that cannot copy its cache out.
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
        prefix_cache: PrefixCache | None = None,
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
        if prefix_cache is not None and not target.exports_kv:
            raise InvalidParameterError(
                f"the {type(target).__name__} cannot copy its KV cache out: "
                "no prefix cache on it (--prefix-cache-gib 0)"
            )
        self.prefix_cache = prefix_cache
        self.slot = Slot(target, self.proposers)
        self.last_pass_rows = 0  # rows of the last pass: prefill chunks and verify rows
        self.last_pass_num_seqs = 0  # sequences in the last pass
        self._grammar_compiler: GrammarCompiler | None = None

    def with_proposers(self, proposers: Mapping[str, Proposer]) -> SpeculativeEngine:
        """Another engine over the same target, controller and measured costs, drafting with
        ``proposers`` (e.g. the same drafters over fresh caches)."""
        engine = SpeculativeEngine(
            self.target,
            self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            proposers=proposers,
            controller=self.controller,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefix_cache=self.prefix_cache,
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
        try:
            while not state.finished:
                chunk = self.step([state])[0]
                if chunk is not None:
                    yield chunk
        finally:  # a consumer that stops early (or a failed pass): the prefix cache lets go of its blocks
            if not state.finished:
                self.end(state, failed=True)

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
        state = RequestState(prompt, params, spec, slot, policy, generator, out, self._constraints(params), learn=learn)
        if self.prefix_cache is not None and params.prompt_logprobs is None:  # those need every prompt row
            state.prefix = new_prefix_state(self.prefix_cache, state)
        return state

    def end(self, state: RequestState, *, failed: bool = False) -> None:
        """A request leaves before it finished (cancelled, or ``failed`` in a pass): the prefix
        cache keeps what its caches hold (not after a failure) and lets go of its blocks. Call it
        before the slot is released or reused; a finished request needs no call (:meth:`step`)."""
        if state.prefix is not None and self.prefix_cache is not None:
            end_request(self.prefix_cache, state, failed=failed)

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

        plan -> draft -> forward -> verify -> commit: each request plans its share of the pass (a
        prefill chunk, or the draft tokens that fit), the policies draft for the decoding ones
        (:func:`verispec.engine.policy.draft_batch`: each draft length chosen for a pass holding
        the other requests' rows too; tokens a request's grammar forces are its draft, free:
        :func:`verispec.engine.commit.draft_plans`), one :func:`verispec.runners.forward_batch` scores every
        prefill chunk, draft chain and draft tree, and each request then verifies, reports the
        outcome to its policy, commits, rolls back and stops on its own. On a batch-invariant
        runner each request's rows are the rows it would get alone, so its output is the output
        it would have alone.

        Returns, per state, the chunk this pass committed (the last one of a request carries
        ``output``), or None (a prefill chunk that is not the prompt's last, or finished before).
        """
        chunks: dict[int, StreamChunk] = {}
        batch_size = sum(not s.finished and not s.prefilling for s in states)
        plans = self._plan(states, chunks)
        draft_plans([plan for plan in plans if not plan.prefill], batch_size)
        if not plans:
            return self._ended(states, chunks)
        logits, pass_s, rows = self._forward(plans)
        for plan, plan_logits in zip(plans, logits):
            if plan.prefill:
                chunk = commit_prefill(plan, plan_logits, self.cost_model)
                if plan.state.prefix is not None:  # the prefix cache keeps its full blocks at once
                    keep_prompt(self.prefix_cache, plan.state)
            else:
                verified = verify(plan, plan_logits)
                report(plan, verified, pass_s, rows - len(plan.call.token_ids))
                chunk = commit(plan, verified, self.cost_model)
            if chunk is not None:
                chunks[id(plan.state)] = chunk
        return self._ended(states, chunks)

    def _ended(self, states: Sequence[RequestState], chunks: dict[int, StreamChunk]) -> list[StreamChunk | None]:
        """Each state's chunk of this step, in order; the prefix cache keeps the prompt and answer
        of each request that finished in it (for a conversation's next turn)."""
        if self.prefix_cache is not None:
            keep_finished(self.prefix_cache, [s for s in states if id(s) in chunks])
        return [chunks.get(id(state)) for state in states]

    def _plan(self, states: Sequence[RequestState], chunks: dict[int, StreamChunk]) -> list[Plan]:
        """Each unfinished request's share of the pass, in order: a prefill chunk (within
        :attr:`max_num_batched_tokens`, or the runner's ``prefill_chunk_rows`` alone) or a decode step; a request whose
        context window is full finishes here (its chunk in ``chunks``)."""
        plans = []
        alone = sum(not s.finished for s in states) == 1
        # a request alone prefills in the runner's most efficient passes (None: at once)
        prefill_budget = self.target.prefill_chunk_rows if alone else self.max_num_batched_tokens
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
                plan = self._plan_decode(state)
                if plan is None:  # no room left in the context window
                    chunks[id(state)] = finish(state, self.cost_model, [])
                    continue
            plans.append(plan)
        return plans

    def _forward(self, plans: list[Plan]) -> tuple[list[torch.Tensor], float, int]:
        """One target pass over every plan's rows: each plan's logits, the pass's seconds and its
        rows (a verify pass's cost is recorded once per pass; prefill passes are not)."""
        start = time.perf_counter()
        logits = forward_batch([plan.call for plan in plans])
        pass_s = time.perf_counter() - start
        rows = sum(len(plan.call.token_ids) for plan in plans)
        if not any(plan.prefill for plan in plans):  # a verify pass (prefill passes are not)
            self.cost_model.record_verify(rows - 1, pass_s)  # rows of all requests: once per pass
        self.last_pass_rows, self.last_pass_num_seqs = rows, len(plans)
        for plan in plans:
            plan.state.times.target_s += pass_s
            plan.state.times.num_target_forwards += 1
        return logits, pass_s, rows

    def _plan_prefill(self, state: RequestState, budget: int | None) -> Plan | None:
        if budget is not None and budget <= 0:
            return None
        if state.num_prefilled == 0:
            state.slot.target.truncate(0)
        if state.prefix is not None:  # the longest cached prefix first: computed once, by whoever came first
            read_prefix(self.prefix_cache, state)
        end = len(state.prompt) if budget is None else min(len(state.prompt), state.num_prefilled + budget)
        chunk = state.prompt[state.num_prefilled : end]
        num_logits = 1 if end == len(state.prompt) else 0
        if state.params.prompt_logprobs is not None:
            num_logits = len(chunk)  # every row scores the next prompt token
        return Plan(state, ForwardCall(state.slot.target, chunk, num_logits=num_logits))

    def _plan_decode(self, state: RequestState) -> Plan | None:
        """The request's decode step before its draft: the draft tokens that fit and what the
        drafters see; None when the context window is full."""
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
        return Plan(state, None, cached, limit, None, request)

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
        if needs_trees(spec.method) and not self.target.supports_trees:
            raise InvalidParameterError(
                f"the {type(self.target).__name__} cannot verify token trees: use a chain method or another runner"
            )
        drafter_order(spec.method, list(self.proposers), self.target.supports_trees)
