"""Dynamic-tree drafting with a draft model."""

import pytest
import torch

from helpers import make_engine
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.proposers import DraftRequest
from verispec.proposers.draft_tree import (
    Candidate,
    DraftTreeProposer,
    select_candidates,
)
from verispec.runners.torch_runner import TransformersRunner


def test_select_candidates_keeps_best_in_topological_order():
    candidates = [Candidate(-0.1, 0, 5), Candidate(-2.0, 0, 6), Candidate(-0.5, 1, 7), Candidate(-0.3, 1, 8)]
    chosen = select_candidates(candidates, 3)
    assert [(c.parent, c.token_id) for c in chosen] == [(0, 5), (1, 8), (1, 7)]  # -2.0 dropped
    assert select_candidates(candidates, 0) == []


def test_tree_from_the_target_itself_contains_the_greedy_path(target_model):
    prompt = [5, 17, 33, 2, 9]
    plain = make_engine(target_model).generate(prompt, SamplingParams(max_tokens=4), SpeculativeConfig(method="none"))
    proposer = DraftTreeProposer(TransformersRunner(target_model), branching=2, max_depth=4)
    request = DraftRequest(prompt, plain.token_ids[:1], SamplingParams(), torch.Generator())
    tree = proposer.propose_tree(request, num_nodes=10)
    assert tree.token_ids[0] == plain.token_ids[0] and 1 < tree.num_nodes <= 11
    # the most probable child at each level follows plain greedy decoding
    node, path = 0, []
    for _ in range(3):
        node = tree.children(node)[0]
        path.append(tree.token_ids[node])
    assert path == plain.token_ids[1:4]
    # the draft cache is back to the context: proposing again gives the same tree
    assert proposer.propose_tree(request, num_nodes=10) == tree


PROMPTS = [[5, 17, 33, 2, 9], [70, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def tree_engine(target_model, draft_model, branching=2):
    from helpers import CharTokenizer, default_pieces
    from verispec.engine import SpeculativeEngine

    return SpeculativeEngine(
        TransformersRunner(target_model),
        CharTokenizer(default_pieces(target_model.config.vocab_size)),
        eos_token_ids=(),
        proposers={"tree": DraftTreeProposer(TransformersRunner(draft_model), branching=branching, max_depth=4)},
    )


@pytest.mark.parametrize("draft_kind", ["target", "random", "partial"])
@pytest.mark.parametrize("num_nodes", [1, 3, 8, 16])
def test_greedy_tree_speculation_equals_plain(
    draft_kind, num_nodes, target_model, random_draft_model, partial_draft_model
):
    draft = {"target": target_model, "random": random_draft_model, "partial": partial_draft_model}[draft_kind]
    plain_engine = make_engine(target_model)
    engine = tree_engine(target_model, draft)
    for prompt in PROMPTS:
        expected = plain_engine.generate(
            prompt, SamplingParams(max_tokens=30), SpeculativeConfig(method="none")
        ).token_ids
        out = engine.generate(
            prompt,
            SamplingParams(max_tokens=30),
            SpeculativeConfig(method="tree", num_speculative_tokens=num_nodes, schedule="constant"),
        )
        assert out.token_ids == expected
        if draft_kind == "target":
            assert out.metrics.spec.mean_acceptance_length > 1.5  # the best path is always right


def test_tree_beats_chain_in_acceptance_length_with_a_partial_draft(target_model, partial_draft_model):
    """Same draft, same nodes per pass: branches give the target more chances per pass."""
    chain = make_engine(target_model, partial_draft_model)
    tree = tree_engine(target_model, partial_draft_model, branching=3)
    lengths = {}
    for name, engine, method in (("chain", chain, "draft"), ("tree", tree, "tree")):
        stats = [
            engine.generate(
                p,
                SamplingParams(max_tokens=30),
                SpeculativeConfig(method=method, num_speculative_tokens=6, schedule="constant"),
            ).metrics.spec
            for p in PROMPTS
        ]
        lengths[name] = sum(s.num_accepted_tokens for s in stats) / sum(s.num_drafts for s in stats)
    assert lengths["tree"] > lengths["chain"], lengths


def test_tree_sampling_follows_target_distribution():
    """20,000 three-token samples with bigram models and a branching tree draft."""
    from helpers import BigramTreeRunner, sequence_distribution

    target_table = torch.tensor(
        [[0.0, 1.0, 2.0, 0.5], [2.0, 0.0, 1.0, 1.5], [1.0, 1.0, 0.0, 2.0], [0.0, 2.0, 1.0, 0.0]]
    )
    draft_table = torch.tensor([[2.0, 0.0, 0.0, 1.0], [0.0, 2.0, 1.0, 0.0], [1.0, 0.0, 2.0, 0.0], [2.0, 1.0, 0.0, 1.0]])

    from helpers import CharTokenizer
    from verispec.engine import SpeculativeEngine

    engine = SpeculativeEngine(
        BigramTreeRunner(target_table),
        CharTokenizer("abcd"),
        eos_token_ids=[],
        proposers={"tree": DraftTreeProposer(BigramTreeRunner(draft_table), branching=2, max_depth=2)},
    )
    params = SamplingParams(temperature=1.0, max_tokens=3)
    counts = {}
    for seed in range(20000):
        out = engine.generate(
            [0],
            SamplingParams(temperature=1.0, max_tokens=3, seed=seed),
            SpeculativeConfig(method="tree", num_speculative_tokens=4),
        )
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    exact = sequence_distribution(target_table, params, first=0, length=3)
    tv = 0.5 * sum(abs(counts.get(seq, 0) / 20000 - p) for seq, p in exact.items())
    assert tv < 0.04, tv
