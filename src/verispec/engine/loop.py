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
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch

from verispec.engine.constraints import GrammarCompiler, TokenConstraints, cut_draft
from verispec.spec.control import ControllerConfig, CostModel
from verispec.errors import ContextLengthError, InvalidParameterError
from verispec.metrics import RequestMetrics
from verispec.output import Detokenizer, OutputBuilder
from verispec.engine.policy import DraftStep, drafter_order, make_policy
from verispec.proposers import DraftRequest, Proposer, can_hold_sequences, for_new_sequence
from verispec.proposers.draft_model import propose_batch
from verispec.proposers.ngram import NgramProposer, NgramTreeProposer
from verispec.proposers.suffix import SuffixCache, SuffixProposer, SuffixTreeProposer
from verispec.engine.request import (
    GenerationOutput,
    SpeculativeConfig,
    StreamChunk,
)
from verispec.engine.state import RequestState, Slot
from verispec.runners import ForwardCall, Runner, forward_batch
from verispec.spec.sampling import SamplingParams, process_logits, token_logprobs
from verispec.spec.tree import tree_attention_mask, tree_position_ids
from verispec.spec.step import pick_token, verify_chain, verify_tree

DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # prompt tokens per pass while others decode (vLLM's name)
TARGET_SOURCE = "target"  # token_sources entry of a token the target chose (not a draft token)


