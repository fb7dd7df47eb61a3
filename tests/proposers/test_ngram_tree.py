"""N-gram branches as a token tree: matching, merging, budget, exactness, distribution."""

import random

import pytest
import torch

from helpers import BigramTreeRunner, CharTokenizer, make_engine, sequence_distribution, single_thread
from verispec.algorithms.sampling import SamplingParams
from verispec.algorithms.tree import TokenTree, tree_rejection_sample
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.policy import drafter_order
from verispec.proposers import DraftRequest
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.proposers.ngram import (
    NgramIndex,
    NgramProposer,
    NgramTreeProposer,
    find_ngram_match,
    find_ngram_matches,
    ngram_tree,
)
from verispec.runners.torch_runner import TransformersRunner


@pytest.mark.parametrize(
    "context, min_n, max_n, max_matches, expected",
    [
        ([1, 2, 3, 4], 1, 3, 4, []),  # nothing repeats
        ([5, 9, 5], 1, 3, 4, [(1, 1)]),
        ([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 4, [(2, 5), (2, 2)]),  # most recent first
        ([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 1, [(2, 5)]),  # capped
        ([9, 2, 7, 1, 2, 8, 1, 2], 1, 2, 4, [(2, 5), (1, 2)]),  # longest n first; start 5 not repeated for n=1
        ([3, 3, 3, 3, 3, 3, 3], 1, 1, 9, [(1, 6), (1, 5), (1, 4), (1, 3)]),  # at most 4 occurrences per n-gram
    ],
)
def test_find_ngram_matches(context, min_n, max_n, max_matches, expected):
    found = find_ngram_matches(context, min_n, max_n, max_matches)
    assert found == expected
    assert (found[0] if found else None) == find_ngram_match(context, min_n, max_n)


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 3), (2, 4)])
def test_incremental_index_matches_agree_with_reference(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(20):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        index = NgramIndex(min_n, max_n)
        for i, token in enumerate(context):
            index.extend([token])
            assert index.matches(3) == find_ngram_matches(context[: i + 1], min_n, max_n, 3)
            assert index.match() == find_ngram_match(context[: i + 1], min_n, max_n)


def test_index_keeps_a_bounded_number_of_occurrences():
    index = NgramIndex(1, 1, max_occurrences=2)
    index.extend([7] * 100)
    assert all(len(starts) <= 2 for table in index._tables.values() for starts in table.values())


@pytest.mark.parametrize(
    "continuations, num_nodes, token_ids, parents",
    [
        ([], 5, (0,), (-1,)),  # no match: only the root
        ([[1, 2, 3]], 0, (0,), (-1,)),  # no budget
        ([[1, 2, 3]], 2, (0, 1, 2), (-1, 0, 1)),  # one match, cut to the budget
        ([[1, 2, 3], [1, 2, 4]], 4, (0, 1, 2, 3, 4), (-1, 0, 1, 2, 2)),  # shared prefix [1, 2] merged
        ([[1, 2, 3], [1, 2, 3]], 9, (0, 1, 2, 3), (-1, 0, 1, 2)),  # equal continuations: one branch
        # distinct first tokens: the best match goes deep until its node scores fall below the
        # second match's first node (0.8**d vs 0.5 * 0.8), then they alternate by score
        ([[1, 2, 3, 4, 5], [6, 7]], 5, (0, 1, 2, 3, 4, 6), (-1, 0, 1, 2, 3, 0)),
        ([[1, 2, 3, 4, 5], [6, 7]], 3, (0, 1, 2, 3), (-1, 0, 1, 2)),
    ],
)
def test_ngram_tree(continuations, num_nodes, token_ids, parents):
    tree = ngram_tree(0, continuations, num_nodes)
    assert (tree.token_ids, tree.parents) == (token_ids, parents)
    assert tree.num_nodes - 1 <= num_nodes


def test_ngram_tree_budget_and_prefix_property():
    rng = random.Random(3)
    for _ in range(200):
        continuations = [[rng.randrange(3) for _ in range(rng.randrange(1, 8))] for _ in range(rng.randrange(1, 5))]
        budget = rng.randrange(0, 20)
        tree = ngram_tree(9, continuations, budget)
        trie_size = len({tuple(c[:d]) for c in continuations for d in range(1, len(c) + 1)})
        assert tree.num_nodes - 1 == min(budget, trie_size)
        paths = {tuple(tree.token_ids[j] for j in tree.path_to(i)) for i in range(1, tree.num_nodes)}
        assert len(paths) == tree.num_nodes - 1  # siblings never repeat a token
        for i in range(1, tree.num_nodes):  # every first-i nodes form a tree (selection order)
            assert tree.parents[i] < i


def request(prompt, output=()):
    return DraftRequest(list(prompt), list(output), SamplingParams(), torch.Generator())


def test_proposer_tree_follows_the_request():
    proposer = NgramProposer(min_ngram=2, max_ngram=2)
    tree = proposer.propose_tree(request([1, 2, 7, 1, 2, 8, 1, 2]), 5)
    # two branches: after [1, 2] came 8 (most recent; the copy repeats with period 3) and 7
    assert tree == TokenTree.from_paths(2, [[8, 1, 2, 8], [7]])
    assert proposer.propose_tree(request([1, 2, 7, 1, 2, 8, 1, 2], [5]), 4).num_nodes == 1  # no match
    wrapped = NgramTreeProposer(proposer)
    assert wrapped.propose(request([4, 5]), 4).draft_token_ids == []
    out = wrapped.propose(request([1, 2, 7, 1, 2, 8, 1, 2]), 5)
    assert out.tree == tree and out.draft_token_ids == [8, 1, 2, 8, 7]


@pytest.mark.parametrize(
    "method, loaded, order",
    [
        ("tree", ["ngram", "ngram-tree", "tree"], ["ngram-tree", "tree"]),  # n-gram branches first
        ("tree", ["ngram", "ngram-tree"], ["ngram-tree"]),  # no draft model: n-gram trees alone
        ("auto", ["ngram", "ngram-tree", "draft"], ["ngram", "draft"]),  # chain methods unchanged
    ],
)
def test_tree_drafter_order(method, loaded, order):
    assert drafter_order(method, loaded) == order


SERVING = [ord(c) % 96 for c in "serving " * 48]
SEVERAL = [5, 17, 33, 2, 5, 17, 40, 9, 5, 17, 61, 3, 5, 17, 33, 2, 5, 17]  # [5, 17] went on 3 ways


def test_several_continuations_make_several_branches():
    proposer = NgramProposer()
    tree = proposer.propose_tree(request(SEVERAL), 12)
    assert [tree.token_ids[c] for c in tree.children(0)] == [40, 33, 61] and tree.num_nodes == 13
    # longest n first: the 4-gram match (-> 40) goes deepest, the 2-gram ones branch off it
    assert [tree.token_ids[c] for c in tree.children(0)[:2]] == [40, 33]
    assert len(proposer.propose_tree(request(SEVERAL), 8).children(0)) == 2


@pytest.fixture(scope="module")
def plain(target_model):
    engine = make_engine(target_model, max_context_length=512)
    return {
        name: engine.generate(prompt, SamplingParams(max_tokens=24), SpeculativeConfig(method="none")).token_ids
        for name, prompt in (("serving", SERVING), ("several", SEVERAL))
    }


@pytest.mark.parametrize("num_nodes", range(1, 17))
def test_greedy_ngram_tree_equals_plain(num_nodes, target_model, partial_draft_model, plain):
    ngram_only = make_engine(target_model, max_context_length=512)
    draft_runner = TransformersRunner(partial_draft_model, max_context_length=512)
    with_draft = make_engine(
        target_model, max_context_length=512, proposers={"tree": DraftTreeProposer(draft_runner, max_depth=4)}
    )
    spec = SpeculativeConfig(method="tree", num_speculative_tokens=num_nodes, schedule="constant")
    for name, prompt in (("serving", SERVING), ("several", SEVERAL)):
        for engine in (ngram_only, with_draft):
            out = engine.generate(prompt, SamplingParams(max_tokens=24), spec)
            assert out.token_ids == plain[name], (name, num_nodes)
            if name == "serving" and num_nodes > 1:
                assert "ngram-tree" in out.metrics.spec.per_drafter


def total_variation(counts, probs):
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_two_branch_deterministic_tree_keeps_target_distribution_over_20000_draws():
    """One-hot candidates, no draft probabilities: the multi-candidate scheme is exact."""
    tree = ngram_tree(0, [[1, 3], [2, 4]], 4)  # root -> 1 -> 3 and root -> 2 -> 4
    assert len(tree.children(0)) == 2 and tree.num_nodes == 5
    node_of = {tree.token_ids[i]: i for i in range(1, tree.num_nodes)}
    p_root = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])
    p_1 = torch.tensor([0.05, 0.05, 0.3, 0.4, 0.2])
    p_2 = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.4])
    rows = {0: p_root, node_of[1]: p_1, node_of[2]: p_2}
    target_probs = torch.stack([rows.get(i, torch.full((5,), 0.2)) for i in range(tree.num_nodes)])
    generator = torch.Generator().manual_seed(11)
    first, after = torch.zeros(5), {1: torch.zeros(5), 2: torch.zeros(5)}
    for _ in range(20000):
        tokens = tree_rejection_sample(tree, target_probs, generator).token_ids
        first[tokens[0]] += 1
        if tokens[0] in after:
            after[tokens[0]][tokens[1]] += 1
    assert total_variation(first, p_root) < 0.02  # std of each frequency < 0.0035
    assert total_variation(after[1], p_1) < 0.03 and after[1].sum() > 4000
    assert total_variation(after[2], p_2) < 0.035 and after[2].sum() > 2500


