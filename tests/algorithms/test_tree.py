"""Token trees on small hand-drawn examples: layout, masks, greedy and sampled verification."""

import pytest
import torch

from verispec.algorithms.tree import (
    TokenTree,
    greedy_tree_verify,
    tree_attention_mask,
    tree_position_ids,
    tree_rejection_sample,
)

# Hand-drawn trees (node: token, parent). Root 0 is the last committed token.
CHAIN = TokenTree.chain(10, [11, 12, 13])  # 0 - 1 - 2 - 3
STAR = TokenTree((10, 11, 12, 13), (-1, 0, 0, 0))  # root with three children
TWO_LEVEL = TokenTree((10, 11, 12, 13, 14), (-1, 0, 0, 1, 1))  # 0 -> {1 -> {3, 4}, 2}


@pytest.mark.parametrize(
    "tree, depths",
    [(CHAIN, [0, 1, 2, 3]), (STAR, [0, 1, 1, 1]), (TWO_LEVEL, [0, 1, 1, 2, 2])],
)
def test_depths_and_positions(tree, depths):
    assert tree.depths() == depths
    assert tree_position_ids(tree, num_cached_tokens=7).tolist() == [7 + d for d in depths]


def test_masks_of_hand_drawn_trees():
    # two cached tokens, then the nodes; each row: context + ancestors + itself
    assert tree_attention_mask(CHAIN, 2).int().tolist() == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]
    assert tree_attention_mask(STAR, 1).int().tolist() == [
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # a child never sees its siblings
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ]
    assert tree_attention_mask(TWO_LEVEL, 0).int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],  # node 3 sees root, its parent 1, itself; not cousin 2
        [1, 1, 0, 0, 1],
    ]


def test_from_paths_merges_shared_prefixes():
    tree = TokenTree.from_paths(10, [[11, 13], [11, 14], [12]])
    # depth-first in path order: 11, 11/13, 11/14, then 12
    assert tree == TokenTree((10, 11, 13, 14, 12), (-1, 0, 1, 1, 0))
    assert tree.path_to(3) == [1, 3] and tree.path_to(0) == []


@pytest.mark.parametrize("parents", [(0, 0), (-1, 1), (-1, 0, 3, 0)])
def test_invalid_parents_are_refused(parents):
    with pytest.raises(ValueError):
        TokenTree(tuple(range(len(parents))), parents)


@pytest.mark.parametrize(
    "tree, target, accepted, tokens",
    [
        (CHAIN, [11, 12, 13, 99], [1, 2, 3], [11, 12, 13, 99]),  # whole chain, bonus 99
        (CHAIN, [11, 50, 13, 99], [1], [11, 50]),  # mismatch at depth 2: target's 50
        (STAR, [13, 0, 0, 42], [3], [13, 42]),  # third child matches, then its row's token
        (STAR, [77, 0, 0, 0], [], [77]),  # no child matches: plain step
        (TWO_LEVEL, [11, 14, 0, 0, 5], [1, 4], [11, 14, 5]),  # goes down the second grandchild
        (TWO_LEVEL, [12, 14, 8, 0, 5], [2], [12, 8]),  # second branch, leaf, then its row
    ],
)
def test_greedy_tree_verify(tree, target, accepted, tokens):
    result = greedy_tree_verify(tree, torch.tensor(target))
    assert (result.accepted_nodes, result.token_ids) == (accepted, tokens)
    assert result.num_accepted_tokens == len(accepted)


def total_variation(counts, probs):
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_tree_sampling_keeps_target_distribution_over_20000_draws():
    """Root children {1, 2}, node 1's children {3, 4}; vocabulary of 5 tokens."""
    tree = TokenTree((0, 1, 2, 3, 4), (-1, 0, 0, 1, 1))
    p_root = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])
    p_after_1 = torch.tensor([0.05, 0.05, 0.3, 0.4, 0.2])
    other = torch.full((5,), 0.2)
    target_probs = torch.stack([p_root, p_after_1, other, other, other])
    generator = torch.Generator().manual_seed(7)
    first, second_after_1 = torch.zeros(5), torch.zeros(5)
    for _ in range(20000):
        tokens = tree_rejection_sample(tree, target_probs, generator).token_ids
        first[tokens[0]] += 1
        if tokens[0] == 1:
            second_after_1[tokens[1]] += 1
    # std of each frequency < 0.0035 at 20,000 draws; 0.02 TV is far outside noise
    assert total_variation(first, p_root) < 0.02
    assert second_after_1.sum() > 4000
    assert total_variation(second_after_1, p_after_1) < 0.03
    # the draft's candidates alone (uniform over children) would be far from the target
    assert total_variation(torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0]), p_root) > 0.4


def test_tree_sampling_accepts_a_sure_candidate():
    tree = STAR
    target_probs = torch.zeros(4, 20)
    target_probs[0, 12] = 1.0  # the target is certain of token 12: second child
    target_probs[2, 5] = 1.0
    result = tree_rejection_sample(tree, target_probs, torch.Generator().manual_seed(0))
    assert result.accepted_nodes == [2] and result.token_ids == [12, 5]
