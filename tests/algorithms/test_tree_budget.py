"""Tree node budget from the cost model: pure pieces on known values, the schedule, exactness."""

import itertools

import pytest

from helpers import make_engine, single_thread
from verispec.algorithms.control import ControllerConfig, CostModel, expected_tokens
from verispec.algorithms.sampling import SamplingParams
from verispec.algorithms.schedules import (
    CostModelSchedule,
    TreeAcceptance,
    TreeBudgetSchedule,
    accepted_within,
    best_tree_budget,
    make_schedule,
)
from verispec.engine import SpeculativeConfig
from verispec.engine.policy import make_policy
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.runners.torch_runner import TransformersRunner


@pytest.mark.parametrize(
    "accepted, costs, best",
    [
        # speedups 1.9/1.1, 2.5/1.2, 2.8/1.5, 2.9/2.0: two nodes win
        ([0.0, 0.9, 1.5, 1.8, 1.9], [1.0, 1.1, 1.2, 1.5, 2.0], (2, 2.5 / 1.2)),
        ([0.0, 0.5, 1.0, 1.5], [1.0, 1.0, 1.0, 1.0], (3, 2.5)),  # free verification: all nodes
        ([0.0, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0], (1, 1.5)),  # ties go to the smaller tree
        ([0.0, 0.0, 0.0], [1.0, 3.0, 5.0], (1, 1 / 3)),  # hopeless, but never below one node
    ],
)
def test_best_tree_budget_known_values(accepted, costs, best):
    n, speedup = best_tree_budget(accepted, costs)
    assert n == best[0] and speedup == pytest.approx(best[1])


@pytest.mark.parametrize(
    "accepted_nodes, num_nodes, expected",
    [([], 4, 0), ([1, 3, 7], 0, 0), ([1, 3, 7], 1, 1), ([1, 3, 7], 6, 2), ([1, 3, 7], 7, 3), ([2, 3], 1, 0)],
)
def test_accepted_within(accepted_nodes, num_nodes, expected):
    assert accepted_within(accepted_nodes, num_nodes) == expected


def test_tree_acceptance_learns_every_smaller_budget():
    acceptance = TreeAcceptance(max_nodes=4, alpha_prior=0.5, weight=0.5)
    assert acceptance.lengths == pytest.approx([expected_tokens(0.5, n) - 1 for n in range(5)])
    acceptance.update(3, [1, 3])  # a 3-node tree: budget 1 would accept 1, budgets 2, 3 would accept 2 (1 then 3)
    prior = [expected_tokens(0.5, n) - 1 for n in range(5)]
    assert acceptance.lengths[1] == pytest.approx(prior[1] + 0.5 * (1 - prior[1]))
    assert acceptance.lengths[2] == pytest.approx(prior[2] + 0.5 * (1 - prior[2]))
    assert acceptance.lengths[3] == pytest.approx(prior[3] + 0.5 * (2 - prior[3]))
    assert acceptance.lengths[4] == pytest.approx(prior[4])  # never drafted: the prior stays
    expected = acceptance.expected()
    assert all(a <= b for a, b in itertools.pairwise(expected))  # non-decreasing in the budget
    assert expected[4] == pytest.approx(max(acceptance.lengths[3], acceptance.lengths[4]))


def measured(verify_s, draft_ratio, drafter="tree"):
    costs = CostModel()
    for k, seconds in verify_s.items():
        costs.record_verify(k, seconds)
    costs.draft_ratio[drafter] = draft_ratio
    return costs


