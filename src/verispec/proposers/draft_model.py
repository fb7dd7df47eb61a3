"""Draft-model drafter: a smaller model of the same family proposes a chain autoregressively.

Owns the draft runner's KV cache: before each proposal it rolls the cache back to the longest
prefix it shares with the current context (so rejected draft tokens disappear and nothing is
recomputed) and feeds only what is new. Knows nothing about the target or verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.algorithms.draft import DraftOutput
from verispec.algorithms.sampling import ProcessedRows, process_logits
from verispec.algorithms.step import pick_token
from verispec.proposers.base import DraftCacheSequences, DrafterSources, DraftRequest
from verispec.proposers.declared import AutoRole, Declaration, Kind, Needs
from verispec.runners import ForwardCall, Runner, forward_batch

DRAFT_HINT = "load a draft model with --draft"


class DraftModelProposer(DraftCacheSequences):
    """Chain drafting with a draft model (Leviathan et al. 2023, §2.3; Chen et al. 2023, §2).

    Args:
        runner: the draft model's runner; this proposer owns its cache.
        context_window: prompt tokens the draft sees, the last ones; None: all
            (:class:`~verispec.proposers.DraftCacheSequences`).
    """

    declaration = Declaration(
        "draft",
        Kind.MODEL,
        Needs.DRAFT_MODEL,
        DRAFT_HINT,
        auto=AutoRole.BACKUP,
        priority=40,
        summary="a draft model's chain; --draft",
    )

    @classmethod
    def build(cls, sources: DrafterSources) -> DraftModelProposer | None:
        """The draft model's chain over ``draft_runner``, seeing the options' context window;
        None without a draft model."""
        if sources.draft_runner is None:
            return None
        return cls(sources.draft_runner, context_window=sources.options.draft_context_window)

    def __init__(self, runner: Runner, context_window: int | None = None) -> None:
        self.runner = runner
        self.context_window = context_window
        self.cached_token_ids: list[int] = []

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        return propose_batch([(self, request, num_speculative_tokens)])[0]

    @property
    def sizes_chain_by_confidence(self) -> bool:
        """True where the chain is :func:`propose_batch`'s (it asks ``request.continues``)."""
        return self.batches

    def observe(self, num_accepted_tokens: int) -> None:
        """Nothing to do: the next ``propose`` rolls the cache back to the shared prefix."""

    @property
    def batches(self) -> bool:
        """True unless a subclass drafts its own way (overrides :meth:`propose`)."""
        return type(self).propose is DraftModelProposer.propose

    @staticmethod
    def propose_batch(items: Sequence[tuple[DraftModelProposer, DraftRequest, int]]) -> list[DraftOutput]:
        """One draft pass per position for all ``items`` (:func:`propose_batch`)."""
        return propose_batch(items)


def propose_batch(items: Sequence[tuple[DraftModelProposer, DraftRequest, int]]) -> list[DraftOutput]:
    """Draft for several requests at once, each with its own proposer (its own draft sequence).

    Every draft position is one :func:`verispec.runners.forward_batch` over all requests still
    drafting (the first also feeds what each draft cache has not seen yet), so on a batch-capable
    draft runner k draft tokens for N requests cost k draft passes, not N k. Each request gets
    the tokens :meth:`DraftModelProposer.propose` alone would give it: its rows are processed
    with its own parameters and drawn with its own generator or coupling key, and the runner's rows do not
    depend on the batch (batch-invariant runners). ``items``: ``(proposer, request, k)``, the
    proposers distinct. Returns one :class:`DraftOutput` per item, in order (empty for k <= 0 or
    no room in the draft's context).
    """
    outputs = [DraftOutput() for _ in items]
    active = []  # [index, pending token ids, tokens left, draft tokens, draft rows, confidences]
    for index, (proposer, request, k) in enumerate(items):
        proposer.note_prompt(request)
        context = proposer.draft_context(request)
        num_tokens = min(k, proposer.runner.max_context_length - len(context))
        if num_tokens <= 0:
            continue
        keep = proposer.reusable_prefix(context)
        proposer.runner.truncate(keep)
        proposer.cached_token_ids = proposer.cached_token_ids[:keep]
        active.append([index, proposer.feed_long_context(context[keep:]), num_tokens, [], [], []])
    while active:
        logits = forward_batch([ForwardCall(items[a[0]][0].runner, a[1], num_logits=1) for a in active])
        still = []
        for entry, row in zip(active, logits):
            index, pending, left, draft_token_ids, draft_rows, confidences = entry
            proposer, request, _ = items[index]
            proposer.cached_token_ids.extend(pending)
            # The draft's row is processed like the target's would be at this point of the chain.
            rows = process_logits(
                row,
                request.params,
                request.prompt_token_ids,
                list(request.output_token_ids) + draft_token_ids,
                allowed=request.allowed_after(draft_token_ids, row.shape[-1]),
            )
            if rows.probs is None:
                token = int(rows.greedy_token_ids[0])
            else:
                # coupled: the draft's Gumbel-max with the target's noise at this position
                position = len(request.prompt_token_ids) + len(request.output_token_ids) + len(draft_token_ids)
                token = pick_token(rows, request.generator, position)
                draft_rows.append(rows.probs[0])
            draft_token_ids.append(token)
            if left > 1 and not _stops(request, row[0], rows, confidences):
                still.append([index, [token], left - 1, draft_token_ids, draft_rows, confidences])
            else:
                outputs[index] = DraftOutput(draft_token_ids, torch.stack(draft_rows) if draft_rows else None)
        active = still
    return outputs


def _stops(request: DraftRequest, logits: torch.Tensor, rows: ProcessedRows, confidences: list[float]) -> bool:
    """Whether the chain stops after the token just drafted: its top probability is under the
    request's ``draft_stop_threshold`` (later tokens would rarely be accepted), or the policy's
    ``continues`` rule, given the chain's probabilities so far (``confidences``, appended to
    here), says another token does not pay."""
    if request.draft_stop_threshold <= 0 and request.continues is None:
        return False
    confidence = top_probability(logits, rows)
    confidences.append(confidence)
    if confidence < request.draft_stop_threshold:
        return True
    return request.continues is not None and not request.continues(confidences)


def top_probability(logits: torch.Tensor, rows: ProcessedRows) -> float:
    """The draft's confidence in its last token: the top of its sampling distribution, or of
    ``softmax(logits)`` (``[vocab]``) for greedy requests (transformers' assistant confidence)."""
    probs = rows.probs[0] if rows.probs is not None else torch.softmax(logits.float(), dim=-1)
    return float(probs.max())