def test_ngram_tree_sampling_through_the_engine_follows_target_distribution():
    """20,000 samples of 8 tokens, first 3 compared with the exact distribution; the prompt gives
    every token two different successors, so the trees branch at the root."""
    target_table = torch.tensor(
        [[0.0, 1.0, 2.0, 0.5], [2.0, 0.0, 1.0, 1.5], [1.0, 1.0, 0.0, 2.0], [0.0, 2.0, 1.0, 0.0]]
    )
    prompt = [0, 1, 0, 2, 1, 2, 1, 3, 2, 3, 2, 0, 3, 0, 3, 1]
    ngram = NgramProposer(min_ngram=1, max_ngram=2)
    assert all(len(ngram.propose_tree(request(prompt + [t]), 6).children(0)) >= 2 for t in range(4))
    engine = SpeculativeEngine(
        BigramTreeRunner(target_table), CharTokenizer("abcd"), eos_token_ids=[], proposers={"ngram": ngram}
    )
    spec = SpeculativeConfig(method="tree", num_speculative_tokens=6, schedule="constant")
    counts, tree_steps = {}, 0
    for seed in range(20000):
        out = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=seed), spec)
        counts[tuple(out.token_ids[:3])] = counts.get(tuple(out.token_ids[:3]), 0) + 1
        tree_steps += out.metrics.spec.per_drafter["ngram-tree"].num_drafts
    assert tree_steps >= 20000
    exact = sequence_distribution(target_table, SamplingParams(temperature=1.0), first=prompt[-1], length=3)
    tv = 0.5 * sum(abs(counts.get(seq, 0) / 20000 - p) for seq, p in exact.items())
    assert tv < 0.04, tv
