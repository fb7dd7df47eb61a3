"""Where a request meets the prefix cache: its longest cached prefix read into its sequence before
it prefills, and what its models computed kept when a prefill chunk lands and when it ends.

Owns the moments the engine calls, over a request's :class:`verispec.engine.prefix_state.PrefixState`:
:func:`read_prefix` (before a prefill chunk), :func:`keep_prompt` (after one; the lookup counted
once), :func:`keep_finished` / :func:`end_request` (the request ended: prompt and answer kept, so
the next turn of a conversation matches through the answer; :func:`keep_sequence`). The
store itself is :class:`verispec.engine.prefix_cache.PrefixCache`; knows nothing about passes.

Parts kept per block: the target's K and V entries; each draft model's (drafters whose
:meth:`~verispec.proposers.Proposer.kv_prefix` is not None, one part per set of drafters sharing
weights, named by the first); the target features an EAGLE head reads, where one is loaded (a
target prefix is read only with its features then, so the head sees every position).
"""

from __future__ import annotations

from collections.abc import Sequence

from verispec.engine.prefix_cache import FEATURES_PART, TARGET_PART, PrefixCache, block_hashes
from verispec.engine.prefix_state import FeatureLog, PrefixState
from verispec.engine.state import RequestState, Slot
from verispec.proposers.base import Proposer, common_prefix_length

KV_TOKEN_DIM = 3  # the token dimension of Runner.export_kv's [2, layers, kv_heads, tokens, head_dim]
FEATURE_TOKEN_DIM = 0  # features are [tokens, layers * hidden]


def new_prefix_state(cache: PrefixCache, state: RequestState) -> PrefixState:
    """The request's prefix state: its prompt's block names (hashed once)."""
    features = FeatureLog() if state.slot.feature_readers else None
    return PrefixState(block_hashes(state.prompt, cache.block_size), features=features)


def drafter_parts(slot: Slot) -> list[tuple[str, list[Proposer]]]:
    """The slot's drafters whose model cache the prefix cache keeps, grouped by shared weights:
    ``(part name, drafters)``, the part named ``draft:<first drafter's name>``."""
    groups: list[tuple[str, list[Proposer]]] = []
    seen: set[int] = set()
    for name, proposer in slot.proposers.items():
        prefix = proposer.kv_prefix()
        if prefix is None or id(proposer) in seen:
            continue
        seen.add(id(proposer))
        runner = prefix[0]
        for _, group in groups:
            other = group[0].kv_prefix()[0]
            if other is runner or other.shares_weights_with(runner):
                group.append(proposer)
                break
        else:
            groups.append((f"draft:{name}", [proposer]))
    return groups


