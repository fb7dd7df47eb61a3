"""One request's share of a target pass: its plan (a prefill chunk, a chain or a tree to
verify), the rows it puts in the pass, and what the pass's logits then commit to it.

The engine's loop (:mod:`verispec.engine.loop`) plans every request and runs one pass; then a
prefill chunk is committed by :func:`commit_prefill`, and a draft is verified (:func:`verify`:
a chain or a tree) and committed (:func:`commit`); :func:`finish` ends a request. Lossless by construction: what is
committed is what :mod:`verispec.algorithms.step` verified against the target's own rows.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from verispec.algorithms.control import CostModel
from verispec.algorithms.draft import DraftOutput
from verispec.algorithms.sampling import process_logits, token_logprobs
from verispec.algorithms.step import pick_token, verify_chain, verify_tree
from verispec.algorithms.tree import TreeVerifyResult, tree_attention_mask, tree_position_ids
from verispec.algorithms.verify import VerifyResult
from verispec.engine.constraints import cut_draft
from verispec.engine.policy import DraftStep, draft_batch
from verispec.engine.request import GenerationOutput, StreamChunk
from verispec.engine.state import RequestState
from verispec.metrics import RequestMetrics
from verispec.proposers.base import DraftRequest
from verispec.runners import ForwardCall

TARGET_SOURCE = "target"  # token_sources entry of a token the target chose (not a draft token)


@dataclass
class Plan:
    """What one request does in a pass: a prefill chunk (``request`` None), or a decode step whose
    draft (``step``, from the policy) the pass verifies as a chain or a tree."""

    state: RequestState
    call: ForwardCall | None
    cached: int = 0
    limit: int = 0
    step: DraftStep | None = None
    request: DraftRequest | None = None

    @property
    def prefill(self) -> bool:
        return self.request is None


def verify_call(plan: Plan) -> ForwardCall:
    """The target rows of a decode step: the pending token and the chain, or the tree."""
    target, tree = plan.state.slot.target, plan.step.draft.tree
    if tree is None:
        return ForwardCall(target, [plan.state.pending] + plan.step.draft.draft_token_ids)
    cached = plan.cached
    return ForwardCall(
        target, list(tree.token_ids), None, tree_position_ids(tree, cached), tree_attention_mask(tree, cached)
    )


def commit_prefill(plan: Plan, logits: torch.Tensor, cost_model: CostModel) -> StreamChunk | None:
    """Apply a prefill chunk's ``logits`` (``[rows of plan.call, vocab]`` float32): its prompt
    logprobs and, after the prompt's last chunk, the first output token. Returns the chunk
    committed, or None for a chunk that is not the prompt's last."""
    state = plan.state
    out, params = state.out, state.params
    first = state.num_prefilled
    state.num_prefilled += len(plan.call.token_ids)
    share_features(state, slice(None), first)
    if params.prompt_logprobs is not None:  # row j scores prompt token first + j + 1
        for j, position in enumerate(range(first + 1, min(state.num_prefilled + 1, len(state.prompt)))):
            state.prompt_logprobs.append(token_logprobs(logits[j], state.prompt[position], params.prompt_logprobs))
    if state.num_prefilled < len(state.prompt):
        return None
    rows = process_logits(logits[-1:], params, state.prompt, [], allowed=state.constraints.masks(0))
    state.pending = pick_token(rows, state.generator, len(state.prompt))  # the first output position
    out.append(state.pending)
    state.record_logprobs(rows.logits, [state.pending])
    state.constraints.commit(out.token_ids)
    state.times.first_token = time.perf_counter()
    state.sources = [TARGET_SOURCE] * len(out.token_ids)
    if out.finished:
        return finish(state, cost_model, list(out.token_ids))
    prompt_logprobs = list(state.prompt_logprobs) if params.prompt_logprobs is not None else None
    return StreamChunk(
        out.take_delta(),
        list(out.token_ids),
        logprobs=state.chunk_logprobs(out.token_ids),
        prompt_logprobs=prompt_logprobs,
    )


