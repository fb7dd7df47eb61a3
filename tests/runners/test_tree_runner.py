"""One target pass over a token tree equals plain decoding of each path; KV compaction is exact."""

import torch

from verispec.algorithms.tree import TokenTree, tree_attention_mask, tree_position_ids
from verispec.runners import prefill
from verispec.runners.torch_runner import TransformersRunner

CONTEXT = [3, 14, 15, 92, 65]
TREE = TokenTree((35, 8, 9, 79, 32, 38), (-1, 0, 0, 1, 1, 3))  # 35 -> {8 -> {79 -> 38, 32}, 9}


def tree_logits(model):
    runner = TransformersRunner(model)
    prefill(runner, CONTEXT)
    cached = runner.num_cached_tokens
    logits = runner.forward_tree(
        list(TREE.token_ids), tree_position_ids(TREE, cached), tree_attention_mask(TREE, cached)
    )
    return runner, logits


def test_each_node_scores_like_its_path_decoded_plainly(target_model):
    _, logits = tree_logits(target_model)
    for node in range(TREE.num_nodes):
        path_tokens = [TREE.token_ids[0]] + [TREE.token_ids[i] for i in TREE.path_to(node)]
        fresh = TransformersRunner(target_model).forward(CONTEXT + path_tokens, num_logits=1)[0]
        assert torch.allclose(logits[node], fresh, atol=1e-4, rtol=1e-4), node


def test_keep_tree_path_equals_fresh_prefill(target_model):
    for accepted in ([], [1], [1, 3, 5], [2]):
        runner, _ = tree_logits(target_model)
        runner.keep_tree_path(len(CONTEXT), [0] + accepted)  # root + accepted nodes
        tokens = CONTEXT + [TREE.token_ids[0]] + [TREE.token_ids[i] for i in accepted]
        assert runner.num_cached_tokens == len(tokens)
        after = runner.forward([7])
        expected = TransformersRunner(target_model).forward(tokens + [7], num_logits=1)
        assert torch.allclose(after, expected, atol=1e-4, rtol=1e-4), accepted