@dataclass
class _Plan:
    """What one request does in a pass: a prefill chunk, a chain or a tree verify."""

    state: RequestState
    call: ForwardCall | None
    cached: int = 0
    limit: int = 0
    step: DraftStep | None = None
    request: DraftRequest | None = None


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
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.proposers = dict(proposers or {})
        self.proposers.setdefault("ngram", NgramProposer())
        if isinstance(self.proposers["ngram"], NgramProposer):  # method "tree": its branches first
            self.proposers.setdefault("ngram-tree", NgramTreeProposer(self.proposers["ngram"]))
        self.proposers.setdefault("suffix", SuffixProposer())  # one cache of past requests per engine
        if isinstance(self.proposers["suffix"], SuffixProposer):
            self.proposers.setdefault("suffix-tree", SuffixTreeProposer(self.proposers["suffix"]))
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
        suffix = self.proposers.get("suffix")
        fresh = suffix
        if isinstance(suffix, SuffixProposer):
            old = suffix.cache
            cache = SuffixCache(old.max_tokens, old.min_ngram, old.max_ngram, old.max_occurrences)
            fresh = SuffixProposer(cache, suffix.min_ngram, suffix.max_ngram, suffix.spec_factor, suffix.add_prompts,
                                   suffix.datastore)
        proposers = {  # every name the suffix drafter is loaded under; its tree is rebuilt over the new one
            name: fresh if p is suffix else p for name, p in self.proposers.items()
            if not (name == "suffix-tree" and isinstance(p, SuffixTreeProposer))
        }
        engine = SpeculativeEngine(self.target, self.tokenizer, eos_token_ids=self.eos_token_ids, proposers=proposers,
                                   controller=self.controller, max_num_batched_tokens=self.max_num_batched_tokens)
        engine.cost_model = self.cost_model  # the machine's measured costs, as this engine's requests see them
        return engine

    @property
    def supports_batching(self) -> bool:
        """The target runner and every drafter can hold more sequences (:meth:`new_slot`)."""
        return hasattr(self.target, "new_sequence") and all(
            can_hold_sequences(p) for p in self.proposers.values()
        )

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
        wrappers = {"ngram-tree": (NgramTreeProposer, "ngram", NgramProposer), "suffix-tree": (SuffixTreeProposer, "suffix", SuffixProposer)}
        proposers = {name: for_new_sequence(p) for name, p in self.proposers.items() if name not in wrappers}
        for name, (wrapper, base, base_type) in wrappers.items():
            tree = self.proposers.get(name)
            if isinstance(tree, wrapper) and isinstance(proposers.get(base), base_type):
                proposers[name] = wrapper(proposers[base])  # shares the slot's index
            elif tree is not None:
                proposers[name] = for_new_sequence(tree)
        return Slot(self.target.new_sequence(), proposers)

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
        decoding; sampled output has the target's distribution (see :mod:`verispec.spec.verify`).
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
            spec.method, slot.proposers, spec.schedule, spec.num_speculative_tokens, self.cost_model, self.controller,
            trees=hasattr(self.target, "forward_tree"),
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
        return TokenConstraints(self.target.vocab_size, stop_ids, params.min_tokens, matcher, end_token_ids=self.eos_token_ids)

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
                    chunks[id(state)] = self._finish(state, [])
                    continue
            plans.append(plan)
        self._run_deferred_drafts([plan for plan in plans if plan.step is not None and plan.step.deferred])
        for plan in plans:
            if plan.step is not None:
                plan.state.times.draft_s += plan.step.draft_s
                plan.step = self._constrain_draft(plan.state, plan.step)
                plan.call = self._verify_call(plan)
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
                chunk = self._commit(plan, plan_logits, pass_s, rows - len(plan.call.token_ids))
                if chunk is not None:
                    chunks[id(plan.state)] = chunk
        return [chunks.get(id(state)) for state in states]

    def _plan_prefill(self, state: RequestState, budget: int | None) -> _Plan | None:
        if budget is not None and budget <= 0:
            return None
        if state.num_prefilled == 0:
            state.slot.target.truncate(0)
        end = len(state.prompt) if budget is None else min(len(state.prompt), state.num_prefilled + budget)
        chunk = state.prompt[state.num_prefilled : end]
        num_logits = 1 if end == len(state.prompt) else 0
        if state.params.prompt_logprobs is not None:
            num_logits = len(chunk)  # every row scores the next prompt token
        return _Plan(state, ForwardCall(state.slot.target, chunk, num_logits=num_logits))

    def _plan_decode(self, state: RequestState, batch_size: int) -> _Plan | None:
        """The request's draft decision (a model drafter's proposal deferred to
        :meth:`_run_deferred_drafts`); None when the context window is full."""
        target, out = state.slot.target, state.out
        cached = target.num_cached_tokens
        room = target.max_context_length - cached - 2  # new tokens land at cached+1...
        if room < 0:
            return None
        limit = min(state.params.max_tokens - len(out.token_ids) - 1, room)  # draft tokens that fit
        request = DraftRequest(
            state.prompt, out.token_ids, state.params, state.generator, state.spec.draft_stop_threshold,
            state.constraints if state.constraints.active else None,
        )
        step = state.policy.draft(
            request, limit, batch_size=batch_size, defer=state.slot.batched_drafters
        )
        return _Plan(state, None, cached, limit, step, request)

    @staticmethod
    def _run_deferred_drafts(plans: list[_Plan]) -> None:
        """The draft model's chains of every request that chose it, one draft pass per position
        (:func:`verispec.proposers.draft_model.propose_batch`); each request's share of the time."""
        if not plans:
            return
        start = time.perf_counter()
        items = [(plan.state.policy.proposer(plan.step.drafter), plan.request, plan.step.deferred) for plan in plans]
        drafts = propose_batch(items)
        share = (time.perf_counter() - start) / len(plans)
        for plan, draft in zip(plans, drafts):
            plan.step = plan.state.policy.complete(plan.step, draft, share, plan.request, alone=len(plans) == 1)

    @staticmethod
    def _verify_call(plan: _Plan) -> ForwardCall:
        """The target rows of a decode step: the pending token and the chain, or the tree."""
        target, tree = plan.state.slot.target, plan.step.draft.tree
        if tree is None:
            return ForwardCall(target, [plan.state.pending] + plan.step.draft.draft_token_ids)
        cached = plan.cached
        return ForwardCall(target, list(tree.token_ids), None, tree_position_ids(tree, cached), tree_attention_mask(tree, cached))

    def _commit(self, plan: _Plan, logits: torch.Tensor, pass_s: float, base_rows: int) -> StreamChunk | None:
        state = plan.state
        out, params = state.out, state.params
        if plan.step is None:  # a prefill chunk
            first = state.num_prefilled
            state.num_prefilled += len(plan.call.token_ids)
            if params.prompt_logprobs is not None:  # row j scores prompt token first + j + 1
                for j, position in enumerate(range(first + 1, min(state.num_prefilled + 1, len(state.prompt)))):
                    state.prompt_logprobs.append(token_logprobs(logits[j], state.prompt[position], params.prompt_logprobs))
            if state.num_prefilled < len(state.prompt):
                return None
            rows = process_logits(logits[-1:], params, state.prompt, [], allowed=state.constraints.masks(0))
            state.pending = pick_token(rows, state.generator)
            out.append(state.pending)
            state.record_logprobs(rows.logits, [state.pending])
            state.constraints.commit(out.token_ids)
            state.times.first_token = time.perf_counter()
            state.sources = [TARGET_SOURCE] * len(out.token_ids)
            if out.finished:
                return self._finish(state, list(out.token_ids))
            prompt_logprobs = list(state.prompt_logprobs) if params.prompt_logprobs is not None else None
            return StreamChunk(out.take_delta(), list(out.token_ids), logprobs=state.chunk_logprobs(out.token_ids),
                               prompt_logprobs=prompt_logprobs)
        step, target = plan.step, state.slot.target
        draft_token_ids = step.draft.draft_token_ids
        constraints = state.constraints
        tree = step.draft.tree
        if tree is None:
            allowed = constraints.masks(len(out.token_ids), draft_token_ids)
            result, rows = verify_chain(logits, step.draft, params, state.prompt, out.token_ids, state.generator, allowed)
            target.truncate(plan.cached + 1 + result.num_accepted_tokens)
            accepted_nodes = None
            scoring_rows = list(range(len(result.token_ids)))
        else:
            paths = [[tree.token_ids[j] for j in tree.path_to(i)] for i in range(tree.num_nodes)] if constraints.active else []
            allowed = constraints.path_masks(len(out.token_ids), paths)
            result, rows = verify_tree(tree, logits, params, state.prompt, out.token_ids, state.generator, allowed)
            target.keep_tree_path(plan.cached, [0] + result.accepted_nodes)  # the accepted path's KV
            accepted_nodes = result.accepted_nodes
            scoring_rows = [0] + list(result.accepted_nodes)
        realised = state.policy.observe(step, result.num_accepted_tokens, pass_s, accepted_nodes, base_rows=base_rows)
        state.stats.record(len(draft_token_ids), result.num_accepted_tokens, len(out.token_ids), step.drafter)
        if state.policy.active and plan.limit > 0:  # a step with no room to draft says nothing about control
            state.stats.record_control(step.chosen_k, step.predicted, realised)
        num_before = len(out.token_ids)
        for i, token_id in enumerate(result.token_ids):
            finished = out.append(token_id)
            if len(out.token_ids) > len(state.sources):
                state.sources.append(step.drafter if i < result.num_accepted_tokens else TARGET_SOURCE)
            if finished:
                break
        committed = out.token_ids[num_before:]
        state.record_logprobs(rows, committed, scoring_rows)
        constraints.commit(committed)
        state.pending = result.token_ids[-1]
        if out.finished:
            return self._finish(state, committed)
        return StreamChunk(out.take_delta(), committed, logprobs=state.chunk_logprobs(committed))

    def _finish(self, state: RequestState, committed: list[int]) -> StreamChunk:
        out = state.out
        if not out.finished:
            out.finish("length")
        state.times.end = time.perf_counter()
        if state.learn:  # what a draft's catch-up is amortised over (not warm-ups' lengths)
            self.cost_model.record_output_length(len(out.token_ids))
            state.policy.finish(len(out.token_ids))
        # drafters that learn across requests (suffix), each once even if loaded under two names
        for proposer in {id(p): p for p in state.slot.proposers.values()}.values() if state.learn else ():
            end_request = getattr(proposer, "end_request", None)
            if end_request is not None:
                end_request(state.prompt, out.token_ids)
        metrics = RequestMetrics.from_times(state.times, len(state.prompt), len(out.token_ids), state.stats)
        state.output = GenerationOutput(
            list(out.token_ids), out.text, out.finish_reason or "length", metrics, state.sources,
            list(state.logprobs) if state.params.logprobs is not None else None,
            list(state.prompt_logprobs) if state.params.prompt_logprobs is not None else None,
        )
        return StreamChunk(out.take_delta(), committed, state.output, state.chunk_logprobs(committed))

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
        if spec.method == "tree" and not hasattr(self.target, "forward_tree"):
            raise InvalidParameterError(
                f"the {type(self.target).__name__} cannot verify token trees: use a chain method or another runner"
            )
        drafter_order(spec.method, list(self.proposers), hasattr(self.target, "forward_tree"))
