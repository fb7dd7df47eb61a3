"""``auto`` with a tree-capable target: the draft model's chain or tree, chosen per step by realised rate."""

import pytest

from helpers import make_engine, single_thread
from verispec.algorithms.control import ControllerConfig, CostModel
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.policy import DraftPolicy, drafter_order
from verispec.proposers import DraftOutput, Proposer
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.runners.torch_runner import TransformersRunner


@pytest.mark.parametrize(
    "loaded, trees, order",
    [
        (["ngram", "draft", "tree"], True, ["ngram", "draft", "tree"]),  # both offered
        (["ngram", "draft", "tree"], False, ["ngram", "draft"]),  # the target cannot verify trees
        (["ngram", "draft"], True, ["ngram", "draft"]),  # no tree drafter loaded
        (["ngram", "layer-skip", "tree"], True, ["ngram", "layer-skip"]),  # trees come from the draft model only
    ],
)
def test_auto_offers_the_tree_only_beside_the_draft_chain(loaded, trees, order):
    assert drafter_order("auto", loaded, trees) == order


class Fixed(Proposer):
    """A proposer that always drafts ``[7, 7]``."""

    def propose(self, request, num_speculative_tokens):
        return DraftOutput([7] * num_speculative_tokens)

    def observe(self, num_accepted_tokens):
        pass


def choices(rates, steps, probe_interval=4):
    costs = CostModel(verify_s={0: 1.0}, drafter_rate=dict(rates))
    config = ControllerConfig(probe_interval=probe_interval)
    policy = DraftPolicy([("draft", Fixed()), ("tree", Fixed())], "constant", 2, costs, config)
    return [policy.draft(None, 2).drafter for _ in range(steps)]


def test_the_better_realised_rate_wins_and_the_other_is_probed_for_two_steps():
    assert choices({"draft": 1.2, "tree": 1.5}, 9) == ["tree"] * 3 + ["draft"] * 2 + ["tree"] * 2 + ["draft"] * 2
    assert choices({"draft": 1.6, "tree": 1.5}, 5) == ["draft"] * 3 + ["tree"] * 2


def test_an_unrated_alternative_is_tried_first():
    assert choices({"draft": 1.6}, 3) == ["tree"] * 3


def test_a_weak_head_loses_its_steps_to_the_draft_model_once_both_are_rated():
    costs = CostModel(verify_s={0: 1.0}, drafter_rate={"eagle": 0.6, "draft": 1.3, "tree": 1.1})
    policy = DraftPolicy(
        [("eagle", Fixed()), ("draft", Fixed()), ("tree", Fixed())],
        "constant",
        2,
        costs,
        ControllerConfig(probe_interval=4),
    )
    steps = [policy.draft(None, 2).drafter for _ in range(12)]
    # best first; every 4th choice one of the others (in turn) goes first for two steps
    assert steps == ["draft"] * 3 + ["tree"] * 2 + ["draft"] * 2 + ["eagle"] * 2 + ["draft"] * 2 + ["tree"]


def test_an_alternative_whose_schedule_sits_out_hands_the_step_to_the_next():
    costs = CostModel(verify_s={0: 1.0}, drafter_rate={"eagle": 2.0, "draft": 1.2})
    policy = DraftPolicy([("eagle", Fixed()), ("draft", Fixed())], "constant", 2, costs, ControllerConfig())
    policy.schedules["eagle"].next_k = lambda batch_size=1: 0  # its cost model expects no gain
    assert [policy.draft(None, 2).drafter for _ in range(3)] == ["draft"] * 3


def test_steady_steps_record_the_rate():
    costs = CostModel(verify_s={0: 1.0})
    policy = DraftPolicy([("draft", Fixed()), ("tree", Fixed())], "constant", 2, costs, ControllerConfig())
    first = policy.draft(None, 2)
    policy.observe(first, 2, 1.0)  # first step of the drafter: its catch-up cost, not recorded
    assert "draft" not in costs.drafter_rate
    second = policy.draft(None, 2)
    policy.observe(second, 2, 1.0)
    assert second.drafter == "draft" and costs.drafter_rate["draft"] == pytest.approx(3 / (1.0 + second.draft_s))


