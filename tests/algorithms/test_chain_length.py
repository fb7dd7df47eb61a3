"""A draft chain sized by its own confidence: :func:`chain_continues` (the stop rule, pure) and
:func:`confident_chain` (when a schedule hands a chain the rule, and how long it may get)."""

import pytest

from verispec.algorithms.control import AcceptanceEstimate, ControllerConfig, CostModel
from verispec.algorithms.schedules import (
    CostModelSchedule,
    HeuristicSchedule,
    chain_continues,
    confident_chain,
)

COSTS = [1.0, 1.2, 1.4, 1.6, 1.8]  # a step drafting k tokens, in plain steps: 0.2 a drafted token


def brute_force(confidences, alpha, step_costs):
    """Some longer chain's expected tokens per cost beats stopping now (the rule, spelled out)."""
    chances, chance = [], 1.0
    for c in list(confidences) + [alpha] * (len(step_costs) - 1 - len(confidences)):
        chance *= c
        chances.append(chance)
    rate = [(1 + sum(chances[:m])) / step_costs[m] for m in range(len(step_costs))]
    return any(rate[m] > rate[len(confidences)] for m in range(len(confidences) + 1, len(step_costs)))


@pytest.mark.parametrize(
    "confidences, alpha, expected",
    [
        ([0.95], 0.8, True),  # (1.95 + 0.76) / 1.4 = 1.94 > 1.95 / 1.2 = 1.63
        ([0.2], 0.8, False),  # 1.2 / 1.2 = 1.0 beats 1.36 / 1.4 and every longer chain
        ([0.95, 0.9, 0.3], 0.8, False),  # the chance all three are accepted, 0.26, makes a fourth not pay
        ([0.95, 0.9, 0.9], 0.8, True),
        ([0.99, 0.99, 0.99], 0.9, True),  # (3.94 + 0.87) / 1.8 = 2.67 > 3.94 / 1.6 = 2.46
        ([0.99, 0.99, 0.99], 0.2, False),  # a fourth at a low average: 0.19 tokens more, not worth 0.2
        ([1.0, 1.0, 1.0, 1.0], 1.0, False),  # the longest length priced
    ],
)
def test_a_chain_drafts_on_while_a_longer_one_is_expected_to_pay(confidences, alpha, expected):
    assert chain_continues(confidences, alpha, COSTS) is expected
    if len(confidences) < len(COSTS) - 1:
        assert brute_force(confidences, alpha, COSTS) is expected


def test_the_rule_matches_its_definition_over_a_grid():
    steep = [1.0, 1.3, 1.5, 2.2, 3.0]
    for step_costs in (COSTS, steep):
        for a in (0.1, 0.5, 0.9):
            for b in (0.05, 0.4, 0.7, 0.99):
                for alpha in (0.3, 0.6, 0.9):
                    for confidences in ([a], [a, b], [b, a, b]):
                        got = chain_continues(confidences, alpha, step_costs)
                        assert got == brute_force(confidences, alpha, step_costs), (confidences, alpha, step_costs)


def measured_costs() -> CostModel:
    costs = CostModel(verify_s={0: 1.0, 1: 1.0, 2: 1.1, 4: 1.2, 8: 1.6})
    costs.draft_ratio["draft"] = 0.2
    return costs


def test_the_cost_schedule_hands_a_chain_the_rule_up_to_max_k_as_many_as_fit():
    schedule = CostModelSchedule("draft", 8, AcceptanceEstimate(0.7, 0.1), measured_costs(), ControllerConfig())
    longest, rule = confident_chain(schedule, 0.7, limit=20)
    assert longest == 8 and rule([0.99]) is True and rule([0.01]) is False
    assert confident_chain(schedule, 0.7, limit=3)[0] == 3  # the room left in the answer or the context


def test_no_rule_under_a_users_length_or_before_the_costs_are_measured():
    assert confident_chain(HeuristicSchedule(8), 0.7, limit=20) is None
    cold = CostModelSchedule("draft", 8, AcceptanceEstimate(0.7, 0.1), CostModel(), ControllerConfig())
    assert confident_chain(cold, 0.7, limit=20) is None
