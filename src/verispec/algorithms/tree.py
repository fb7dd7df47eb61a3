"""Token trees: their flat layout for one target pass, and lossless verification of all branches.

Owns the tree structure (parent indices), the position ids and attention mask that let one
forward score every node, greedy tree verification, and multi-candidate rejection sampling.
Pure functions over lists and tensors; knows nothing about models, caches or drafters.

Layout: node 0 is the *root*, the last committed token (not yet in the KV cache); nodes 1..N are
drafted tokens with ``parents[i] < i`` (topological order). The target runs all N + 1 tokens in
one forward; row i of its output scores the token that follows node i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.algorithms.sampling import sample_from


@dataclass(frozen=True)
class TokenTree:
    """A draft tree. ``token_ids[0]`` is the root (last committed token); ``parents[0] == -1``.

    Attributes:
        token_ids: ``[num_nodes]`` token of each node.
        parents: ``[num_nodes]`` parent index of each node, ``parents[i] < i`` for i >= 1.
    Raises:
        ValueError: lengths differ, or a parent index is not an earlier node.
    """

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents) or not self.token_ids:
            raise ValueError("token_ids and parents must have the same, non-zero length")
        if self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"parents must be -1 for the root and an earlier node otherwise: {self.parents}")

    @classmethod
    def chain(cls, root: int, draft_token_ids: Sequence[int]) -> TokenTree:
        """A single branch: the tree form of a chain draft."""
        return cls((root, *draft_token_ids), tuple(range(-1, len(draft_token_ids))))

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]]) -> TokenTree:
        """Merge token paths that share prefixes (Medusa-style ``choices`` filled with tokens)."""
        token_ids, parents, index = [root], [-1], {(): 0}
        for path in paths:
            for depth in range(1, len(path) + 1):
                key = tuple(path[:depth])
                if key not in index:
                    index[key] = len(token_ids)
                    token_ids.append(int(path[depth - 1]))
                    parents.append(index[key[:-1]])
        return cls(tuple(token_ids), tuple(parents))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    def depths(self) -> list[int]:
        """Depth of each node; the root has depth 0."""
        depth = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in index order (the order candidates are tried in)."""
        return [i for i in range(node + 1, self.num_nodes) if self.parents[i] == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def tree_position_ids(tree: TokenTree, num_cached_tokens: int) -> Tensor:
    """``[num_nodes]`` int64: position of each node = cached length + depth."""
    return torch.tensor(tree.depths(), dtype=torch.long) + num_cached_tokens


def tree_attention_mask(tree: TokenTree, num_cached_tokens: int) -> Tensor:
    """``[num_nodes, num_cached_tokens + num_nodes]`` bool: True where a node may attend.

    Every node sees the whole cached context, itself, and its ancestors; never a sibling or a
    cousin (SpecInfer, Miao et al. 2024, §4.2 "tree attention").
    """
    n = tree.num_nodes
    mask = torch.zeros(n, num_cached_tokens + n, dtype=torch.bool)
    mask[:, :num_cached_tokens] = True
    for i in range(n):
        node = i
        while node >= 0:
            mask[i, num_cached_tokens + node] = True
            node = tree.parents[node]
    return mask


@dataclass(frozen=True)
class TreeVerifyResult:
    """Accepted path (node indices below the root) and the tokens to emit (path tokens + one)."""

    accepted_nodes: list[int]
    token_ids: list[int]

    @property
    def num_accepted_tokens(self) -> int:
        return len(self.accepted_nodes)


def greedy_tree_verify(tree: TokenTree, target_token_ids: Tensor) -> TreeVerifyResult:
    """Follow the target's argmax down the tree: the longest root path where every node's token
    is the target's choice at its parent, then the target's own token after it.

    Args:
        target_token_ids: ``[num_nodes]`` int64, argmax of the target's row for each node.
    """
    node, accepted = 0, []
    while True:
        wanted = int(target_token_ids[node])
        match = next((c for c in tree.children(node) if tree.token_ids[c] == wanted), None)
        if match is None:
            return TreeVerifyResult(accepted, [tree.token_ids[c] for c in accepted] + [wanted])
        accepted.append(match)
        node = match


def tree_rejection_sample(tree: TokenTree, target_probs: Tensor, generator: torch.Generator) -> TreeVerifyResult:
    """Multi-candidate rejection sampling for *deterministic* candidates (each child a one-hot
    proposal, e.g. the top-b children of a draft, or n-gram branches).

    At a node with target distribution ``p``, children are tried in order: child token x is
    accepted with probability ``p[x]``; on rejection ``p <- normalize(p with x set to 0)``. If all
    are rejected the token is drawn from the final ``p``. The emitted token at each step is
    therefore distributed exactly as ``p`` (recursive rejection sampling, Yang et al. 2024,
    "Multi-Candidate Speculative Decoding", §3; SpecInfer, Miao et al. 2024, §4.3, with one-hot
    draft distributions). ``target_probs`` is ``[num_nodes, vocab]`` float32.
    """
    node, accepted = 0, []
    while True:
        probs = target_probs[node].clone()
        chosen = None
        for child in tree.children(node):
            token = tree.token_ids[child]
            if float(probs.sum()) <= 0:
                break
            probs_now = probs / probs.sum()
            if float(torch.rand((), generator=generator)) < float(probs_now[token]):
                chosen = child
                break
            probs[token] = 0.0
        if chosen is None:
            total = probs.sum()
            final = probs / total if total > 0 else target_probs[node]
            return TreeVerifyResult(accepted, [tree.token_ids[c] for c in accepted] + [sample_from(final, generator)])
        accepted.append(chosen)
        node = chosen
