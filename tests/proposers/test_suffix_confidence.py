"""Suffix drafts sized by the suffix tree's own confidence in the match (issue 44, item 13).

A repeated request (customer service's fixed phrasing, asked again) matches earlier answers that
all continue the same way; the ``cost`` schedules priced that draft at the drafter's average
acceptance and drafted short. :func:`node_confidences` (SuffixDecoding's D(N), Oliaro et al. 2024,
§3) and :func:`confident_length` size it from the match instead; greedy output stays plain's.
"""

import pytest

from helpers import cycle_engine
from helpers import draft_request as request
from verispec.algorithms.control import ControllerConfig, CostModel, best_draft_length
from verispec.algorithms.sampling import SamplingParams
from verispec.algorithms.schedules import confident_length, sized_by_confidence
from verispec.algorithms.tree import TokenTree
from verispec.engine import SpeculativeConfig
from verispec.engine.policy import DraftPolicy
from verispec.proposers.suffix import SuffixCache, SuffixProposer, SuffixTreeProposer, _chain_tree, node_confidences

FLAT = [1.0 + 0.025 * k for k in range(9)]  # verify cost of k tokens in plain steps: an AVX-512-like curve


@pytest.mark.parametrize(
    "tree, continuations, prior, expected",
    [
        (_chain_tree(0, [1, 2, 3]), [[1, 2, 3]], 0.5, [0.5, 0.25, 0.125]),  # seen once: the drafter's average, alpha^i
        (_chain_tree(0, [1, 2, 3]), [[1, 2, 3]] * 2, 0.5, [0.75, 0.5625, 0.421875]),  # twice, agreeing: (1 + .5) / 2
        (_chain_tree(0, [1, 2, 3]), [[1, 2, 3]] * 4, 0.5, [0.875, 0.875**2, 0.875**3]),  # four times: (3 + .5) / 4
        (
            _chain_tree(0, [1, 2, 3]),
            [[1, 2, 3], [1, 2, 4]],
            0.5,
            [0.75, 0.5625, 0.140625],
        ),  # split at 3: x (0 + .5) / 2
        (
            TokenTree.from_paths(0, [[1, 2, 3], [1, 2, 4]]),
            [[1, 2, 3], [1, 2, 4]],
            0.5,
            [0.75, 0.5625, 0.140625, 0.140625],
        ),  # both branches of the split, each its path's estimate
        (_chain_tree(0, [1, 2]), [[1, 2], [1]], 1.0, [1.0, 1.0]),  # a continuation that ends says nothing further
        (_chain_tree(0, [5]), [[1, 2]], 0.5, [0.0]),  # a node no continuation went through: never accepted
    ],
)
def test_node_confidences(tree, continuations, prior, expected):
    assert node_confidences(tree, continuations, prior) == pytest.approx(expected)


@pytest.mark.parametrize(
    "confidences, step_costs, expected",
    [
        (
            [0.5**i for i in range(1, 9)],
            FLAT,
            best_draft_length(0.5, FLAT),
        ),  # alpha^i: Leviathan's best k, same speedup
        ([0.75**i for i in range(1, 9)], FLAT, (8, (1 + sum(0.75**i for i in range(1, 9))) / 1.2)),  # surer: longer
        ([1.0, 1.0, 1.0], FLAT, (3, 4 / 1.075)),  # the proposal ends first: at most its length
        ([0.0] * 8, FLAT, (0, 1.0)),  # nothing pays: a plain step
        ([0.1] * 8, [1.0, 1.1, 1.2], (0, 1.0)),  # 1.1 tokens for 1.1 steps ties plain: the smaller cut
    ],
)
def test_confident_length(confidences, step_costs, expected):
    n, speedup = confident_length(confidences, step_costs)
    assert (n, speedup) == (expected[0], pytest.approx(expected[1]))


def seeded_costs(drafter, alpha=0.5):
    """Frozen costs (weight 0): verify FLAT, drafting nearly free, the drafter's carried acceptance ``alpha``."""
    return CostModel(
        weight=0.0,
        verify_s={k: c for k, c in enumerate(FLAT)},
        draft_token_s={drafter: 1e-4},
        draft_ratio={drafter: 1e-4},
        last_alpha={drafter: alpha},
    )


