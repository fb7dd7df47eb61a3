"""Node-budget control for token trees: how many nodes the next tree should have.

Owns the tree counterpart of :mod:`verispec.control`'s draft-length choice: the realised
accepted length per node budget (:class:`TreeAcceptance`), the budget maximising tokens per unit
of measured time (:func:`best_tree_budget`) and the ``cost`` schedule of tree drafters
(:class:`TreeBudgetSchedule`). Knows nothing about models or tokens: it sees node indices,
counts and the costs :class:`verispec.control.CostModel` measured.
"""

from __future__ import annotations

from typing import Sequence

from verispec.control import ControllerConfig, CostModel, expected_tokens


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
        self.acceptance = TreeAcceptance(max_k, config.alpha_prior, config.alpha_weight)
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
