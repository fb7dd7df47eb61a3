"""Suffix drafting (SuffixDecoding): continuations of the context's tail found in earlier requests
and in the request itself, scored by how often each continuation followed.

Owns the global :class:`SuffixCache` (token sequences of finished requests, indexed by their
n-grams, bounded in tokens with the oldest requests evicted, shared by all requests of an engine
under a lock) and the per-request :class:`SuffixProposer` (the cache plus the request's own
prompt and output, as n-gram lookup has). A proposal takes the longest n-gram of the context's
tail found anywhere, gathers what followed each occurrence, and returns the most frequent
continuation (a chain) or the frequency-scored tree of them (SuffixDecoding, Oliaro et al.
2025, §3: the speculation tree of the matched suffix, nodes scored by empirical continuation
frequency, its size following the match length). Each proposal also says how sure it is:
:func:`node_confidences`, the estimated probability that verification accepts each node, from the
continuations' frequencies (the paper's D(N)) blended with the drafter's realised acceptance, so
the ``cost`` schedules can size a draft from the match it comes from
(:func:`verispec.algorithms.schedules.confident_length`). Drafts are deterministic (no probabilities):
verification's one-hot path keeps them lossless. Knows nothing about models or verification.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence

from verispec.algorithms.draft import DraftOutput
from verispec.algorithms.tree import TokenTree
from verispec.errors import InvalidParameterError
from verispec.proposers.base import DrafterSources, DraftRequest, Proposer
from verispec.proposers.datastore import Datastore
from verispec.proposers.declared import AutoRole, Declaration, Kind
from verispec.proposers.ngram import NgramIndex, NgramProposer, copy_continuation, ngram_tree
from verispec.proposers.suffix_file import read_sequences, write_sequences

DEFAULT_MAX_TOKENS = 65_536  # tokens of past requests kept (the index costs up to ~2-3 KB a token)
PRIOR_OCCURRENCES = 1.0  # weight of the realised acceptance in node_confidences, in occurrences


class SuffixCache:
    """Token sequences of finished requests and an index of their n-grams.

    For n in ``[min_ngram, max_ngram]`` a dict maps an n-gram to the ``max_occurrences`` most
    recent places it occurred, as ``(sequence id, start of what followed)``. Sequences are kept
    while their total stays within ``max_tokens``; the oldest are evicted first, their entries
    removed with them (in time proportional to their length: no global rebuild, no pause).
    Every method takes the cache's lock, so concurrent requests (or threads) may share one cache.

    Raises:
        InvalidParameterError: a bad n-gram range, occurrence count or token budget.
    """

    def __init__(
        self, max_tokens: int = DEFAULT_MAX_TOKENS, min_ngram: int = 2, max_ngram: int = 8, max_occurrences: int = 8
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidParameterError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_occurrences < 1 or max_tokens < 1:
            raise InvalidParameterError("max_occurrences and max_tokens must be >= 1")
        self.max_tokens, self.min_ngram, self.max_ngram, self.max_occurrences = (
            max_tokens,
            min_ngram,
            max_ngram,
            max_occurrences,
        )
        self._lock = threading.Lock()
        self._sequences: deque[tuple[int, list[int]]] = deque()  # (id, tokens), oldest first
        self._next_id = 0
        self._num_tokens = 0
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._by_id: dict[int, list[int]] = {}
        self._num_changes = 0

    @property
    def num_tokens(self) -> int:
        """Tokens held (all kept sequences)."""
        return self._num_tokens

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def num_changes(self) -> int:
        """Sequences added so far (kept or evicted since): a snapshot is stale when this moved."""
        return self._num_changes

    @property
    def index_size(self) -> int:
        """Index entries (occurrences)."""
        return sum(len(v) for v in self._index.values())

    def add(self, token_ids: Sequence[int]) -> None:
        """Keep ``token_ids`` (a finished request's output, or prompt + output) for later lookups;
        a sequence longer than ``max_tokens`` keeps its last ``max_tokens`` tokens."""
        tokens = [int(t) for t in token_ids][-self.max_tokens :]
        if len(tokens) <= self.min_ngram:
            return
        with self._lock:
            sequence_id = self._next_id
            self._next_id += 1
            self._num_changes += 1
            self._sequences.append((sequence_id, tokens))
            self._by_id[sequence_id] = tokens
            self._num_tokens += len(tokens)
            self._index_sequence(sequence_id, tokens)
            while self._num_tokens > self.max_tokens:
                old_id, old = self._sequences.popleft()
                del self._by_id[old_id]
                self._num_tokens -= len(old)
                self._unindex_sequence(old_id, old)

    def continuations(self, context: Sequence[int], length: int) -> tuple[int, list[list[int]]]:
        """``(n, continuations)``: the longest n-gram of ``context``'s tail (n in the range) that
        occurred in a kept sequence, and up to ``length`` tokens that followed each of its
        occurrences, most recent first; ``(0, [])`` when none occurred."""
        with self._lock:
            for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
                places = self._index.get(tuple(int(t) for t in context[len(context) - n :]))
                if not places:
                    continue
                found = []
                for sequence_id, start in reversed(places):
                    tokens = self._by_id.get(sequence_id)
                    if tokens is not None and start < len(tokens):
                        found.append(tokens[start : start + length])
                if found:
                    return n, found
        return 0, []

    def sequences(self) -> list[list[int]]:
        """The kept sequences, oldest first (to persist the cache)."""
        return self.snapshot()[1]

    def snapshot(self) -> tuple[int, list[list[int]]]:
        """``(num_changes, sequences)`` read together under the lock: a copy to write while
        requests go on (microseconds a thousand tokens; the lock is not held while writing)."""
        with self._lock:
            return self._num_changes, [list(tokens) for _, tokens in self._sequences]

    def save(self, path) -> None:
        """Write the kept sequences to ``path`` atomically, with a checksum
        (:func:`verispec.proposers.suffix_file.write_sequences`). Raises OSError (``path`` is
        then as it was)."""
        write_sequences(path, self.sequences())

    def load(self, path) -> int:
        """Add the sequences saved in ``path`` (:meth:`save`), oldest first; returns how many.

        Raises:
            InvalidParameterError: the file is missing or not a suffix cache.
            CacheFileError: a suffix cache that is truncated or corrupt (nothing of it is added).
        """
        sequences = read_sequences(path)
        for tokens in sequences:
            self.add(tokens)
        return len(sequences)

    def _index_sequence(self, sequence_id: int, tokens: list[int]) -> None:
        for start in range(1, len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, start) + 1):
                places = self._index.setdefault(tuple(tokens[start - n : start]), [])
                places.append((sequence_id, start))
                if len(places) > self.max_occurrences:
                    del places[0]

    def _unindex_sequence(self, sequence_id: int, tokens: list[int]) -> None:
        """Drop an evicted sequence's entries (and keys left empty): O(its length), no pause."""
        for start in range(1, len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, start) + 1):
                key = tuple(tokens[start - n : start])
                places = self._index.get(key)
                if places is None:
                    continue
                places[:] = [place for place in places if place[0] != sequence_id]
                if not places:
                    del self._index[key]


