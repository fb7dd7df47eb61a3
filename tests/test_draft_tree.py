"""Dynamic-tree drafting with a draft model."""

import torch

from helpers import make_engine
from verispec.engine import SpeculativeConfig
from verispec.proposers import DraftRequest
from verispec.proposers.draft_tree import Candidate, DraftTreeProposer, select_candidates
from verispec.runners.torch_runner import TransformersRunner
from verispec.sampling import SamplingParams


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
