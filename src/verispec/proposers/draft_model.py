"""Draft-model drafter: a smaller model of the same family proposes a chain autoregressively.

Owns the draft runner's KV cache: before each proposal it rolls the cache back to the longest
prefix it shares with the current context (so rejected draft tokens disappear and nothing is
recomputed) and feeds only what is new. Knows nothing about the target or verification.
"""

from __future__ import annotations

import copy

import torch

from verispec.proposers import DraftOutput, DraftRequest, common_prefix_length
from verispec.runners import Runner
from verispec.sampling import ProcessedRows, process_logits, sample_from


class DraftModelProposer:
    """Chain drafting with a draft model (Leviathan et al. 2023, §2.3; Chen et al. 2023, §2).

    Args:
        runner: the draft model's runner; this proposer owns its cache.
    """

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._cached_token_ids: list[int] = []

    @property
    def holds_sequences(self) -> bool:
        """The draft runner can give another sequence (:meth:`new_sequence`)."""
        return hasattr(self.runner, "new_sequence")

    def new_sequence(self) -> DraftModelProposer:
        """This drafter for another request: the same draft weights, its own empty cache."""
        clone = copy.copy(self)
        clone.runner = self.runner.new_sequence()
        clone._cached_token_ids = []
        return clone

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        if num_speculative_tokens <= 0:
            return DraftOutput()
        context = request.context
        room = self.runner.max_context_length - len(context)
        num_tokens = min(num_speculative_tokens, room)
        if num_tokens <= 0:
            return DraftOutput()
        # Keep the shared prefix, but always re-feed the last context token: its logits are needed.
        keep = min(common_prefix_length(self._cached_token_ids, context), len(context) - 1)
        self.runner.truncate(keep)
        self._cached_token_ids = self._cached_token_ids[:keep]
        pending = context[keep:]
        draft_token_ids: list[int] = []
        draft_rows = []
        for i in range(num_tokens):
            logits = self.runner.forward(pending, num_logits=1)
            self._cached_token_ids.extend(pending)
            # The draft's row is processed like the target's would be at this point of the chain.
            rows = process_logits(
                logits, request.params, request.prompt_token_ids, list(request.output_token_ids) + draft_token_ids
            )
            if rows.probs is None:
                token = int(rows.greedy_token_ids[0])
            else:
                token = sample_from(rows.probs[0], request.generator)
                draft_rows.append(rows.probs[0])
            draft_token_ids.append(token)
            pending = [token]
            if request.draft_stop_threshold > 0 and top_probability(logits[0], rows) < request.draft_stop_threshold:
                break  # the draft is unsure: later tokens would rarely be accepted
        draft_probs = torch.stack(draft_rows) if draft_rows else None
        return DraftOutput(draft_token_ids=draft_token_ids, draft_probs=draft_probs)

    def observe(self, num_accepted_tokens: int) -> None:
        """Nothing to do: the next ``propose`` rolls the cache back to the shared prefix."""


def top_probability(logits: torch.Tensor, rows: ProcessedRows) -> float:
    """The draft's confidence in its last token: the top of its sampling distribution, or of
    ``softmax(logits)`` (``[vocab]``) for greedy requests (transformers' assistant confidence)."""
    probs = rows.probs[0] if rows.probs is not None else torch.softmax(logits.float(), dim=-1)
    return float(probs.max())