def repeated_ask_policy(copies, tree=False, schedule="cost"):
    """A policy over a suffix cache that holds the same 12-token answer ``copies`` times."""
    proposer = SuffixProposer(SuffixCache(min_ngram=2, max_ngram=8))
    for _ in range(copies):
        proposer.end_request([50, 51], list(range(1, 13)))
    name, drafter = ("suffix-tree", SuffixTreeProposer(proposer)) if tree else ("suffix", proposer)
    return DraftPolicy([(name, drafter)], schedule, 8, seeded_costs(name), ControllerConfig()), name


@pytest.mark.parametrize(
    "copies, schedule, drafted",
    [
        (2, "cost", 8),  # asked a third time: two agreeing answers, 0.75 a token: k = 8 (was alpha 0.5's best, 4)
        (1, "cost", 4),  # asked a second time: seen once, priced as every draft is: unchanged
        (2, "constant", 8),  # the user's length, whatever the confidence
        (2, "heuristic", 8),
    ],
)
def test_a_repeated_ask_drafts_as_long_as_the_match_is_sure(copies, schedule, drafted):
    policy, _ = repeated_ask_policy(copies, schedule=schedule)
    step = policy.draft(request([50, 51, 1, 2, 3, 4]), limit=8)  # "1 2 3 4" matched: up to 8 tokens
    assert step.draft.draft_token_ids == list(range(5, 13))[:drafted]
    assert step.chosen_k == drafted


def test_a_tree_budget_stuck_small_grows_for_a_sure_match():
    """The tree schedule learns only the budgets it drafts: after 4-node trees its larger budgets
    keep their prior, tie with 4, and the smaller wins; the tree's own confidence sees further."""
    policy, name = repeated_ask_policy(2, tree=True)
    schedule = policy.schedules[name]
    for _ in range(10):
        schedule.observe_tree(4, [1, 2, 3, 4])
    assert schedule.next_k() == 4  # the trap, alone
    step = policy.draft(request([50, 51, 1, 2, 3, 4]), limit=8)
    assert step.draft.draft_token_ids == list(range(5, 13)) and step.chosen_k == 8


def test_confidence_is_not_asked_before_costs_are_measured():
    unmeasured = DraftPolicy([("suffix", SuffixProposer())], "cost", 8, CostModel(), ControllerConfig())
    assert sized_by_confidence(unmeasured.schedules["suffix"], lambda n: [1.0] * n, 8) == 0
    policy, name = repeated_ask_policy(2)
    assert sized_by_confidence(policy.schedules[name], lambda n: [1.0] * n, 8) == 8
    assert sized_by_confidence(policy.schedules[name], lambda n: [1.0] * n, 0) == 0  # no room left
    assert sized_by_confidence(policy.schedules[name], lambda n: [0.0] * n, 8, at_least=3) == 3  # never shorter
    asked = []
    assert sized_by_confidence(policy.schedules[name], asked.append, 8, at_least=8) == 8 and not asked  # full already


@pytest.mark.parametrize("tree", [False, True])
def test_repeated_asks_stay_exact_and_the_third_drafts_as_long_as_constant(tree):
    params = SamplingParams(max_tokens=40)
    plain = cycle_engine(tree=tree).generate([6, 7], params, SpeculativeConfig(method="none")).token_ids
    per_pass = {}
    for schedule in ("cost", "constant"):
        engine = cycle_engine(tree=tree)
        engine.cost_model = seeded_costs("suffix-tree" if tree else "suffix", alpha=0.3)
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=8, schedule=schedule)
        outs = [engine.generate([6, 7], params, spec) for _ in range(3)]
        assert [o.token_ids for o in outs] == [plain] * 3  # lossless: token for token
        third = outs[-1].metrics.spec
        per_pass[schedule] = 1 + third.num_accepted_tokens / third.num_drafts
    assert per_pass["cost"] >= 0.9 * per_pass["constant"]