@dataclass
class Verified:
    """What a verify pass decided for one request: ``result`` (``num_accepted_tokens``,
    ``token_ids``: the accepted tokens and the bonus or recovered one), the processed target
    ``rows`` their logprobs come from (``scoring_rows`` of them), and for a tree the accepted
    path's node indices (``accepted_nodes``, None for a chain)."""

    result: VerifyResult | TreeVerifyResult
    rows: torch.Tensor
    scoring_rows: list[int]
    accepted_nodes: list[int] | None = None

    @property
    def num_accepted_tokens(self) -> int:
        return self.result.num_accepted_tokens


def verify(plan: Plan, logits: torch.Tensor) -> Verified:
    """Verify the plan's draft against ``logits`` (``[rows of plan.call, vocab]`` float32) and keep
    only the accepted rows in the target's KV cache (and the feature drafters' view of them)."""
    if plan.step.draft.tree is None:
        return _verify_chain(plan, logits)
    return _verify_tree(plan, logits)


def _verify_chain(plan: Plan, logits: torch.Tensor) -> Verified:
    """A chain (:func:`verispec.algorithms.step.verify_chain`): the cache rolls back to the
    pending token and the accepted ones."""
    state, draft = plan.state, plan.step.draft
    allowed = state.constraints.masks(len(state.out.token_ids), draft.draft_token_ids)
    result, rows = verify_chain(
        logits, draft, state.params, state.prompt, state.out.token_ids, state.generator, allowed
    )
    state.slot.target.truncate(plan.cached + 1 + result.num_accepted_tokens)
    share_features(state, slice(0, 1 + result.num_accepted_tokens), plan.cached)
    return Verified(result, rows, list(range(len(result.token_ids))))


def _verify_tree(plan: Plan, logits: torch.Tensor) -> Verified:
    """A token tree (:func:`verispec.algorithms.step.verify_tree`): the cache keeps the accepted
    path's rows."""
    state, tree = plan.state, plan.step.draft.tree
    constraints = state.constraints
    paths = [[tree.token_ids[j] for j in tree.path_to(i)] for i in range(tree.num_nodes)] if constraints.active else []
    allowed = constraints.path_masks(len(state.out.token_ids), paths)
    result, rows = verify_tree(tree, logits, state.params, state.prompt, state.out.token_ids, state.generator, allowed)
    path = [0, *result.accepted_nodes]
    state.slot.target.keep_tree_path(plan.cached, path)  # the accepted path's KV
    share_features(state, path, plan.cached)
    return Verified(result, rows, list(path), list(result.accepted_nodes))


def commit(plan: Plan, verified: Verified, cost_model: CostModel) -> StreamChunk:
    """Commit a verified step to the request's output: the accepted tokens and the bonus or
    recovered token, up to a stop; their sources, statistics and logprobs. Returns the chunk
    committed (the request's last carries its output)."""
    state, step = plan.state, plan.step
    out, result = state.out, verified.result
    num_before = len(out.token_ids)
    for i, token_id in enumerate(result.token_ids):
        finished = out.append(token_id)
        if len(out.token_ids) > len(state.sources):
            state.sources.append(step.drafter if i < result.num_accepted_tokens else TARGET_SOURCE)
        if finished:
            break
    committed = out.token_ids[num_before:]
    # accepted tokens are tokens of the completion (SpecDecodeStats): an accepted end-of-sequence
    # token, or one past a stop string or max_tokens, is not one
    num_accepted = min(result.num_accepted_tokens, len(committed))
    state.stats.record(len(step.draft.draft_token_ids), num_accepted, num_before, step.drafter)
    state.record_logprobs(verified.rows, committed, verified.scoring_rows)
    state.constraints.commit(committed)
    state.pending = result.token_ids[-1]
    if out.finished:
        return finish(state, cost_model, committed)
    return StreamChunk(out.take_delta(), committed, logprobs=state.chunk_logprobs(committed))


