"""Draft-length and node-budget schedules: how many tokens (or tree nodes) to draft next.

The schedules users choose between (:data:`SCHEDULES`: constant, heuristic, cost model), built on
the estimates of :mod:`verispec.algorithms.control`, and the tree counterpart of the draft-length choice:
the realised accepted length per node budget (:class:`TreeAcceptance`), the budget maximising
tokens per unit of measured time (:func:`best_tree_budget`) and the ``cost`` schedule of tree
drafters (:class:`TreeBudgetSchedule`). For drafters that score their own
proposal, :func:`confident_length` sizes a draft from its scores. Knows nothing about models or
tokens: it sees node indices, counts, scores and the costs :class:`verispec.algorithms.control.CostModel`
measured.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

from verispec.algorithms.control import (
    AcceptanceEstimate,
    ControllerConfig,
    CostModel,
    best_draft_length,
    expected_tokens,
)

SCHEDULES = ("constant", "heuristic", "cost")


def best_tree_budget(accepted_lengths: Sequence[float], step_costs: Sequence[float]) -> tuple[int, float]:
    """The tree node budget N in ``1 .. len(step_costs) - 1`` maximising tokens per unit time.

    Args:
        accepted_lengths: ``[max_nodes + 1]`` expected accepted draft tokens of a tree of n
            nodes (index 0 unused); e.g. :meth:`TreeAcceptance.expected`.
        step_costs: ``[max_nodes + 1]`` cost of drafting and verifying n nodes, in plain
            decoding steps (:meth:`CostModel.step_costs`: measured ``verify_ratios`` plus draft).
    Returns:
        ``(N, (1 + accepted_lengths[N]) / step_costs[N])``; ties go to the smaller N. Unlike
        :func:`best_draft_length` it never switches speculation off (N >= 1).
    """
    best_n, best = 1, (1.0 + accepted_lengths[1]) / step_costs[1]
    for n in range(2, len(step_costs)):
        speedup = (1.0 + accepted_lengths[n]) / step_costs[n]
        if speedup > best:
            best_n, best = n, speedup
    return best_n, best


def confident_length(confidences: Sequence[float], step_costs: Sequence[float]) -> tuple[int, float]:
    """The draft length (or node budget) n in ``0 .. min(len(confidences), len(step_costs) - 1)``
    maximising ``(1 + sum(confidences[:n])) / step_costs[n]``, for a drafter that scores its own
    proposal.

    Args:
        confidences: ``[num_draft_tokens]`` the probability that verification accepts each token
            (tree nodes in tree order, the first n forming a tree) and every token before it:
            the sum of the first n is the expected accepted tokens of that cut (SuffixDecoding,
            Oliaro et al. 2024, §3: SCORE(T) = sum of D(N)); ``alpha ** (i + 1)`` gives
            :func:`verispec.algorithms.control.best_draft_length`'s Eq. 1 (Leviathan et al. 2023, §3.3).
        step_costs: ``[max_k + 1]`` cost of drafting and verifying n tokens, in plain decoding
            steps (:meth:`verispec.algorithms.control.CostModel.step_costs`; ``step_costs[0]`` is 1).
    Returns:
        ``(n, predicted speedup)``; n = 0 when no cut beats plain decoding, ties to the smaller n.
    """
    best_n, best, accepted = 0, 1.0 / step_costs[0], 0.0
    for n in range(1, min(len(confidences), len(step_costs) - 1) + 1):
        accepted += confidences[n - 1]
        speedup = (1.0 + accepted) / step_costs[n]
        if speedup > best:
            best_n, best = n, speedup
    return best_n, best


def chain_continues(confidences: Sequence[float], alpha: float, step_costs: Sequence[float]) -> bool:
    """Whether a draft chain that has drafted ``n = len(confidences)`` tokens should draft another.

    The chance that its first i tokens are all accepted is taken as the product of the draft's own
    probabilities of them (``confidences``: ``[n]``, each in [0, 1]), and ``alpha`` per token
    beyond them (the request's acceptance estimate, in [0, 1]). It drafts on while some longer
    chain, of at most ``len(step_costs) - 1`` tokens, is expected to give more tokens per unit of
    cost than stopping at n: ``(1 + sum of the chances of its prefixes) / step_costs[m]``
    (Leviathan et al. 2023, §3.3, Eq. 1, with the draft's probabilities for the tokens it has
    drafted). The rule of SpecDec++ (Huang et al. 2024, arXiv 2405.19715, §3: stop once the
    chance that the chain is rejected somewhere is too high), with the draft's own probabilities
    where SpecDec++ trains a head to predict acceptance, and the measured costs
    (:meth:`verispec.algorithms.control.CostModel.step_costs`, ``step_costs[0]`` is 1) where it
    tunes a threshold. False at or past the longest length ``step_costs`` prices.
    """
    n = len(confidences)
    if n >= len(step_costs) - 1:
        return False
    chance, expected = 1.0, 1.0
    for confidence in confidences:
        chance *= confidence
        expected += chance
    now = expected / step_costs[n]
    for m in range(n + 1, len(step_costs)):
        chance *= alpha
        expected += chance
        if expected / step_costs[m] > now:
            return True
    return False


def accepted_within(accepted_nodes: Sequence[int], num_nodes: int) -> int:
    """Draft tokens a tree cut to its first ``num_nodes`` nodes would have had accepted.

    ``accepted_nodes``: the accepted root path (node indices, increasing along the path, as
    every parent precedes its children). The first n nodes form a tree, and under greedy
    verification its accepted path is the part of the full one made of nodes <= n.
    """
    count = 0
    for node in accepted_nodes:
        if node > num_nodes:
            break
        count += 1
    return count


class TreeAcceptance:
    """Per-request estimate of a tree drafter's accepted length for every node budget.

    ``lengths[n]`` (n in ``0 .. max_nodes``) is an EWMA of the accepted draft tokens of a tree of
    n nodes. A verified tree of m nodes updates every n <= m with :func:`accepted_within`: the
    tree drafters emit nodes best first (EAGLE-2, Li et al. 2024, §4.1: nodes chosen by path
    probability, the draft's proxy for acceptance; n-gram trees by score), so the first n nodes
    stand for the tree a budget of n would have drafted. This realised acceptance replaces the
    path-probability sum of EAGLE-2 / SpecInfer (Miao et al. 2024), which needs calibrated draft
    probabilities that n-gram trees do not have. Budgets never drafted keep the chain prior
    ``expected_tokens(alpha_prior, n) - 1`` (Leviathan et al. 2023).
    """

    def __init__(self, max_nodes: int, alpha_prior: float, weight: float) -> None:
        self.weight = weight
        self.lengths = [expected_tokens(alpha_prior, n) - 1.0 for n in range(max_nodes + 1)]

    def update(self, num_nodes: int, accepted_nodes: Sequence[int]) -> None:
        """A verified tree of ``num_nodes`` nodes whose accepted path was ``accepted_nodes``."""
        for n in range(1, min(num_nodes, len(self.lengths) - 1) + 1):
            self.lengths[n] += self.weight * (accepted_within(accepted_nodes, n) - self.lengths[n])

    def expected(self) -> list[float]:
        """``[max_nodes + 1]`` accepted length per budget, made non-decreasing in n (more nodes
        never lose a path the fewer had; budgets seen at different times can disagree)."""
        out, highest = [], 0.0
        for value in self.lengths:
            highest = max(highest, value)
            out.append(highest)
        return out


class TreeBudgetSchedule:
    """Node budget of a tree drafter under the ``cost`` schedule: :func:`best_tree_budget` over
    the request's :class:`TreeAcceptance` and the engine's measured step costs.

    Until the drafter and the target have been timed it drafts ``max_k`` nodes (which also gives
    every budget a first acceptance sample). A smaller tree only teaches the budgets up to its
    size, so after ``probe_interval`` steps below ``max_k`` one step drafts ``max_k`` nodes
    again to refresh the larger budgets. When no budget beats plain decoding (predicted speedup
    <= 1) it drafts nothing, and after ``probe_interval`` such steps drafts a ``probe_length``-node
    tree once, as :class:`CostModelSchedule` does for chains (and, as there, never in a batch).
    """

    def __init__(self, drafter: str, max_k: int, costs: CostModel, config: ControllerConfig) -> None:
        self.drafter, self.max_k, self.costs, self.config = drafter, max_k, costs, config
        self.acceptance = TreeAcceptance(max_k, config.alpha_prior, config.tree_weight)
        self.last_predicted_speedup: float | None = None
        self.num_steps_small = 0  # steps since the last full-size tree
        self.num_steps_off = 0  # switched-off steps since the last probe

    def next_k(self, batch_size: int = 1) -> int:
        step_costs = self.costs.step_costs(self.drafter, self.max_k, batch_size)
        if step_costs is None:
            return self.max_k
        n, self.last_predicted_speedup = best_tree_budget(self.acceptance.expected(), step_costs)
        if self.last_predicted_speedup <= 1.0:
            if batch_size > 1:  # no probes in a batch: see CostModelSchedule
                return 0
            self.num_steps_off += 1
            if self.num_steps_off > self.config.probe_interval:
                self.num_steps_off = 0
                return min(self.config.probe_length, self.max_k)
            return 0
        self.num_steps_off = 0
        self.num_steps_small = 0 if n == self.max_k else self.num_steps_small + 1
        if self.num_steps_small > self.config.probe_interval:
            self.num_steps_small = 0
            return self.max_k
        return n

    def expected_tokens(self, num_nodes: int) -> float:
        """Tokens one pass over a tree of ``num_nodes`` nodes is expected to emit."""
        return 1.0 + self.acceptance.expected()[min(num_nodes, self.max_k)]

    def update(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Nothing: trees report their accepted path through :meth:`observe_tree`."""

    def observe_tree(self, num_nodes: int, accepted_nodes: Sequence[int]) -> None:
        self.acceptance.update(num_nodes, accepted_nodes)


class DraftLengthSchedule(Protocol):
    def next_k(self, batch_size: int = 1) -> int:
        """Draft length for the next step, ``0 .. max``; 0 means a plain decoding step.
        ``batch_size``: decoding requests in the pass it joins (:meth:`CostModel.step_costs`)."""
        ...

    def update(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Feedback after verification of a draft produced with this schedule."""
        ...


class ConstantSchedule:
    """Always the same draft length (transformers ``num_assistant_tokens_schedule="constant"``)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    def next_k(self, batch_size: int = 1) -> int:
        return self.k

    def update(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        pass


class HeuristicSchedule:
    """+2 after a fully accepted draft, -1 otherwise, within ``[1, max_k]``; starts at ``max_k``.

    (transformers ``num_assistant_tokens_schedule="heuristic"``, capped here.)
    """

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.k = max_k

    def next_k(self, batch_size: int = 1) -> int:
        return self.k

    def update(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens == 0:
            return
        step = 2 if num_accepted_tokens == num_draft_tokens else -1
        self.k = min(self.max_k, max(1, self.k + step))


class CostModelSchedule:
    """Draft length maximising expected tokens per unit time (:func:`best_draft_length`).

    Uses the request's acceptance estimate and the engine's measured costs. Until the drafter
    and the target have been timed it drafts ``max_k`` tokens (which times them). When the best
    k is 0 it drafts nothing, and after ``probe_interval`` such steps drafts ``probe_length``
    tokens once, so the acceptance estimate can recover. A fully accepted probe is followed by
    one more in the next step (never more: then the cost model decides again): back-to-back
    drafting is what re-measures the drafter's steady-state cost (an isolated probe also pays
    for catching up on the skipped tokens).

    In a batch (``batch_size`` > 1) a switched-off drafter is not probed: a probe of a model
    drafter first feeds it every token it skipped (the whole prompt, the first time), a cost
    the whole batch waits for and the cost model does not see; the estimate is probed again once
    the request runs alone, or drafts as soon as the batch shrinks enough for the prediction.
    """

    def __init__(
        self, drafter: str, max_k: int, alpha: AcceptanceEstimate, costs: CostModel, config: ControllerConfig
    ) -> None:
        self.drafter, self.max_k, self.alpha, self.costs, self.config = drafter, max_k, alpha, costs, config
        self.num_steps_off = 0
        self.last_predicted_speedup: float | None = None
        self._probing: str | None = None  # the last k handed out: "probe", "follow-up" or None
        self._follow_up = False  # the last probe was fully accepted: probe again next step
        self._measure_next = False  # the probe handed out must be followed up (follow_up)

    def next_k(self, batch_size: int = 1) -> int:
        step_costs = self.costs.step_costs(self.drafter, self.max_k, batch_size)
        if step_costs is None:
            return self.max_k
        k, self.last_predicted_speedup = best_draft_length(self.alpha.alpha, step_costs)
        self._probing = None
        if k > 0:
            self.num_steps_off = 0
            return k
        if batch_size > 1 and not self._follow_up:
            return 0  # no probes in a batch (see the class docstring)
        if not self._follow_up:
            self.num_steps_off += 1
        if self._follow_up or self.num_steps_off > self.config.probe_interval:
            self._probing = "follow-up" if self._follow_up else "probe"
            self.num_steps_off, self._follow_up = 0, False
            return min(self.config.probe_length, self.max_k)
        return 0

    def update(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Only probes matter here; the acceptance estimate is updated by the policy."""
        accepted = 0 < num_draft_tokens == num_accepted_tokens
        self._follow_up = self._probing == "probe" and (accepted or self._measure_next)
        self._measure_next = False

    def follow_up(self) -> None:
        """The probe handed out now is followed by another whatever its outcome: it has to catch
        up first, so only a next, steady step re-measures the drafter's own cost."""
        self._measure_next = True


def sized_by_confidence(
    schedule: DraftLengthSchedule,
    confidences_of: Callable[[int], Sequence[float]],
    limit: int,
    batch_size: int = 1,
    at_least: int = 0,
) -> int:
    """The draft length (node budget) to draft: the larger of ``at_least`` (the schedule's own
    choice, which prices the drafter's average proposal) and what the drafter's confidence in its
    next proposal pays for under ``schedule``'s measured costs, :func:`confident_length` of
    ``confidences_of(n)`` (the scores of the proposal of at most n = ``min(max_k, limit)``
    tokens). So a match the drafter is surer of than average drafts longer, never shorter.
    ``at_least`` under the constant and heuristic schedules (their lengths are the user's), before
    the costs are measured, and when it already reaches n (the scores are then not asked for)."""
    if not isinstance(schedule, (CostModelSchedule, TreeBudgetSchedule)) or at_least >= min(schedule.max_k, limit):
        return at_least
    step_costs = schedule.costs.step_costs(schedule.drafter, min(schedule.max_k, limit), batch_size)
    if step_costs is None:
        return at_least
    return max(at_least, confident_length(confidences_of(len(step_costs) - 1), step_costs)[0])


def confident_chain(
    schedule: DraftLengthSchedule, alpha: float, limit: int, batch_size: int = 1
) -> tuple[int, Callable[[Sequence[float]], bool]] | None:
    """For a chain that sizes itself by its own confidence, drafting under ``schedule`` this step:
    the most tokens to ask for (``max_k``, as many as fit in ``limit``) and the rule that stops
    it, :func:`chain_continues` at the request's acceptance estimate ``alpha`` and the measured
    step costs of a pass of ``batch_size`` requests. None under the constant and heuristic
    schedules (their lengths are the user's) and before the costs are measured.

    Replayed on the default draft's teacher-forced agreement and own probabilities over 10
    HumanEval and 12 Spec-Bench answers (an estimate on a Zen 4 host's measured cost curves, no
    overheads): 2.040 / 1.281 plain-step speedup against 1.929 / 1.198 for the best constant
    length and 2.400 / 1.652 for an oracle that knows each step's outcome."""
    if not isinstance(schedule, CostModelSchedule):
        return None
    step_costs = schedule.costs.step_costs(schedule.drafter, min(schedule.max_k, limit), batch_size)
    if step_costs is None:
        return None
    return len(step_costs) - 1, functools.partial(chain_continues, alpha=alpha, step_costs=step_costs)


def make_schedule(
    name: str,
    drafter: str,
    max_k: int,
    alpha: AcceptanceEstimate,
    costs: CostModel,
    config: ControllerConfig,
    tree: bool = False,
) -> DraftLengthSchedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`); ValueError otherwise.

    ``tree``: the drafter proposes token trees, so ``cost`` picks a node budget
    (:class:`TreeBudgetSchedule`); the other schedules treat the budget like a draft length.
    """
    if name == "constant":
        return ConstantSchedule(max_k)
    if name == "heuristic":
        return HeuristicSchedule(max_k)
    if name == "cost" and tree:
        return TreeBudgetSchedule(drafter, max_k, costs, config)
    if name == "cost":
        return CostModelSchedule(drafter, max_k, alpha, costs, config)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
