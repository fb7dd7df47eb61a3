"""Tree drafting with a draft model: a dynamic tree of the most probable continuations.

Owns the draft runner's cache while drafting a tree (one draft forward per tree level, all
frontier nodes in one pass with a tree mask) and the choice of which nodes to keep. Knows
nothing about the target or about verification; the tree is returned with the context's last
token as its root (see :mod:`verispec.algorithms.tree`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.algorithms.coupling import gumbel_noise
from verispec.algorithms.draft import DraftOutput
from verispec.algorithms.sampling import process_logits
from verispec.algorithms.step import coupling_key
from verispec.algorithms.tree import TokenTree, tree_attention_mask, tree_position_ids
from verispec.errors import InvalidParameterError
from verispec.proposers.base import DraftCacheSequences, DrafterSources, DraftRequest
from verispec.proposers.declared import AutoRole, Declaration, Kind, Needs
from verispec.proposers.draft_model import DRAFT_HINT


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


def top_children(
    request: DraftRequest, tree: TokenTree, node: int, logits: Tensor, count: int
) -> tuple[list[float], list[int]]:
    """The ``count`` most probable draft tokens after ``node`` of ``tree`` (``logits``: ``[1,
    vocab]`` float32, the draft's row for the node, over the target's vocabulary), processed as
    the target's rows are (penalties, grammar, temperature, top-k/p): their log-probabilities
    and ids, best first.

    Coupled sampling: the children are ranked by the draft's scores plus the target's noise at
    the child's position (:mod:`verispec.algorithms.coupling`), so the first child is the draft's
    own coupled sample, the one the target's most likely agrees with; the r-th child is scored
    with the r-th highest draft log-probability (its rank, not its own probability)."""
    path = [tree.token_ids[i] for i in tree.path_to(node)]
    rows = process_logits(
        logits,
        request.params,
        request.prompt_token_ids,
        list(request.output_token_ids) + path,
        allowed=request.allowed_after(path, logits.shape[-1]),
    )
    dist = torch.log_softmax(rows.logits, -1)[0] if rows.probs is None else rows.probs[0].log()
    top = torch.topk(dist, min(count, dist.shape[-1]))
    if rows.scores is None:
        return top.values.tolist(), top.indices.tolist()
    position = len(request.prompt_token_ids) + len(request.output_token_ids) + len(path)
    noise = gumbel_noise(coupling_key(request.generator), position, dist.shape[-1])
    perturbed = torch.topk(rows.scores[0].double() + noise, min(count, dist.shape[-1]))
    return top.values.tolist(), perturbed.indices.tolist()


def grow_dynamic_tree(
    request: DraftRequest,
    root_logits: Tensor,
    num_nodes: int,
    branching: int,
    max_depth: int,
    score_level: Callable[[list[int], list[int], int], Tensor],
) -> TokenTree:
    """A dynamic draft tree (EAGLE-2, Li et al. 2024, arXiv 2406.16858, §4: expand the top
    ``branching`` children of every frontier node, keep the ``num_nodes`` best by path
    probability, level by level, at most ``max_depth`` levels).

    Args:
        root_logits: float32 ``[1, vocab]`` the drafter's row for the root (the context's last
            token, ``request.context[-1]``).
        score_level: ``(token_ids, parents, first_new) -> [len(token_ids) - first_new, vocab]``
            float32: the drafter's rows for the nodes ``first_new ..`` of the tree so far (one
            pass over the new level); never called for the last level.
    Returns:
        The tree, root first, nodes in topological order, at most ``num_nodes`` below the root.
    """
    growth = dynamic_tree_levels(request, root_logits, num_nodes, branching, max_depth)
    try:
        level = next(growth)
        while True:
            level = growth.send(score_level(*level))
    except StopIteration as done:
        return done.value


def dynamic_tree_levels(
    request: DraftRequest, root_logits: Tensor, num_nodes: int, branching: int, max_depth: int
) -> Generator[tuple[list[int], list[int], int], Tensor, TokenTree]:
    """:func:`grow_dynamic_tree` as a generator, so several trees can grow in shared passes: it
    yields each level to score, ``(token_ids, parents, first_new)``, is sent that level's rows
    (``[len(token_ids) - first_new, vocab]`` float32) and returns the tree."""
    token_ids, parents, log_probs = [request.context[-1]], [-1], [0.0]
    frontier, frontier_logits = [0], root_logits
    for _ in range(max_depth):
        candidates = []
        tree = TokenTree(tuple(token_ids), tuple(parents))
        for row, node in enumerate(frontier):
            values, ids = top_children(request, tree, node, frontier_logits[row : row + 1], branching)
            candidates += [
                Candidate(log_probs[node] + float(lp), node, int(t)) for lp, t in zip(values, ids) if lp > float("-inf")
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
        frontier_logits = yield list(token_ids), list(parents), first_new
    return TokenTree(tuple(token_ids), tuple(parents))


def validate_tree_choices(choices) -> tuple[tuple[int, ...], ...]:
    """A static tree shape (Medusa-style ``choices``, Cai et al. 2024, §2.1.2) in tree order.

    Args:
        choices: paths of child ranks, e.g. ``[[0], [1], [0, 0], [0, 1], [0, 0, 0]]``: ``[0, 1]``
            is the second most probable child of the most probable child of the root. Every
            path's prefix must be a path too; no duplicates; ranks are ints >= 0.
    Returns:
        The paths sorted by (length, ranks), so the first m always form a tree (a prefix comes
        before its extensions) and siblings are in rank order.
    Raises:
        InvalidParameterError: empty, not a list of lists of non-negative ints, a duplicate, or
            a path whose prefix is missing.
    """
    if not isinstance(choices, (list, tuple)) or not choices:
        raise InvalidParameterError("tree choices must be a non-empty list of paths such as [[0], [1], [0, 0]]")
    paths = set()
    for path in choices:
        if (
            not isinstance(path, (list, tuple))
            or not path
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in path)
        ):
            raise InvalidParameterError(f"each tree choice must be a non-empty list of ranks >= 0, got {path!r}")
        if tuple(path) in paths:
            raise InvalidParameterError(f"tree choice {list(path)} is repeated")
        paths.add(tuple(path))
    for path in paths:
        if len(path) > 1 and path[:-1] not in paths:
            raise InvalidParameterError(f"tree choice {list(path)} needs its prefix {list(path[:-1])} too")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


class DraftTreeProposer(DraftCacheSequences):
    """Dynamic-tree drafting (EAGLE-2 style): expand the top ``branching`` children of each
    frontier node, keep the best nodes by path probability, level by level.

    The children are a deterministic function of the draft's (processed) distribution, so
    verification treats them as one-hot candidates (:func:`verispec.algorithms.tree.tree_rejection_sample`);
    under coupled sampling the draft's own coupled sample comes first (:func:`top_children`).

    Args:
        runner: the draft runner; it must offer ``forward_tree`` (e.g. TransformersRunner).
        branching: children expanded per node, >= 1.
        max_depth: tree depth limit, >= 1.
        choices: a static tree shape instead (:func:`validate_tree_choices`): rank r at a node
            is the r-th most probable draft token there. A budget smaller than the shape keeps
            its first paths in (length, ranks) order. ``branching`` and ``max_depth`` are then
            unused. Nodes the processed draft distribution gives probability 0 (top-k/top-p)
            are left out, with their subtrees.
        context_window: prompt tokens the draft sees, the last ones; None: all
            (:class:`~verispec.proposers.DraftCacheSequences`).
    """

    declaration = Declaration(
        "tree",
        Kind.TREE,
        Needs.DRAFT_MODEL,
        DRAFT_HINT,
        chain="draft",
        auto=AutoRole.BACKUP,
        in_tree_method=True,
        priority=41,
        summary="token trees: n-gram branches where the lookup matches, else the draft model's tree",
    )

    @classmethod
    def build(cls, sources: DrafterSources) -> DraftTreeProposer | None:
        """The draft model's trees over ``tree_runner`` (the options' static shape, else dynamic),
        on the chain's own sequence where the two share a runner; None without one."""
        if sources.tree_runner is None:
            return None
        options = sources.options
        tree = cls(sources.tree_runner, choices=options.tree_choices, context_window=options.draft_context_window)
        chain = (sources.built or {}).get("draft")
        if sources.tree_runner is sources.draft_runner and chain is not None:  # switching catches up on nothing
            return tree.on_sequence_of(chain)
        return tree

    def __init__(
        self, runner, *, branching: int = 2, max_depth: int = 6, choices=None, context_window: int | None = None
    ) -> None:
        if branching < 1 or max_depth < 1:
            raise ValueError("branching and max_depth must be >= 1")
        self.runner = runner
        self.context_window = context_window
        self.branching = branching
        self.max_depth = max_depth
        self.choices = validate_tree_choices(choices) if choices is not None else None
        self.cached_token_ids: list[int] = []

    def propose_tree(self, request: DraftRequest, num_nodes: int) -> TokenTree:
        """A tree of at most ``num_nodes`` drafted nodes below the root (the last context token)."""
        self.note_prompt(request)
        context = self.draft_context(request)
        root = TokenTree((context[-1],), (-1,))
        room = self.runner.max_context_length - len(context) - 1
        num_nodes = min(num_nodes, room)
        if num_nodes <= 0:
            return root
        keep = self.reusable_prefix(context)
        self.runner.truncate(keep)
        self.cached_token_ids = self.cached_token_ids[:keep]
        root_logits = self.runner.forward(self.feed_long_context(context[keep:]), num_logits=1)
        self.cached_token_ids = list(context)
        if self.choices is not None:
            tree = self._static_tree(request, len(context) - 1, num_nodes, root_logits)
        else:
            tree = self._dynamic_tree(request, len(context) - 1, num_nodes, root_logits)
        self.runner.truncate(len(context))  # drop the drafted nodes; the context stays cached
        return tree

    def _forward_level(self, token_ids: list[int], parents: list[int], first_new: int, num_prefix: int):
        """Draft logits ``[num_new, vocab]`` of the nodes from ``first_new`` on (one tree-masked pass)."""
        tree = TokenTree(tuple(token_ids), tuple(parents))
        mask = tree_attention_mask(tree, num_prefix)[first_new:]
        positions = tree_position_ids(tree, num_prefix)[first_new:]
        return self.runner.forward_tree(token_ids[first_new:], positions, mask)

    def _static_tree(self, request: DraftRequest, num_prefix: int, num_nodes: int, root_logits) -> TokenTree:
        """Expand exactly the first ``num_nodes`` paths of :attr:`choices`, one level per pass
        (``num_prefix``: the draft cache slot of the root)."""
        choices = self.choices[:num_nodes]
        token_ids, parents, node_of = [request.context[-1]], [-1], {(): 0}
        logits_of = {0: root_logits}  # node -> its draft logits [1, vocab]
        for depth in range(1, max((len(p) for p in choices), default=0) + 1):
            tree = TokenTree(tuple(token_ids), tuple(parents))
            level = [p for p in choices if len(p) == depth and p[:-1] in node_of]
            needed: dict[int, int] = {}
            for path in level:
                parent = node_of[path[:-1]]
                needed[parent] = max(needed.get(parent, 0), path[-1] + 1)
            top = {
                parent: top_children(request, tree, parent, logits_of[parent], count)
                for parent, count in needed.items()
            }
            first_new = len(token_ids)
            for path in level:
                parent = node_of[path[:-1]]
                log_probs, ids = top[parent]
                if path[-1] < len(ids) and log_probs[path[-1]] > float("-inf"):
                    node_of[path] = len(token_ids)
                    token_ids.append(int(ids[path[-1]]))
                    parents.append(parent)
            new_nodes = range(first_new, len(token_ids))
            deeper = any(len(p) == depth + 1 for p in choices)
            if not new_nodes or not deeper:
                break
            logits = self._forward_level(token_ids, parents, first_new, num_prefix)
            logits_of.update({node: logits[row : row + 1] for row, node in enumerate(new_nodes)})
        return TokenTree(tuple(token_ids), tuple(parents))

    def _dynamic_tree(self, request: DraftRequest, num_prefix: int, num_nodes: int, root_logits) -> TokenTree:
        """EAGLE-2 expansion over the draft model (``num_prefix``: the draft cache slot of the root)."""
        return grow_dynamic_tree(
            request,
            root_logits,
            num_nodes,
            self.branching,
            self.max_depth,
            lambda token_ids, parents, first_new: self._forward_level(token_ids, parents, first_new, num_prefix),
        )

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        """The proposer protocol: a tree of at most ``num_speculative_tokens`` nodes."""
        tree = self.propose_tree(request, num_speculative_tokens)
        return DraftOutput(draft_token_ids=list(tree.token_ids[1:]), tree=tree)

    def observe(self, num_accepted_tokens: int) -> None:
        """Nothing to do: the next proposal rolls the cache back to the shared prefix."""
