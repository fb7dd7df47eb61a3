"""EAGLE-2 dynamic trees from an EAGLE-3 head (method ``eagle-tree``): the tree holds the head's
chain, leaves the head's cache as it found it, and decoding with it gives plain decoding's
tokens on every runner that verifies trees, alone and batched; sampled output keeps the target's
distribution; a runner without trees and a missing head are refused clearly."""

import pytest
import torch

from eagle_support import (
    GREEDY,
    PROMPTS,
    ToyFeatureRunner,
    engine_with,
    gguf_head,
    runner_of,
    sampled_distance,
    stepped_together,
    toy_head,
)
from gguf_models import VOCAB as GGUF_VOCAB
from helpers import VOCAB, BigramTreeRunner, CharTokenizer, default_pieces
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.errors import InvalidParameterError
from verispec.proposers import DraftRequest
from verispec.proposers.eagle import EagleProposer, EagleTreeProposer
from verispec.proposers.factory import for_new_sequence, with_lookup_drafters
from verispec.runners.torch_runner import TransformersRunner


def fed_proposer(target, head, context):
    """A head that has read the target's features of ``context`` (as the engine hands them over)."""
    runner = TransformersRunner(target, max_context_length=128)
    runner.capture_features(head.shape.feature_layers)
    runner.forward(context)
    proposer = EagleProposer(head.new_sequence())
    proposer.observe_features(runner.last_features[:-1], 0)  # the last token is not fed yet (it is the root)
    return proposer


def test_the_tree_holds_the_heads_chain_and_leaves_its_cache_as_found(target, trained_head):
    context = [5, 17, 33, 2, 9, 40, 41]
    request = DraftRequest(context[:4], context[4:], SamplingParams(), torch.Generator())
    chain = fed_proposer(target, trained_head, context).propose(request, 4).draft_token_ids
    # branching 1: the tree is the chain itself (tree-masked rows score as the causal ones)
    assert fed_proposer(target, trained_head, context).propose_tree(request, 4, branching=1, max_depth=4).token_ids[
        1:
    ] == tuple(chain)
    proposer = fed_proposer(target, trained_head, context)
    tree = proposer.propose_tree(request, 6, branching=2, max_depth=4)
    assert tree.token_ids[0] == context[-1] and 3 <= tree.num_nodes - 1 <= 6
    node, path = 0, []
    for _ in range(2):  # levels 1 and 2 are kept whole at this budget: the most probable child leads
        node = tree.children(node)[0]
        path.append(tree.token_ids[node])
    assert path == chain[:2]
    assert proposer.head.num_cached_tokens == len(context) - 1  # the draft rows went; the real ones (0 .. L - 2) stay
    assert fed_proposer(target, trained_head, context).propose_tree(request, 0).num_nodes == 1


@pytest.mark.parametrize("kind", ["torch", "int8", "gguf"])
def test_greedy_eagle_tree_equals_plain_token_for_token(kind, target, trained_head, gguf_path):
    runner = runner_of(kind, target, gguf_path)
    head = gguf_head(runner) if kind == "gguf" else trained_head.new_sequence()
    engine = engine_with(runner, head, GGUF_VOCAB if kind == "gguf" else VOCAB)
    assert "eagle-tree" in engine.proposers  # wrapped around the chain drafter, sharing its head
    spec = SpeculativeConfig(method="eagle-tree", num_speculative_tokens=6, schedule="constant")
    for prompt in PROMPTS:
        plain = engine.generate(prompt, GREEDY, SpeculativeConfig(method="none"))
        tree = engine.generate(prompt, GREEDY, spec)
        assert tree.token_ids == plain.token_ids
        assert tree.metrics.spec.num_draft_tokens > 0
        if kind != "gguf":
            assert tree.metrics.spec.mean_acceptance_length > 1.0  # the trained head's trees are accepted


def test_a_one_branch_tree_drafts_and_accepts_as_the_chain_does(target, trained_head):
    """Through the engine (tree verification, the accepted path kept) a tree of one branch per
    node is the chain: the same drafts, the same accepted tokens, pass for pass."""
    head = trained_head.new_sequence()
    chain = EagleProposer(head)
    drafters = {"eagle": chain, "eagle-tree": EagleTreeProposer(chain, branching=1, max_depth=6)}
    engine = SpeculativeEngine(
        TransformersRunner(target, max_context_length=128),
        CharTokenizer(default_pieces(VOCAB)),
        eos_token_ids=(),
        proposers=drafters,
    )
    slot = engine.new_slot()
    assert slot.proposers["eagle-tree"].branching == 1 and slot.proposers["eagle-tree"].eagle is slot.proposers["eagle"]
    for prompt in PROMPTS:
        outs = [
            engine.generate(prompt, GREEDY, SpeculativeConfig(method=m, num_speculative_tokens=6, schedule="constant"))
            for m in ("eagle", "eagle-tree")
        ]
        assert outs[0].token_ids == outs[1].token_ids
        counts = [
            (o.metrics.spec.num_drafts, o.metrics.spec.num_draft_tokens, o.metrics.spec.num_accepted_tokens)
            for o in outs
        ]
        assert counts[0] == counts[1] and counts[0][2] > 0, counts