class SuffixProposer(Proposer):
    """Suffix drafting for one request over a shared :class:`SuffixCache`.

    Each proposal looks up the context's tail in the request's own prompt and output (as
    :class:`~verispec.proposers.ngram.NgramProposer` indexes it) and in the cache; the longer match wins (the
    request's own on a tie), and every occurrence with that match length votes for its
    continuation. The draft budget follows the match length: at most ``ceil(spec_factor * n)``
    tokens for an n-token match (SuffixDecoding's ``max_spec_factor``).

    Args:
        cache: the engine's shared cache (finished requests are added by :meth:`end_request`).
        min_ngram, max_ngram: tail lengths tried, longest first.
        spec_factor: draft tokens per matched token.
        add_prompts: also keep each finished request's prompt in the cache (the output always).
        datastore: a static corpus (:class:`verispec.proposers.datastore.Datastore`) looked up
            too; the request's own context, then the cache, win a tie with it.
    """

    declaration = Declaration(
        "suffix",
        Kind.LOOKUP,
        summary="continuations seen in earlier requests and this one",
        scores_own_drafts=True,
        auto=AutoRole.LOOKUP,
        priority=10,
    )

    @classmethod
    def build(cls, sources: DrafterSources) -> SuffixProposer:
        """Suffix lookup over the pipeline's cache of past requests and the options' datastore (every
        engine has one). Raises VerispecError for a missing or damaged datastore."""
        datastore = None if sources.options.datastore is None else Datastore(sources.options.datastore)
        return cls(sources.suffix_cache, datastore=datastore)

    def __init__(
        self,
        cache: SuffixCache | None = None,
        min_ngram: int = 2,
        max_ngram: int = 8,
        spec_factor: float = 2.0,
        add_prompts: bool = False,
        datastore=None,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidParameterError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if spec_factor <= 0:
            raise InvalidParameterError(f"spec_factor must be > 0, got {spec_factor}")
        self.cache = cache if cache is not None else SuffixCache(min_ngram=min_ngram, max_ngram=max_ngram)
        self.min_ngram, self.max_ngram, self.spec_factor, self.add_prompts = (
            min_ngram,
            max_ngram,
            spec_factor,
            add_prompts,
        )
        self.datastore = datastore
        self._local = NgramProposer(min_ngram, max_ngram, max_branches=8)  # the request's own context

    def new_sequence(self) -> SuffixProposer:
        """The same drafter for another request: the same shared cache, its own context index."""
        return SuffixProposer(
            self.cache, self.min_ngram, self.max_ngram, self.spec_factor, self.add_prompts, self.datastore
        )

    def with_empty_cache(self) -> SuffixProposer:
        """The same drafter (settings, datastore) over a new, empty cache of the same settings."""
        old = self.cache
        cache = SuffixCache(old.max_tokens, old.min_ngram, old.max_ngram, old.max_occurrences)
        return SuffixProposer(cache, self.min_ngram, self.max_ngram, self.spec_factor, self.add_prompts, self.datastore)

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        """The most frequent continuation (a chain) of at most ``num_speculative_tokens``."""
        if not request.prompt_token_ids and not request.output_token_ids:
            return DraftOutput()
        tree = self.propose_tree(request, num_speculative_tokens, chain=True)
        return DraftOutput(draft_token_ids=list(tree.token_ids[1:]))

    def propose_tree(self, request: DraftRequest, num_nodes: int, chain: bool = False) -> TokenTree:
        """The frequency-scored tree of the continuations (at most ``num_nodes`` nodes below the
        root, the last context token); with ``chain``, its most frequent path only."""
        return self._scored_tree(request, num_nodes, chain)[0]

    def draft_confidences(
        self, request: DraftRequest, num_tokens: int, prior: float, chain: bool = True
    ) -> list[float]:
        """``[num_draft_tokens]`` :func:`node_confidences` of the proposal of ``num_tokens`` (the
        chain :meth:`propose` returns; with ``chain`` False, :meth:`propose_tree`'s nodes);
        ``prior``: the drafter's realised per-token acceptance rate in [0, 1]."""
        if not request.prompt_token_ids and not request.output_token_ids:
            return []
        tree, continuations = self._scored_tree(request, num_tokens, chain)
        return node_confidences(tree, continuations, prior)

    def _scored_tree(self, request: DraftRequest, num_nodes: int, chain: bool) -> tuple[TokenTree, list[list[int]]]:
        index = self._local.index_for(request)
        context = index.token_ids
        root = int(context[-1])
        n, continuations = self._continuations(index, num_nodes)
        budget = min(num_nodes, math.ceil(self.spec_factor * n)) if n else 0
        if budget <= 0 or not continuations:
            return TokenTree((root,), (-1,)), []
        if chain:
            return _chain_tree(root, most_frequent_path(continuations, budget)), continuations
        return ngram_tree(root, continuations, budget, branch_decay=1.0, depth_decay=1.0), continuations

    def observe(self, num_accepted_tokens: int) -> None:
        """Nothing to learn within a request: finished requests reach the cache through :meth:`end_request`."""

    def end_request(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Keep the finished request for later requests (its output; its prompt too with ``add_prompts``)."""
        self.cache.add((list(prompt_token_ids) if self.add_prompts else []) + list(output_token_ids))

    def _continuations(self, index: NgramIndex, length: int) -> tuple[int, list[list[int]]]:
        context = index.token_ids
        local = index.matches(8)
        local_n = local[0][0] if local else 0
        global_n, found = self.cache.continuations(context, length)
        if local_n >= global_n and local_n:
            best = local_n, [copy_continuation(context, start, length) for n, start in local if n == local_n]
        else:
            best = global_n, found
        if self.datastore is not None:
            corpus_n, corpus = self.datastore.continuations(context, length, self.min_ngram, self.max_ngram)
            if corpus_n > best[0]:
                return corpus_n, corpus
        return best


class SuffixTreeProposer(Proposer):
    """The proposer protocol over :meth:`SuffixProposer.propose_tree` (drafter ``"suffix-tree"``),
    for runners that verify token trees. Shares the wrapped proposer's index and cache."""

    declaration = Declaration(
        "suffix-tree",
        Kind.TREE,
        selectable=False,
        chain="suffix",
        wraps_chain=True,
        scores_own_drafts=True,
        for_chain_method=True,
        priority=11,
    )

    def __init__(self, suffix: SuffixProposer) -> None:
        self.suffix = suffix

    def over(self, suffix: SuffixProposer) -> SuffixTreeProposer:
        """This tree over another chain drafter (another sequence's, sharing its index)."""
        return SuffixTreeProposer(suffix)

    def new_sequence(self) -> SuffixTreeProposer:
        return self.over(self.suffix.new_sequence())

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        if not request.prompt_token_ids and not request.output_token_ids:
            return DraftOutput()
        return DraftOutput.of_tree(self.suffix.propose_tree(request, num_speculative_tokens))

    def observe(self, num_accepted_tokens: int) -> None:
        """Nothing to learn within a request."""

    def draft_confidences(self, request: DraftRequest, num_tokens: int, prior: float) -> list[float]:
        """:meth:`SuffixProposer.draft_confidences` of the tree this drafter proposes."""
        return self.suffix.draft_confidences(request, num_tokens, prior, chain=False)


def node_confidences(
    tree: TokenTree, continuations: Sequence[Sequence[int]], prior: float, prior_weight: float = PRIOR_OCCURRENCES
) -> list[float]:
    """``[num_nodes - 1]`` estimated probability that verification accepts each node below the
    root of ``tree`` (and so its whole path), from the ``continuations`` the tree was built from.

    SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975, §3, speculation tree expansion and
    scoring) scores a node by ``D(N) = D(parent) * C(N) / C(parent)``, ``C`` the continuations
    through a node: the empirical probability of its path. Here each factor is a Beta-binomial
    mean that also weighs the drafter's realised per-token acceptance ``prior`` (in [0, 1]) as
    ``prior_weight`` occurrences: ``(C(N) - 1 + w prior) / (C(parent, going on) - 1 + w)``. The
    one occurrence every match has is what ``prior`` was measured on, so a node seen once is
    priced at ``prior`` (as the schedule prices every draft), each further agreeing occurrence
    raises it towards 1, and a continuation that disagrees lowers it.
    """
    through: dict[tuple[int, ...], int] = {}  # path -> continuations through it
    going_on: dict[tuple[int, ...], int] = {}  # path -> continuations through it with a next token
    for tokens in continuations:
        for depth in range(1, len(tokens) + 1):
            key = tuple(int(t) for t in tokens[:depth])
            through[key] = through.get(key, 0) + 1
            going_on[key[:-1]] = going_on.get(key[:-1], 0) + 1
    paths: list[tuple[int, ...]] = [()]
    out: list[float] = []
    for node in range(1, len(tree.token_ids)):
        parent = tree.parents[node]
        path = paths[parent] + (int(tree.token_ids[node]),)
        paths.append(path)
        agree, alive = through.get(path, 0), going_on.get(paths[parent], 0)
        factor = (agree - 1 + prior_weight * prior) / (alive - 1 + prior_weight) if agree else 0.0
        out.append((out[parent - 1] if parent else 1.0) * factor)
    return out


def most_frequent_path(continuations: Sequence[Sequence[int]], length: int) -> list[int]:
    """The path of at most ``length`` tokens that, token by token, the most continuations share:
    at each step the most frequent next token among the continuations still on the path (ties:
    the one seen first, i.e. the most recent occurrence)."""
    path: list[int] = []
    alive = [list(c) for c in continuations]
    while len(path) < length:
        counts: dict[int, int] = {}
        for tokens in alive:
            if len(tokens) > len(path):
                counts[tokens[len(path)]] = counts.get(tokens[len(path)], 0) + 1
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)  # dicts keep insertion order: first seen wins ties
        path.append(best)
        alive = [tokens for tokens in alive if len(tokens) >= len(path) and tokens[len(path) - 1] == best]
    return path


def _chain_tree(root: int, path: list[int]) -> TokenTree:
    return TokenTree(tuple([root] + path), tuple(range(-1, len(path))))
