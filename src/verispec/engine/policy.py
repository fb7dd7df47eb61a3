"""Per-step drafting policy of one request: which drafter drafts, and how many tokens.

Owns, over the drafter order of the request's method (:mod:`verispec.engine.methods`), one
acceptance estimate and draft-length schedule per drafter, the timing of proposals (drafters that
batch draft for every request of a pass at once, :func:`draft_batch`) and the controller's
predictions; the order ``auto``'s drafters are tried in each step is
:class:`verispec.engine.ranking.DrafterRanking`'s. The engine's one loop asks it for the drafts of
a pass (:func:`draft_batch`) and reports each outcome back (:meth:`DraftPolicy.observe`). Knows
nothing about verification, caches or text.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from verispec.algorithms.control import (
    CATCH_UP_MIN_ROWS,
    AcceptanceEstimate,
    ControllerConfig,
    CostModel,
    catch_up_pays,
    expected_tokens,
)
from verispec.algorithms.schedules import (
    CostModelSchedule,
    TreeBudgetSchedule,
    confident_chain,
    make_schedule,
    sized_by_confidence,
)
from verispec.engine.methods import TREE_SCHEDULED, drafter_order
from verispec.engine.ranking import DrafterRanking
from verispec.proposers import DraftOutput, DraftRequest, Proposer


@dataclass
class DraftStep:
    """What the policy decided for one step.

    Attributes:
        drafter: name of the drafter whose tokens are in ``draft``; None for a plain step.
        chosen_k: draft length the schedule chose for that drafter (0 for a plain step).
        draft: the proposal (``draft_token_ids`` ``[num_draft_tokens]``, empty for a plain step).
        draft_s: seconds spent in proposals this step (failed n-gram lookups included).
        predicted: the controller's expectation for this step, ``(tokens, cost in plain
            decoding steps)``; None before the costs were measured.
        steady: the same drafter drafted the previous step too, so ``drafter_s`` (its own
            proposal's seconds) is a steady-state cost worth measuring.
        deferred: > 0 when the policy chose a drafter that drafts for many requests at once
            (:meth:`DraftPolicy.draft`'s ``defer``): the tokens to ask it for; :func:`draft_batch`
            asks it and completes the step.
        catch_up_rows: context tokens the drafter fed before drafting (a model drafter: 1-2 when
            steady, more when it catches up; 0 for lookups).
    """

    drafter: str | None = None
    chosen_k: int = 0
    draft: DraftOutput = field(default_factory=DraftOutput)
    draft_s: float = 0.0
    predicted: tuple[float, float] | None = None
    steady: bool = False
    drafter_s: float = 0.0
    deferred: int = 0
    catch_up_rows: int = 0


class DraftPolicy:
    """Chooses drafter and draft length per step for one request.

    Args:
        proposers: the drafters to try each step, in order (name, proposer).
        schedule: ``constant``, ``heuristic`` or ``cost`` (see :mod:`verispec.algorithms.control`).
        max_k: draft length of ``constant``; upper bound of the others.
        costs: the engine's measured costs (updated here).
        config: controller knobs.
    """

    def __init__(
        self,
        proposers: Sequence[tuple[str, Proposer]],
        schedule: str,
        max_k: int,
        costs: CostModel,
        config: ControllerConfig,
    ) -> None:
        self.costs = costs
        self._price_catch_up = config.price_catch_up
        self._probe_interval = config.probe_interval
        self._confident_chains, self._alpha_prior = config.confident_chains, config.alpha_prior
        self._carried_alpha_weight = config.carried_alpha_weight
        self._proposers = dict(proposers)
        self.alphas = {
            name: AcceptanceEstimate(costs.last_alpha.get(name, config.alpha_prior), config.alpha_weight)
            for name in self._proposers
        }
        self.schedules = {
            name: make_schedule(schedule, name, max_k, self.alphas[name], costs, config, tree=name in TREE_SCHEDULED)
            for name in self._proposers
        }
        self._previous: str | None = None  # drafter of the previous step
        self.ranking = DrafterRanking(list(self._proposers), costs, config)
        self.num_declined_catch_ups = 0  # steps a model drafter sat out: catching up would not pay
        self._caught_up_at: dict[str, int] = {}  # model drafter -> output tokens at its first catch-up
        self._tokens_from: dict[str, int] = {}  # model drafter -> tokens its steps emitted since

    @property
    def active(self) -> bool:
        """False for plain decoding (no drafter)."""
        return bool(self._proposers)

    def draft(self, request: DraftRequest, limit: int, batch_size: int = 1, defer: Collection[str] = ()) -> DraftStep:
        """Ask the drafters in order; the first non-empty proposal of at most ``limit`` tokens wins.

        ``batch_size``: requests decoding in the same target pass (continuous batching); the
        schedules price a draft by what it costs the whole batch (:meth:`CostModel.step_costs`).
        ``defer``: drafters :func:`draft_batch` runs for all requests at once: reaching one, the
        step comes back with ``deferred`` tokens to ask it for.

        With the ``cost`` schedule a model drafter that must first catch up (feed
        :data:`~verispec.algorithms.control.CATCH_UP_MIN_ROWS` or more context tokens it has not seen: its
        prefill at a request's first proposal, or the tokens other drafters' steps emitted) sits
        the step out when the catch-up would cost more than drafting the rest of the answer saves
        (:func:`~verispec.algorithms.control.catch_up_pays`, the rest estimated from the engine's recent
        output lengths, :meth:`CostModel.expected_remaining_tokens`, times the share of it the
        drafter's own steps have been emitting, :meth:`CostModel.record_coverage`). A probe of a
        switched-off drafter is priced at the prior acceptance."""
        spent = 0.0
        for name in self.ranking.step_order():
            proposer = self._proposers[name]
            k = self.schedules[name].next_k(batch_size)
            confidences = None  # the lookup's scores of its proposal, where it sized the draft by them
            if proposer.scores_own_drafts:  # a lookup sure of its match drafts more than the average
                start, prior = time.perf_counter(), self.alphas[name].alpha
                scores = _LastScores(functools.partial(proposer.draft_confidences, request, prior=prior))
                k = sized_by_confidence(self.schedules[name], scores, limit, batch_size, at_least=k)
                confidences = scores.last
                spent += time.perf_counter() - start
            num_tokens = min(k, limit)
            if num_tokens <= 0:
                continue
            predicted = self._predicted(name, num_tokens, batch_size)  # before this step's own timing
            if self.ranking.outrun(name, num_tokens, predicted, confidences, batch_size):
                continue
            # a drafter that drafted the previous step is steady (its cost per token covers what it
            # feeds, a tree's accepted path included); only one coming back to the request catches up
            rows = proposer.catch_up_rows(request) if self._previous != name else 0
            if not self._catch_up_pays(name, rows, predicted, request, limit, batch_size, num_tokens):
                self.num_declined_catch_ups += 1
                continue
            num_tokens = self._confident_chain(name, proposer, request, num_tokens, limit, batch_size)
            if name in defer:
                return DraftStep(name, k, DraftOutput(), spent, predicted, deferred=num_tokens, catch_up_rows=rows)
            start = time.perf_counter()
            draft = proposer.propose(request, num_tokens)
            seconds = time.perf_counter() - start
            spent += seconds
            draft = draft.at_most(num_tokens)
            if draft.draft_token_ids:
                return self._drafted(DraftStep(name, k, draft, spent, predicted, False, seconds, 0, rows), request)
        self._previous = None
        return self._plain_step(spent)

    def _confident_chain(
        self, name: str, proposer: Proposer, request: DraftRequest | None, k: int, limit: int, batch: int
    ) -> int:
        """Tokens to ask ``proposer`` for: the most :func:`confident_chain` allows where it sets
        ``request.continues`` (the rule that stops the chain); else ``k``."""
        if request is None or not (self._confident_chains and proposer.sizes_chain_by_confidence):
            return k
        chain = confident_chain(self.schedules[name], self.alphas[name].alpha, limit, batch)
        request.continues = chain[1] if chain else None
        return max(k, chain[0]) if chain else k

    def _plain_step(self, spent: float) -> DraftStep:
        """A step without a draft (``spent``: seconds of the proposals that came back empty)."""
        return DraftStep(None, 0, DraftOutput(), spent, (1.0, 1.0) if self.costs.plain_step_s() is not None else None)

    @property
    def batched(self) -> list[str]:
        """The drafters that draft for many requests at once (``Proposer.batches``: a draft
        model's chains, one draft pass per position): :func:`draft_batch` defers them."""
        return [name for name, proposer in self._proposers.items() if proposer.batches]

    def proposer(self, name: str) -> Proposer:
        """The drafter this policy calls ``name`` (a deferred step's :attr:`DraftStep.drafter`)."""
        return self._proposers[name]

    def complete_deferred(
        self, step: DraftStep, draft: DraftOutput, seconds: float, request: DraftRequest, alone: bool
    ) -> DraftStep:
        """Finish a deferred ``step`` with the proposal :func:`draft_batch` got (``seconds``: its
        share of the batched proposal's time; ``alone``: the proposal was this request's only, so a
        catch-up's cost is its own). An empty proposal makes it a plain step."""
        draft = draft.at_most(step.deferred)
        if not draft.draft_token_ids:
            self._previous = None
            return self._plain_step(step.draft_s + seconds)
        drafted = DraftStep(
            step.drafter,
            step.chosen_k,
            draft,
            step.draft_s + seconds,
            step.predicted,
            drafter_s=seconds,
            catch_up_rows=step.catch_up_rows,
        )
        return self._drafted(drafted, request, own_seconds=alone)

    def _drafted(self, step: DraftStep, request: DraftRequest, own_seconds: bool = True) -> DraftStep:
        """``step`` drafted tokens: mark it steady (the same drafter drafted the previous step) and
        time the steady state only; a drafter's first proposal of a request (its prefill) or its
        first after other steps (catching up on their tokens) costs more, once, and is recorded
        as a catch-up where its seconds are its own (``own_seconds``)."""
        name, num_tokens = step.drafter, len(step.draft.draft_token_ids)
        step.steady = self._previous == name
        if step.steady:
            self.costs.record_draft(name, num_tokens, step.drafter_s)
        else:
            if own_seconds:
                self._record_catch_up(name, step.catch_up_rows, num_tokens, step.drafter_s)
            self._mark_catch_up(name, step.catch_up_rows, request)
        self._previous = name
        return step

    def _catch_up_pays(
        self,
        name: str,
        rows: int,
        predicted: tuple[float, float] | None,
        request: DraftRequest,
        limit: int,
        batch_size: int,
        num_tokens: int,
    ) -> bool:
        """False when ``name`` must feed ``rows`` unseen context tokens first and that costs more
        than its steps over the rest of the answer save (cost schedules only; a probe of a
        switched-off drafter priced at the prior acceptance; unmeasured: True). The rest of the
        answer is scaled by the drafter's coverage (:meth:`CostModel.record_coverage`)."""
        if rows < CATCH_UP_MIN_ROWS or predicted is None or not self._price_catch_up:
            return True
        schedule = self.schedules[name]
        if not isinstance(schedule, (CostModelSchedule, TreeBudgetSchedule)):
            return True  # constant and heuristic draft lengths are the user's, whatever they cost
        if schedule.last_predicted_speedup is None:
            return True
        cost = self.costs.catch_up_cost(name, rows, batch_size)
        if cost is None:
            return True  # this proposal measures it
        speedup = predicted[0] / predicted[1]
        if schedule.last_predicted_speedup <= 1.0:
            # a probe of a switched-off drafter re-measures its acceptance: priced at the
            # acceptance assumed before any measurement, not at the estimate it is to re-check,
            # so a short answer does not pay a draft's prefill for it and a long one still does
            speedup = expected_tokens(self._alpha_prior, num_tokens) / predicted[1]
        remaining = self.costs.expected_remaining_tokens(len(request.output_token_ids), limit + 1)
        if catch_up_pays(speedup, remaining * self.costs.coverage.get(name, 1.0), cost):
            return True
        if schedule.last_predicted_speedup > 1.0 or not isinstance(schedule, CostModelSchedule):
            return False
        # A switched-off drafter is priced by its own last measurements: if those were taken while the
        # machine was slow, every request's probe is priced out and the drafter is never measured
        # again. So every probe_interval-th priced-out probe goes ahead, with a steady step after it.
        priced_out = self.costs.priced_out_probes.get(name, 0) + 1
        self.costs.priced_out_probes[name] = 0 if priced_out > self._probe_interval else priced_out
        if priced_out > self._probe_interval:
            schedule.follow_up()
            return True
        return False

    def _mark_catch_up(self, name: str, rows: int, request: DraftRequest) -> None:
        """``name`` caught up on ``rows`` tokens: from its first catch-up on, :meth:`finish`
        measures the share of the output its steps emit."""
        if rows >= CATCH_UP_MIN_ROWS and name not in self._caught_up_at:
            self._caught_up_at[name] = len(request.output_token_ids)
            self._tokens_from[name] = 0

    def finish(self, num_output_tokens: int) -> None:
        """The request ended with ``num_output_tokens``: record each model drafter's coverage
        since its first catch-up (:meth:`CostModel.record_coverage`). Call once, for users'
        requests only (a warm-up's share says nothing about the workload)."""
        for name, start in self._caught_up_at.items():
            self.costs.record_coverage(name, self._tokens_from[name], num_output_tokens - start)

    def _record_catch_up(self, name: str, rows: int, num_draft_tokens: int, seconds: float) -> None:
        """A proposal that caught up on ``rows`` tokens: its seconds beyond the steady cost."""
        per_token = self.costs.draft_token_s.get(name)
        if rows >= CATCH_UP_MIN_ROWS and per_token is not None:
            self.costs.record_catch_up(name, rows, seconds - num_draft_tokens * per_token)

    def observe(
        self,
        step: DraftStep,
        num_accepted_tokens: int,
        verify_s: float,
        accepted_nodes: Sequence[int] | None = None,
        base_rows: int = 0,
    ) -> tuple[float, float] | None:
        """Feed back a verified step: draft cost, acceptance, schedule, drafter (the target pass
        itself is timed once per pass by the engine: :meth:`CostModel.record_verify`).

        ``verify_s``: seconds of the target pass. ``accepted_nodes``: for a tree draft, the
        accepted path's node indices (a tree drafter's ``cost`` schedule learns the accepted
        length of every smaller budget from it). ``base_rows``: rows of other requests in the
        same pass. Returns the realised ``(tokens, cost in plain decoding steps)`` of the step,
        None while no plain step cost is known.
        """
        num_draft = len(step.draft.draft_token_ids)
        if step.drafter is not None and step.drafter not in self.alphas:  # a draft the grammar forced:
            self._previous = None  # the next model draft catches up on its tokens, not a steady step
        if step.steady:
            self.costs.record_draft_ratio(step.drafter, num_draft, step.drafter_s, verify_s)
        if step.drafter in self.alphas:  # not None, nor a draft the grammar forced
            self.alphas[step.drafter].update(num_draft, num_accepted_tokens)
            self.costs.record_acceptance(
                step.drafter, num_draft, num_accepted_tokens, self._carried_alpha_weight, self._alpha_prior
            )
            self.schedules[step.drafter].update(num_draft, num_accepted_tokens)
            schedule = self.schedules[step.drafter]
            if accepted_nodes is not None and isinstance(schedule, TreeBudgetSchedule):
                schedule.observe_tree(num_draft, accepted_nodes)
            self._proposers[step.drafter].observe(num_accepted_tokens)
            if step.drafter in self._tokens_from:
                self._tokens_from[step.drafter] += num_accepted_tokens + 1
        plain = self.costs.plain_step_s(base_rows)
        realised = (num_accepted_tokens + 1, (step.draft_s + verify_s) / plain) if plain else None
        if realised is not None and step.steady:
            self.ranking.record(step.drafter, realised)
        return realised

    def _predicted(self, name: str, num_draft_tokens: int, batch_size: int = 1) -> tuple[float, float] | None:
        step_costs = self.costs.step_costs(name, num_draft_tokens, batch_size)
        if step_costs is None:
            return None
        schedule = self.schedules[name]
        if isinstance(schedule, TreeBudgetSchedule):
            return schedule.expected_tokens(num_draft_tokens), step_costs[num_draft_tokens]
        return expected_tokens(self.alphas[name].alpha, num_draft_tokens), step_costs[num_draft_tokens]


def make_policy(
    method: str,
    proposers: Mapping[str, Proposer],
    schedule: str,
    max_k: int,
    costs: CostModel,
    config: ControllerConfig,
    trees: bool = False,
) -> DraftPolicy:
    """The policy for one request with ``method`` over the engine's loaded ``proposers``;
    ``trees``: the target runner verifies token trees (see :func:`drafter_order`)."""
    order = drafter_order(method, list(proposers), trees)
    return DraftPolicy([(name, proposers[name]) for name in order], schedule, max_k, costs, config)


def draft_batch(asks: Sequence[tuple[DraftPolicy, DraftRequest, int]], batch_size: int) -> list[DraftStep]:
    """Each request's draft for one target pass, ``asks`` holding ``(its policy, its request, the
    draft tokens that fit)``; ``batch_size``: requests decoding in the pass.

    Each policy chooses its drafter and draft length (:meth:`DraftPolicy.draft`); the drafters
    that draft for many requests at once (:attr:`DraftPolicy.batched`: a draft model's chains,
    one draft pass per position, :meth:`verispec.proposers.base.Proposer.propose_batch` by
    drafter type) then draft for every request that chose them, each request timed at its share.
    """
    steps = [policy.draft(request, limit, batch_size, policy.batched) for policy, request, limit in asks]
    deferred = [i for i, step in enumerate(steps) if step.deferred]
    if not deferred:
        return steps
    start = time.perf_counter()
    items = [(asks[i][0].proposer(steps[i].drafter), asks[i][1], steps[i].deferred) for i in deferred]
    groups: dict = {}  # drafters that batch together: the same propose_batch
    for index, item in enumerate(items):
        groups.setdefault(type(item[0]).propose_batch, []).append(index)
    drafts: list = [None] * len(items)
    for propose_batch, indices in groups.items():
        for index, draft in zip(indices, propose_batch([items[i] for i in indices])):
            drafts[index] = draft
    share = (time.perf_counter() - start) / len(deferred)
    for i, draft in zip(deferred, drafts):
        policy, request = asks[i][0], asks[i][1]
        steps[i] = policy.complete_deferred(steps[i], draft, share, request, alone=len(deferred) == 1)
    return steps


class _LastScores:
    """``draft_confidences`` of a lookup that keeps the last scores it returned (``last``), so the
    policy prices the cut it drafts with the same scores that sized it."""

    def __init__(self, of: Callable[[int], Sequence[float]]) -> None:
        self.of = of
        self.last: list[float] | None = None

    def __call__(self, num_tokens: int) -> list[float]:
        self.last = list(self.of(num_tokens))
        return self.last
