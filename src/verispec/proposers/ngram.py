"""N-gram (prompt lookup) drafter: copy what followed the last earlier occurrence of the context's tail.

Owns the matching rule (a pure function, the reference) and an index of the context's n-grams
that is extended by the new tokens of each step, so a proposal costs O(max_ngram) however long
the context is. Also builds a token *tree* from several matches (distinct continuations of the
same suffix become branches). Has no draft probabilities: verification treats its tokens as a
one-hot draft (a deterministic proposal). Knows nothing about models, verification or sampling.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from verispec.algorithms.draft import DraftOutput
from verispec.algorithms.tree import TokenTree
from verispec.errors import InvalidParameterError
from verispec.proposers.base import DrafterSources, DraftRequest, Proposer
from verispec.proposers.declared import AutoRole, Declaration, Kind

MAX_OCCURRENCES = 4  # most recent occurrences the index keeps per n-gram (tree branches come from them)


def find_ngram_match(context: Sequence[int], min_ngram: int, max_ngram: int) -> tuple[int, int] | None:
    """Where to copy from: ``(n, start)`` for the longest matching suffix n-gram, or None.

    For n from ``max_ngram`` down to ``min_ngram``, look for the most recent *earlier*
    occurrence of the last n tokens, i.e. ``context[start - n : start] == context[-n:]`` with
    ``start < len(context)`` (the suffix itself does not count; an occurrence may overlap it).
    The longest n wins; for one n the most recent occurrence (largest ``start``) wins.
    Prompt lookup decoding (Saxena 2023); vLLM ``NgramProposer``. O(len(context) * max_ngram):
    the reference that :class:`NgramIndex` must agree with.
    """
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n :])
        for start in range(length - 1, n - 1, -1):
            if list(context[start - n : start]) == suffix:
                return n, start
    return None


def find_ngram_matches(
    context: Sequence[int], min_ngram: int, max_ngram: int, max_matches: int, max_occurrences: int = MAX_OCCURRENCES
) -> list[tuple[int, int]]:
    """Several places to copy from, best first: ``[(n, start), ...]``, at most ``max_matches``.

    For n from ``max_ngram`` down to ``min_ngram``, the ``max_occurrences`` most recent earlier
    occurrences of the last n tokens (as in :func:`find_ngram_match`), most recent first. A start
    already found with a longer n is not repeated. The first entry is ``find_ngram_match``'s.
    O(len(context) * max_ngram): the reference that :meth:`NgramIndex.matches` must agree with.
    """
    length = len(context)
    found: list[tuple[int, int]] = []
    seen: set[int] = set()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n :])
        starts = [s for s in range(length - 1, n - 1, -1) if list(context[s - n : s]) == suffix][:max_occurrences]
        for start in starts:
            if start not in seen:
                seen.add(start)
                found.append((n, start))
    return found[:max_matches]


def ngram_tree(
    root: int,
    continuations: Sequence[Sequence[int]],
    num_nodes: int,
    *,
    branch_decay: float = 0.5,
    depth_decay: float = 0.8,
) -> TokenTree:
    """The best ``num_nodes`` nodes of the trie of ``continuations`` (best match first), as a tree.

    Args:
        root: the last context token (node 0).
        continuations: ``[num_matches][length]`` tokens that followed each match, best first
            (longest n, then most recent); equal prefixes share nodes (a trie).
        num_nodes: budget of nodes below the root, >= 0.
        branch_decay, depth_decay: the score of a trie node at depth d is
            ``sum over matches through it of branch_decay**rank * depth_decay**d``: a prior that
            match ``rank`` is the right one, times a per-token acceptance, so a node reached by
            several matches (REST, He et al. 2024: the retrieval trie weighted by frequency)
            or by a better match ranks higher. Nodes are taken best-first from the frontier,
            the EAGLE-2 selection (Li et al. 2024, §4.1) with this score in place of a draft
            probability, so the result is always a tree; ties go to the shallower, then the
            earlier node.
    Returns:
        A :class:`TokenTree` whose nodes are in selection order (the first i nodes below the root
        are the best i-node subtree); only the root when there is no continuation.
    """
    trie: dict[tuple[int, ...], float] = {}
    for rank, tokens in enumerate(continuations):
        for depth in range(1, len(tokens) + 1):
            key = tuple(int(t) for t in tokens[:depth])
            trie[key] = trie.get(key, 0.0) + branch_decay**rank * depth_decay**depth
    order = {key: i for i, key in enumerate(trie)}  # first insertion: best match, shallow first
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for key in trie:
        children.setdefault(key[:-1], []).append(key)
    token_ids, parents, node_of = [root], [-1], {(): 0}
    frontier = [(-trie[k], len(k), order[k], k) for k in children.get((), [])]
    heapq.heapify(frontier)
    while frontier and len(token_ids) <= num_nodes:
        key = heapq.heappop(frontier)[3]
        node_of[key] = len(token_ids)
        token_ids.append(key[-1])
        parents.append(node_of[key[:-1]])
        for child in children.get(key, []):
            heapq.heappush(frontier, (-trie[child], len(child), order[child], child))
    return TokenTree(tuple(token_ids), tuple(parents))


def copy_continuation(context: Sequence[int], start: int, num_tokens: int) -> list[int]:
    """``num_tokens`` tokens read from ``context[start:]``, continuing into the copy itself.

    An overlapping match (``start`` close to the end) says the text repeats with period
    ``len(context) - start``, so past the end the copy reads its own output (LZ77-style): on
    ``[a, b, a, b]`` copying from 2 gives ``a, b, a, b, ...`` instead of stopping after two.
    """
    length = len(context)
    out: list[int] = []
    for j in range(num_tokens):
        i = start + j
        out.append(int(context[i]) if i < length else out[i - length])
    return out


class NgramIndex:
    """Incremental form of :func:`find_ngram_match` over a context that only grows.

    For each n in ``[min_ngram, max_ngram]`` a dict maps an n-gram to the starts of the text
    that followed its ``max_occurrences`` most recent occurrences (oldest first, bounded).
    :meth:`extend` indexes the n-grams that now have a following token; :meth:`match` looks up
    the current suffix. Both cost O(max_ngram); :meth:`matches` O(max_ngram * max_occurrences).
    """

    def __init__(self, min_ngram: int, max_ngram: int, max_occurrences: int = MAX_OCCURRENCES) -> None:
        if max_occurrences < 1:
            raise InvalidParameterError(f"max_occurrences must be >= 1, got {max_occurrences}")
        self.min_ngram, self.max_ngram, self.max_occurrences = min_ngram, max_ngram, max_occurrences
        self.token_ids: list[int] = []
        self._tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extend(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            start = len(self.token_ids)  # the n-grams ending here are now followed by ``token``
            for n, table in self._tables.items():
                if start >= n:
                    starts = table.setdefault(tuple(self.token_ids[start - n : start]), [])
                    starts.append(start)
                    if len(starts) > self.max_occurrences:
                        del starts[0]
            self.token_ids.append(int(token))

    def match(self) -> tuple[int, int] | None:
        length = len(self.token_ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            starts = self._tables[n].get(tuple(self.token_ids[length - n :]))
            if starts:
                return n, starts[-1]
        return None

    def matches(self, max_matches: int) -> list[tuple[int, int]]:
        """:func:`find_ngram_matches` of the indexed context (same ``max_occurrences``)."""
        length = len(self.token_ids)
        found: list[tuple[int, int]] = []
        seen: set[int] = set()
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            for start in reversed(self._tables[n].get(tuple(self.token_ids[length - n :]), ())):
                if start not in seen:
                    seen.add(start)
                    found.append((n, start))
        return found[:max_matches]


class NgramProposer(Proposer):
    """Prompt-lookup drafter over the request's context (prompt + output so far).

    Args:
        min_ngram, max_ngram: suffix lengths tried, longest first; ``1 <= min_ngram <= max_ngram``.
        max_branches: matches a tree (:meth:`propose_tree`) copies from, >= 1.
    Raises:
        InvalidParameterError: on a bad n-gram range or branch count.
    """

    declaration = Declaration(
        "ngram",
        Kind.LOOKUP,
        summary="prompt lookup: what followed the context's tail earlier in it",
        auto=AutoRole.LOOKUP,
        priority=20,
    )

    @classmethod
    def build(cls, sources: DrafterSources) -> NgramProposer:
        """Prompt lookup with the options' n-gram range (every engine has one)."""
        return cls(sources.options.min_ngram, sources.options.max_ngram)

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, max_branches: int = MAX_OCCURRENCES) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidParameterError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_branches < 1:
            raise InvalidParameterError(f"max_branches must be >= 1, got {max_branches}")
        self.min_ngram, self.max_ngram, self.max_branches = min_ngram, max_ngram, max_branches
        self._index = NgramIndex(min_ngram, max_ngram, max(MAX_OCCURRENCES, max_branches))

    def new_sequence(self) -> NgramProposer:
        """The same lookup for another request (its own index)."""
        return NgramProposer(self.min_ngram, self.max_ngram, self.max_branches)

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        """The continuation of the longest recent match, or an empty draft when none has n >= min_ngram."""
        if num_speculative_tokens <= 0:
            return DraftOutput()
        index = self.index_for(request)
        match = index.match()
        if match is None:
            return DraftOutput()
        return DraftOutput(draft_token_ids=copy_continuation(index.token_ids, match[1], num_speculative_tokens))

    def propose_tree(self, request: DraftRequest, num_nodes: int) -> TokenTree:
        """A tree of at most ``num_nodes`` nodes from up to ``max_branches`` matches
        (:func:`ngram_tree`); only the root (the last context token) when nothing matches."""
        index = self.index_for(request)
        root = int(index.token_ids[-1])
        if num_nodes <= 0:
            return TokenTree((root,), (-1,))
        matches = index.matches(self.max_branches)
        return ngram_tree(
            root, [copy_continuation(index.token_ids, start, num_nodes) for _, start in matches], num_nodes
        )

    def observe(self, num_accepted_tokens: int) -> None:
        """Nothing to learn: accepted tokens arrive with the next request's context."""

    def index_for(self, request: DraftRequest) -> NgramIndex:
        """The index of ``request``'s context (prompt + output): extended by the new tokens, or
        started over when the context is not an extension of what it holds."""
        indexed = self._index.token_ids
        num_prompt = len(request.prompt_token_ids)
        is_extension = (
            len(indexed) >= num_prompt
            and indexed[:num_prompt] == list(request.prompt_token_ids)
            and indexed[num_prompt:] == list(request.output_token_ids[: len(indexed) - num_prompt])
            and len(indexed) <= num_prompt + len(request.output_token_ids)
        )
        if not is_extension:
            self._index = NgramIndex(self.min_ngram, self.max_ngram, self._index.max_occurrences)
            self._index.extend(request.prompt_token_ids)
        self._index.extend(request.output_token_ids[len(self._index.token_ids) - num_prompt :])
        return self._index


class NgramTreeProposer(Proposer):
    """The proposer protocol over :meth:`NgramProposer.propose_tree`: n-gram branches as one
    token tree (drafter name ``"ngram-tree"``). Shares the wrapped proposer's index.

    The tree is a deterministic function of the context, so every child is a one-hot candidate
    and :func:`verispec.algorithms.tree.tree_rejection_sample` keeps sampling exact.
    """

    declaration = Declaration(
        "ngram-tree", Kind.TREE, selectable=False, chain="ngram", wraps_chain=True, in_tree_method=True, priority=21
    )

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram

    def over(self, ngram: NgramProposer) -> NgramTreeProposer:
        """This tree over another chain drafter (another sequence's, sharing its index)."""
        return NgramTreeProposer(ngram)

    def new_sequence(self) -> NgramTreeProposer:
        """The same lookup for another request (its own index)."""
        return self.over(self.ngram.new_sequence())

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        """A tree of at most ``num_speculative_tokens`` nodes; empty when nothing matches."""
        return DraftOutput.of_tree(self.ngram.propose_tree(request, num_speculative_tokens))

    def observe(self, num_accepted_tokens: int) -> None:
        """Nothing to learn."""