@pytest.mark.parametrize("k", [2, 5, 8])
def test_auto_with_trees_equals_plain(k, target_model, partial_draft_model):
    tree = DraftTreeProposer(TransformersRunner(partial_draft_model, max_context_length=512), branching=2, max_depth=4)
    engine = make_engine(target_model, partial_draft_model, max_context_length=512, proposers={"tree": tree})
    plain = make_engine(target_model, max_context_length=512)
    params = SamplingParams(max_tokens=40)
    used = set()
    for prompt in ([11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [3, 9, 27, 81 % 64, 5, 25]):
        expected = plain.generate(prompt, params, SpeculativeConfig(method="none")).token_ids
        out = engine.generate(prompt, params, SpeculativeConfig(method="auto", num_speculative_tokens=k))
        assert out.token_ids == expected
        used |= {name for name, s in out.metrics.spec.per_drafter.items() if s.num_drafts}
    assert {"draft", "tree"} <= used  # both were tried


def test_tree_on_a_runner_without_tree_verification_is_refused_before_any_token(target_model):
    from helpers import BigramRunner, CharTokenizer, chain_table
    from verispec.engine import SpeculativeEngine
    from verispec.errors import InvalidParameterError

    engine = SpeculativeEngine(BigramRunner(chain_table({1: 2, 2: 1}, 4)), CharTokenizer("abcd"), eos_token_ids=[])
    with pytest.raises(InvalidParameterError, match="cannot verify token trees"):
        next(engine.stream([1, 2, 1, 2, 1], SamplingParams(max_tokens=8), SpeculativeConfig(method="tree")))


def first_drafter(rate: float | None, batch_size: int = 1) -> tuple[str, int]:
    """The drafter of ``auto``'s first step: an n-gram lookup (always matching, acceptance at the
    prior) ahead of the draft model, whose realised rate is ``rate`` (None: not measured)."""
    costs = CostModel(
        verify_s={0: 1.0, 2: 1.2, 4: 1.3, 6: 1.4},
        draft_token_s={"ngram": 0.0, "draft": 0.1},
        drafter_rate={} if rate is None else {"draft": rate},
    )
    config = ControllerConfig(alpha_prior=0.5)
    policy = DraftPolicy([("ngram", Fixed()), ("draft", Fixed())], "constant", 2, costs, config)
    return policy.draft(None, 2, batch_size).drafter, policy.ranking.num_outrun_lookups


def test_a_lookup_sits_out_when_the_draft_model_realises_more_than_it_predicts():
    # the lookup predicts (1 + 0.5 + 0.25) tokens for a pass of 1.2 plain steps: 1.46x plain decoding
    assert first_drafter(2.0) == ("draft", 1)  # the draft model realised 2.0x: it takes the step
    assert first_drafter(1.3) == ("ngram", 0)  # a weaker draft model leaves it to the lookup
    assert first_drafter(None) == ("ngram", 0)  # nothing measured yet: the lookup first, as before
    assert first_drafter(2.0, batch_size=2) == ("ngram", 0)  # in a batch the draft model's costs are shared


def test_a_leader_slowed_by_hard_text_keeps_the_steps_its_alternatives_were_rated_on_easier_text():
    costs = CostModel(verify_s={0: 1.0}, drafter_rate={"draft": 2.4, "tree": 1.6})
    policy = DraftPolicy([("draft", Fixed()), ("tree", Fixed())], "constant", 2, costs, ControllerConfig())
    for tokens in (2, 2, 1):  # hard text: the chain realises far less than it did
        policy.ranking.record("draft", (tokens, 2.3))
    assert costs.drafter_rate["draft"] < 1.6  # below the tree's rate as measured on the earlier text
    assert costs.drafter_rate["tree"] / costs.drafter_rate["draft"] == pytest.approx(1.6 / 2.4)
    assert policy.ranking.rank_alternatives() == ["draft", "tree"]


def test_a_probed_alternative_that_realises_more_than_the_leader_now_does_takes_the_lead():
    costs = CostModel(verify_s={0: 1.0}, drafter_rate={"draft": 2.4, "tree": 1.6})
    policy = DraftPolicy([("draft", Fixed()), ("tree", Fixed())], "constant", 2, costs, ControllerConfig())
    policy.ranking.record("tree", (9, 1.5))  # a probe: 6.0 on the text now, the leader's rate stays
    assert costs.drafter_rate == {"draft": 2.4, "tree": pytest.approx(1.6 + 0.3 * (6.0 - 1.6))}
    assert policy.ranking.rank_alternatives() == ["tree", "draft"]
    policy.ranking.record("tree", (3, 1.5))  # now the leader: the draft chain's rate moves with it
    assert costs.drafter_rate["draft"] == pytest.approx(2.4 * (2.92 + 0.3 * (2.0 - 2.92)) / 2.92)