def test_batched_eagle_tree_requests_equal_each_alone(target, trained_head):
    spec = SpeculativeConfig(method="eagle-tree", num_speculative_tokens=5, schedule="constant")
    states, alone = stepped_together(trained_head.new_sequence(), target, spec)
    assert [s.output.token_ids for s in states] == [a.token_ids for a in alone]
    for s in states:  # each slot's tree drafter wraps that slot's own chain drafter
        assert s.slot.proposers["eagle-tree"].eagle is s.slot.proposers["eagle"]


class ToyTreeFeatureRunner(ToyFeatureRunner, BigramTreeRunner):
    """The toy feature target, verifying trees too (a node's features: its own token's)."""

    def forward_tree(self, token_ids, position_ids, attention_mask):
        return self.forward(token_ids)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0, max_tokens=3), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3)]
)
def test_sampled_eagle_tree_sequences_follow_the_target_distribution(params):
    """20,000 three-token samples, the bound of the draft model's test (test_engine.py)."""
    tv, accepted, drafted = sampled_distance(ToyTreeFeatureRunner, "eagle-tree", 3, params)
    assert tv < 0.04, tv  # sampling noise alone: about 0.02
    assert 0 < accepted < drafted, (accepted, drafted)  # some accepted, some rejected


def test_a_runner_without_trees_and_bad_settings_are_refused(target, trained_head):
    engine = engine_with(ToyFeatureRunner(torch.zeros(4, 4)), toy_head(), 4)  # features, but no trees
    with pytest.raises(InvalidParameterError, match="cannot verify token trees"):
        engine.generate([1, 2], GREEDY, SpeculativeConfig(method="eagle-tree", num_speculative_tokens=3))
    with pytest.raises(ValueError, match="branching and max_depth"):
        EagleTreeProposer(EagleProposer(trained_head.new_sequence()), branching=0)
    drafters = with_lookup_drafters({})
    assert "eagle-tree" not in drafters and "eagle-tree" not in for_new_sequence(drafters)  # no head, no tree of it


def test_trees_of_several_requests_grow_in_shared_head_passes(target, trained_head, monkeypatch):
    """propose_trees: the same trees as each request alone, one head pass for every catch-up,
    then one per level over every tree still growing (not one per request)."""
    import verispec.proposers.eagle as eagle_module

    contexts = [[5, 17, 33, 2, 9, 40, 41], [7, 7, 8, 60, 3], [12, 40, 41, 42, 43, 44, 45, 46]]
    requests = [DraftRequest(c[:3], c[3:], SamplingParams(), torch.Generator()) for c in contexts]
    budgets = [12, 2, 6]  # nodes: trees of different sizes and depths finish at different levels
    passes, real = [], eagle_module.forward_heads
    monkeypatch.setattr(eagle_module, "forward_heads", lambda calls: passes.append(len(calls)) or real(calls))
    alone, passes_alone = [], []
    for c, r, n in zip(contexts, requests, budgets):
        proposer = fed_proposer(target, trained_head, c)
        passes.clear()
        alone.append(proposer.propose_tree(r, n, branching=2, max_depth=4))
        passes_alone.append(len(passes))
    passes.clear()
    proposers = [fed_proposer(target, trained_head, c) for c in contexts]
    together = EagleProposer.propose_trees([(p, r, n, 2, 4) for p, r, n in zip(proposers, requests, budgets)])
    assert [(t.token_ids, t.parents) for t in together] == [(t.token_ids, t.parents) for t in alone]
    assert (
        all(t.num_nodes > 2 for t in alone) and len(set(passes_alone)) > 1
    )  # real trees, growing for different numbers of levels
    assert passes[0] == 3 and passes == sorted(
        passes, reverse=True
    )  # the catch-ups together; trees drop out as they finish
    assert len(passes) == max(
        passes_alone
    )  # a pass per level of the longest-growing tree, not one per request and level
    assert [p.head.num_cached_tokens for p in proposers] == [len(c) - 1 for c in contexts]  # draft rows gone
