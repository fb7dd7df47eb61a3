"""What a drafter hands the verifier: the draft tokens of one step, their probabilities, a tree.

The one type shared by the drafters (:mod:`verispec.proposers`), the verify step
(:mod:`verispec.algorithms.step`) and the constraints that cut a draft; it lives here, below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from verispec.algorithms.tree import TokenTree


@dataclass
class DraftOutput:
    """Tokens proposed for one verify step.

    Attributes:
        draft_token_ids: ``[num_draft_tokens]`` proposed continuation of the context.
        draft_probs: ``[num_draft_tokens, vocab]`` float32, the distribution each token was drawn
            from (after the same penalties/temperature/top-k/top-p as the target). None for
            greedy requests and for deterministic drafters (treated as one-hot).
        tree: set by tree drafters: the whole token tree (root = last context token);
            ``draft_token_ids`` then lists its nodes below the root, in tree order.
    """

    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Tensor | None = None
    tree: TokenTree | None = None

    def at_most(self, num_tokens: int) -> DraftOutput:
        """This draft cut to ``num_tokens`` tokens (and probability rows), should a drafter
        exceed what it was asked for; itself when it does not."""
        if len(self.draft_token_ids) <= num_tokens:
            return self
        probs = self.draft_probs[:num_tokens] if self.draft_probs is not None else None
        return DraftOutput(self.draft_token_ids[:num_tokens], probs)

    @classmethod
    def of_tree(cls, tree: TokenTree) -> DraftOutput:
        """A deterministic tree as a draft: its nodes below the root; empty for the root alone."""
        if tree.num_nodes == 1:
            return cls()
        return cls(draft_token_ids=list(tree.token_ids[1:]), tree=tree)