def finish(state: RequestState, cost_model: CostModel, committed: list[int]) -> StreamChunk:
    """End the request: its finish reason, metrics and output; what it teaches the cost model
    and the drafters that learn across requests (unless it is not a user's request)."""
    out = state.out
    if not out.finished:
        out.finish("length")
    state.times.end = time.perf_counter()
    if state.learn:  # what a draft's catch-up is amortised over (not warm-ups' lengths)
        cost_model.record_output_length(len(out.token_ids))
        state.policy.finish(len(out.token_ids))
    # drafters that learn across requests (suffix), each once even if loaded under two names
    for proposer in {id(p): p for p in state.slot.proposers.values()}.values() if state.learn else ():
        proposer.end_request(state.prompt, out.token_ids)
    metrics = RequestMetrics.from_times(
        state.times, len(state.prompt), len(out.token_ids), state.stats, state.num_cached_prompt_tokens
    )
    state.output = GenerationOutput(
        list(out.token_ids),
        out.text,
        out.finish_reason or "length",
        metrics,
        state.sources,
        list(state.logprobs) if state.params.logprobs is not None else None,
        list(state.prompt_logprobs) if state.params.prompt_logprobs is not None else None,
    )
    return StreamChunk(out.take_delta(), committed, state.output, state.chunk_logprobs(committed))


def share_features(state: RequestState, rows: slice | list[int], position: int) -> None:
    """Hand the drafters that read the target's features (:attr:`Slot.feature_readers`) the rows
    of the last pass whose tokens the target keeps (``rows`` of its ``last_features``), at
    positions ``position ..``."""
    if not state.slot.feature_readers:
        return
    features = state.slot.target.last_features[rows]
    for proposer in state.slot.feature_readers:
        proposer.observe_features(features, position)
    if state.prefix is not None and state.prefix.features is not None:  # the prefix cache keeps them
        state.prefix.features.put(features, position)


GRAMMAR_DRAFTER = "grammar"  # the source of a draft the request's grammar forced (stats, sources)
MIN_FORCED_TOKENS = 2  # a grammar forcing one token: the drafter's own draft holds it (masked alike) and more


def forced_draft(plan: Plan) -> DraftStep | None:
    """A draft the request's grammar forces (:meth:`TokenConstraints.forced_tokens`): at least
    :data:`MIN_FORCED_TOKENS` tokens, none but what fits; None otherwise (the policy drafts). It
    costs no draft pass; its drafter is :data:`GRAMMAR_DRAFTER`, deterministic (one-hot ``q``)."""
    if plan.state.spec.method == "none" or plan.limit < MIN_FORCED_TOKENS:
        return None
    forced = plan.state.constraints.forced_tokens(plan.limit)
    if len(forced) < MIN_FORCED_TOKENS:
        return None
    return DraftStep(GRAMMAR_DRAFTER, len(forced), DraftOutput(forced))


def draft_plans(plans: list[Plan], batch_size: int) -> None:
    """Each decoding plan's draft and the rows that verify it: the tokens its grammar forces
    (:func:`forced_draft`, free), else its policy's (:func:`verispec.engine.policy.draft_batch`,
    the draft models' chains of every request at once); ``batch_size``: requests decoding."""
    forced = [forced_draft(plan) for plan in plans]
    asks = [(plan.state.policy, plan.request, plan.limit) for plan, step in zip(plans, forced) if step is None]
    drafted = iter(draft_batch(asks, batch_size))
    for plan, step in zip(plans, forced):
        take_draft(plan, step if step is not None else next(drafted))


def take_draft(plan: Plan, step: DraftStep) -> None:
    """The plan's draft, timed, cut where the request's constraints refuse a token
    (:func:`verispec.engine.constraints.cut_draft`), and the target rows that verify it."""
    state = plan.state
    state.times.draft_s += step.draft_s
    if state.constraints.active:
        draft = cut_draft(state.constraints, len(state.out.token_ids), step.draft, state.params.is_greedy)
        step = step if draft is step.draft else dataclasses.replace(step, draft=draft)
    plan.step = step
    plan.call = verify_call(plan)


def report(plan: Plan, verified: Verified, pass_s: float, base_rows: int) -> None:
    """Tell the request's policy how its step went (:meth:`DraftPolicy.observe`), and the
    request's statistics what the controller predicted and got."""
    state, step = plan.state, plan.step
    realised = state.policy.observe(
        step, verified.num_accepted_tokens, pass_s, verified.accepted_nodes, base_rows=base_rows
    )
    if state.policy.active and plan.limit > 0:  # a step with no room to draft says nothing about control
        state.stats.record_control(step.chosen_k, step.predicted, realised)