def read_prefix(cache: PrefixCache, state: RequestState) -> None:
    """Before a prefill chunk: copy the longest cached prefix of the prompt that goes past what the
    target already holds into the target's cache (at least the prompt's last token is left to
    compute, for its logits), its features to the feature drafters, and each draft model's cached
    entries into its cache; ``state.num_prefilled`` moves past them. Exact: the entries copied are
    the entries the prefill would write (:mod:`verispec.engine.prefix_cache`)."""
    prefix, slot, size = state.prefix, state.slot, cache.block_size
    names = prefix.names[: (len(state.prompt) - 1) // size]
    parts = (TARGET_PART, FEATURES_PART) if prefix.features is not None else (TARGET_PART,)
    matched = cache.match(names, parts)
    first = state.num_prefilled // size
    if matched * size > state.num_prefilled:
        start = first * size
        slot.target.import_kv(cache.read(names[first:matched], TARGET_PART, KV_TOKEN_DIM), start)
        if prefix.features is not None:
            features = cache.read(names[first:matched], FEATURES_PART, FEATURE_TOKEN_DIM)
            for proposer in slot.feature_readers:
                proposer.observe_features(features, start)
            prefix.features.put(features, start)
        cache.hold(names[len(prefix.held) : matched])
        prefix.held = list(names[:matched])
        state.num_prefilled = matched * size
        prefix.num_cached_tokens = max(prefix.num_cached_tokens, matched * size)
    for part, drafters in drafter_parts(slot):
        _restore_drafters(cache, names, part, drafters, state.prompt)


def _restore_drafters(
    cache: PrefixCache, names: Sequence[bytes], part: str, drafters: list[Proposer], prompt: list[int]
) -> None:
    """Each drafter of a part whose cache holds less of ``prompt`` than the cache: the cached entries."""
    matched = cache.match(names, (part,)) * cache.block_size
    entries = None
    for proposer in drafters:
        _, token_ids = proposer.kv_prefix()
        if common_prefix_length(token_ids, prompt) >= matched:
            continue
        if entries is None:
            entries = cache.read(names[: matched // cache.block_size], part, KV_TOKEN_DIM)
        proposer.restore_kv_prefix(prompt[:matched], entries)


def keep_prompt(cache: PrefixCache, state: RequestState) -> None:
    """After a prefill chunk: keep the target's entries (and features) of the prompt's full blocks
    it now holds, so requests sharing the prompt's head read them while this one still runs; once
    the prompt is done, count the request's lookup (prompt tokens, tokens read) once."""
    size = state.slot.target.num_cached_tokens if not state.prefilling else state.num_prefilled
    _keep_target(cache, state, state.prefix.names[: min(size, len(state.prompt)) // cache.block_size])
    if not state.prefilling and not state.prefix.counted:
        state.prefix.counted = True
        cache.record_lookup(len(state.prompt), state.prefix.num_cached_tokens)


def keep_finished(cache: PrefixCache, states: Sequence[RequestState]) -> None:
    """:func:`keep_sequence` for each of ``states`` that finished (and reads the cache)."""
    for state in states:
        if state.finished and state.prefix is not None:
            keep_sequence(cache, state)


def end_request(cache: PrefixCache, state: RequestState, *, failed: bool = False) -> None:
    """A request left before it finished: keep what its caches hold (not after a failure, whose
    caches may be half written) and let go of its blocks."""
    if failed:
        release_prefix(cache, state)
    else:
        keep_sequence(cache, state)


def keep_sequence(cache: PrefixCache, state: RequestState) -> None:
    """The request ended (finished or cancelled): keep the full blocks its target and draft caches
    hold of the prompt and the answer (entries of the answer's tokens are what a prefill of them
    writes, so the next turn, prompt + answer + a new message, matches through the answer), then
    let go of the blocks it held."""
    prefix = state.prefix
    tokens = state.prompt + list(state.out.token_ids)
    held = state.num_prefilled if state.prefilling else min(state.slot.target.num_cached_tokens, len(tokens))
    names = block_hashes(tokens[:held], cache.block_size, known=prefix.names)
    _keep_target(cache, state, names)
    for part, drafters in drafter_parts(state.slot):
        prefixes = [p.kv_prefix() for p in drafters]  # the one holding the most of the sequence, measured once
        held, runner = max(((common_prefix_length(ids, tokens), r) for r, ids in prefixes), key=lambda x: x[0])
        num_blocks = min(held, runner.num_cached_tokens) // cache.block_size
        _keep(cache, names[:num_blocks], part, KV_TOKEN_DIM, lambda s, e, r=runner: r.export_kv(s, e))
    release_prefix(cache, state)


def release_prefix(cache: PrefixCache, state: RequestState) -> None:
    """Let go of the blocks the request held (it ended, or failed)."""
    cache.unhold(state.prefix.held)
    state.prefix.held = []


def _keep_target(cache: PrefixCache, state: RequestState, names: Sequence[bytes]) -> None:
    target = state.slot.target
    kept = _keep(cache, names, TARGET_PART, KV_TOKEN_DIM, target.export_kv)
    log = state.prefix.features
    if log is not None:
        _keep(cache, names[:kept], FEATURES_PART, FEATURE_TOKEN_DIM, log.rows)


def _keep(cache: PrefixCache, names: Sequence[bytes], part: str, dim: int, entries) -> int:
    """Insert ``part`` of the blocks of ``names`` not cached with it, their entries from
    ``entries(start, end)`` (None: not held); returns the blocks of ``names`` cached with it now."""
    missing = cache.missing(names, part)
    if missing:
        size = cache.block_size
        tensor = entries(missing.start * size, len(names) * size)
        if tensor is not None:
            cache.insert(names, missing.start, part, tensor, dim)
    return cache.match(names, (part,))
