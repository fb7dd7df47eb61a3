"""Tree drafting with a draft model: a dynamic tree of the most probable continuations.

Owns the draft runner's cache while drafting a tree (one draft forward per tree level, all
frontier nodes in one pass with a tree mask) and the choice of which nodes to keep. Knows
nothing about the target or about verification; the tree is returned with the context's last
token as its root (see :mod:`verispec.tree`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

from verispec.proposers import DraftOutput, DraftRequest, common_prefix_length
from verispec.sampling import process_logits
from verispec.tree import TokenTree, tree_attention_mask, tree_position_ids


@dataclass(frozen=True)
class Candidate:
    """A possible tree node: its path log-probability under the draft, parent node and token."""

    log_prob: float
    parent: int
    token_id: int


def select_candidates(candidates: Sequence[Candidate], budget: int) -> list[Candidate]:
    """The ``budget`` candidates with the highest path log-probability (EAGLE-2, Li et al. 2024,
    §4.1: the draft's confidence approximates acceptance), ordered by parent, then score, so the
    tree stays in topological order. Ties go to the earlier candidate."""
    best = heapq.nlargest(budget, enumerate(candidates), key=lambda item: (item[1].log_prob, -item[0]))
    return [c for _, c in sorted(best, key=lambda item: (item[1].parent, -item[1].log_prob, item[0]))]


class DraftTreeProposer:
    """Dynamic-tree drafting (EAGLE-2 style): expand the top ``branching`` children of each
    frontier node, keep the best nodes by path probability, level by level.

    The children are a deterministic function of the draft's (processed) distribution, so
    verification treats them as one-hot candidates (:func:`verispec.tree.tree_rejection_sample`).

    Args:
        runner: the draft runner; it must offer ``forward_tree`` (e.g. TransformersRunner).
        branching: children expanded per node, >= 1.
        max_depth: tree depth limit, >= 1.
    """

    def __init__(self, runner, *, branching: int = 2, max_depth: int = 6) -> None:
        if branching < 1 or max_depth < 1:
            raise ValueError("branching and max_depth must be >= 1")
        self.runner = runner
        self.branching = branching
        self.max_depth = max_depth
        self._cached_token_ids: list[int] = []

    def propose_tree(self, request: DraftRequest, num_nodes: int) -> TokenTree:
        """A tree of at most ``num_nodes`` drafted nodes below the root (the last context token)."""
        context = request.context
        root = TokenTree((context[-1],), (-1,))
        room = self.runner.max_context_length - len(context) - 1
        num_nodes = min(num_nodes, room)
        if num_nodes <= 0:
            return root
        keep = min(common_prefix_length(self._cached_token_ids, context), len(context) - 1)
        self.runner.truncate(keep)
        root_logits = self.runner.forward(context[keep:], num_logits=1)
        self._cached_token_ids = list(context)
        num_prefix = len(context) - 1  # the root sits at cache slot num_prefix
        token_ids, parents, log_probs = [context[-1]], [-1], [0.0]
        frontier, frontier_logits = [0], root_logits
        for _ in range(self.max_depth):
            candidates = []
            tree = TokenTree(tuple(token_ids), tuple(parents))
            for row, node in enumerate(frontier):
                path = [token_ids[i] for i in tree.path_to(node)]
                rows = process_logits(
                    frontier_logits[row : row + 1], request.params, request.prompt_token_ids,
                    list(request.output_token_ids) + path,
                )
                dist = torch.log_softmax(frontier_logits[row : row + 1], -1)[0] if rows.probs is None else rows.probs[0].log()
                top = torch.topk(dist, self.branching)
                candidates += [
                    Candidate(log_probs[node] + float(lp), node, int(t))
                    for lp, t in zip(top.values.tolist(), top.indices.tolist())
                    if lp > float("-inf")
                ]
            chosen = select_candidates(candidates, num_nodes + 1 - len(token_ids))
            if not chosen:
                break
            first_new = len(token_ids)
            for c in chosen:
                token_ids.append(c.token_id)
                parents.append(c.parent)
                log_probs.append(c.log_prob)
            frontier = list(range(first_new, len(token_ids)))
            if len(token_ids) > num_nodes:
                break
            tree = TokenTree(tuple(token_ids), tuple(parents))
            mask = tree_attention_mask(tree, num_prefix)[first_new:]
            positions = tree_position_ids(tree, num_prefix)[first_new:]
            frontier_logits = self.runner.forward_tree(token_ids[first_new:], positions, mask)
        self.runner.truncate(len(context))  # drop the drafted nodes; the context stays cached
        return TokenTree(tuple(token_ids), tuple(parents))

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        """The proposer protocol: a tree of at most ``num_speculative_tokens`` nodes."""
        tree = self.propose_tree(request, num_speculative_tokens)
        return DraftOutput(draft_token_ids=list(tree.token_ids[1:]), tree=tree)

    def observe(self, num_accepted_tokens: int) -> None:
        """Nothing to do: the next proposal rolls the cache back to the shared prefix."""