def test_tree_budget_schedule_drafts_the_cap_until_timed_then_the_best_budget():
    config = ControllerConfig(alpha_prior=0.6, tree_weight=0.5)
    schedule = TreeBudgetSchedule("tree", 8, CostModel(), config)
    assert schedule.next_k() == 8  # nothing timed yet
    costs = measured({0: 1.0, 8: 3.0}, draft_ratio=0.0)  # verify cost 1 + 0.25 n
    schedule = TreeBudgetSchedule("tree", 8, costs, config)
    for _ in range(10):  # every tree's first two nodes are its accepted path, nothing deeper
        schedule.observe_tree(8, [1, 2])
    steps = costs.step_costs("tree", 8)
    assert schedule.next_k() == best_tree_budget(schedule.acceptance.expected(), steps)[0] == 2
    assert schedule.expected_tokens(2) == pytest.approx(1 + schedule.acceptance.expected()[2])
    for _ in range(20):  # now a deep accepted path: a bigger tree pays off, up to a point
        schedule.observe_tree(8, [1, 2, 3, 5, 6, 8])
    # 6 nodes: 5 accepted, (1 + 5) / 2.5 = 2.4; 8 nodes: (1 + 6) / 3 = 2.33
    assert schedule.next_k() == 6


def test_a_small_budget_is_refreshed_by_a_full_tree_every_probe_interval():
    costs = measured({0: 1.0, 8: 5.0}, draft_ratio=0.0)  # verification expensive: one node is best
    schedule = TreeBudgetSchedule("tree", 8, costs, ControllerConfig(probe_interval=3))
    assert [schedule.next_k() for _ in range(9)] == [1, 1, 1, 8, 1, 1, 1, 8, 1]
    assert schedule.last_predicted_speedup == pytest.approx(1.6 / 1.5)  # prior alpha 0.6, cost 1.5


def test_a_tree_that_cannot_beat_plain_decoding_is_switched_off_and_probed():
    costs = measured({0: 1.0, 8: 9.0}, draft_ratio=0.0)  # one node: (1 + 0.6) / 2 = 0.8 plain steps
    schedule = TreeBudgetSchedule("tree", 8, costs, ControllerConfig(probe_interval=3, probe_length=1))
    assert [schedule.next_k() for _ in range(9)] == [0, 0, 0, 1, 0, 0, 0, 1, 0]


def test_only_tree_drafters_get_the_tree_budget_schedule():
    config, costs = ControllerConfig(), CostModel()
    assert isinstance(make_schedule("cost", "tree", 8, None, costs, config, tree=True), TreeBudgetSchedule)
    assert isinstance(make_schedule("cost", "draft", 8, None, costs, config), CostModelSchedule)
    policy = make_policy("tree", {"ngram": None, "ngram-tree": None, "tree": None}, "cost", 8, costs, config)
    assert all(isinstance(s, TreeBudgetSchedule) for s in policy.schedules.values())
    policy = make_policy("auto", {"ngram": None, "draft": None, "ngram-tree": None}, "cost", 8, costs, config)
    assert all(isinstance(s, CostModelSchedule) for s in policy.schedules.values())


SERVING = [ord(c) % 96 for c in "serving " * 48]
PROMPTS = [SERVING, [5, 17, 33, 2, 9], [5, 17, 33, 2, 9, 5, 17, 40, 9, 5, 17]]


@pytest.mark.parametrize("schedule", ["cost", "heuristic"])
def test_greedy_tree_with_budget_schedules_equals_plain(schedule, target_model, partial_draft_model):
    plain = make_engine(target_model, max_context_length=512)
    draft_runner = TransformersRunner(partial_draft_model, max_context_length=512)
    engine = make_engine(
        target_model, max_context_length=512, proposers={"tree": DraftTreeProposer(draft_runner, max_depth=4)}
    )
    spec = SpeculativeConfig(method="tree", num_speculative_tokens=12, schedule=schedule)
    for _ in range(2):  # the second round starts from measured costs
        for prompt in PROMPTS:
            expected = plain.generate(prompt, SamplingParams(max_tokens=32), SpeculativeConfig(method="none")).token_ids
            out = engine.generate(prompt, SamplingParams(max_tokens=32), spec)
            assert out.token_ids == expected
            chosen = out.metrics.spec.chosen_k
            assert chosen and min(chosen) >= 0 and max(chosen) <= 12  # 0: switched off (cost)
