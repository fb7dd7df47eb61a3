"""EAGLE drafter: an EAGLE-3 head drafts a chain from the target's own features.

Owns the head's per-sequence state: the target features handed over after each target pass
(:meth:`~verispec.proposers.Proposer.observe_features`) that the head has not read yet, and
which rows of the head's KV cache are real (a committed token's feature) rather than a draft's.
Knows nothing about verification or the target beyond those features; the head's arithmetic
lives in :mod:`verispec.runners.eagle_head`.

Alignment (Li et al. 2025, "EAGLE-3", arXiv 2503.01840, §3; EAGLE, arXiv 2401.15077, §4): head
row ``p`` pairs the target's feature of token ``p`` with token ``p + 1`` and predicts token
``p + 2``. After a verify pass the target has the features of every kept token but the last
(the bonus or recovered token, not fed yet), so with a context of ``L`` tokens the rows up to
``L - 2`` are real; row ``L - 2`` drafts token ``L``, and each later draft row feeds the head's
own output in place of the feature it does not have.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from verispec.proposers.base import DraftRequest, Proposer, common_prefix_length
from verispec.proposers.draft_tree import grow_dynamic_tree
from verispec.runners.eagle_head import EagleHead
from verispec.spec.draft import DraftOutput
from verispec.spec.sampling import process_logits, sample_from
from verispec.spec.tree import TokenTree


class EagleProposer(Proposer):
    """Chain drafting with an EAGLE-3 head (Li et al. 2025, §3; chain as EAGLE-1, §4).

    Args:
        head: the head, holding this sequence's KV cache (:meth:`EagleHead.new_sequence` gives
            another sequence its own); it drafts from ``head.shape.feature_layers``.

    A draft's tokens are the head's rows mapped to target ids (``d2t``) and processed exactly as
    the target's rows are (penalties, bias, grammar masks, temperature, top-k/p): ``draft_probs``
    are over the full target vocabulary, zero outside the draft vocabulary, so modified rejection
    sampling keeps the target's distribution (Leviathan et al. 2023, §2.3). The output never
    depends on the head; only how many drafts are accepted does.
    """

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.feature_layers = tuple(head.shape.feature_layers)
        self._start = 0  # position of the head's first cache row
        self._row_token_ids: list[int] = []  # token p + 1 of each real row p = start, start + 1, ...
        self._pending = torch.zeros(0, head.fc.in_features)  # [rows, layers * hidden] features of positions start + len(rows) ...

    @property
    def _next_position(self) -> int:
        """The position of the first feature not yet handed over."""
        return self._start + len(self._row_token_ids) + self._pending.shape[0]

    def new_sequence(self) -> EagleProposer:
        """This drafter for another sequence: the head's weights shared, its own empty cache."""
        return EagleProposer(self.head.new_sequence())

    def release(self) -> None:
        """Back to a new sequence's state: the head's cache emptied (its storage freed), no rows,
        no pending features."""
        self.head.release()
        self._start, self._row_token_ids, self._pending = 0, [], self._pending.new_zeros(0, self._pending.shape[1])

    def observe_features(self, features: Tensor, position: int) -> None:
        """Keep the target's features of positions ``position ..`` (``[rows, layers * hidden]``).

        A position past the last read means features were never handed over (a drafter created
        mid-sequence), and one before the head's real rows means the target rolled back under
        them (a new request reusing a prefix): both restart the head at ``position``, which costs
        acceptance on the next few drafts, never correctness."""
        features = features.detach().to(self._pending.dtype)
        first_pending = self._start + len(self._row_token_ids)
        if first_pending <= position <= self._next_position:
            self._pending = torch.cat([self._pending[: position - first_pending], features])
        else:
            self._restart(position, features)

    def _restart(self, position: int, features: Tensor) -> None:
        self.head.truncate(0)
        self._start, self._row_token_ids, self._pending = position, [], features

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        """Up to ``num_speculative_tokens`` tokens continuing ``request.context``; empty when the
        target's features do not reach the context's second-to-last token."""
        context = request.context
        if not self._rows_match(context):
            self._restart(len(context), self._pending[:0])
            return DraftOutput()
        self.head.truncate(len(self._row_token_ids))  # the last round's draft rows go
        logits, hidden = self._catch_up(context)
        if logits is None:
            return DraftOutput()
        return self._draft(request, logits, hidden, num_speculative_tokens)

    def propose_tree(self, request: DraftRequest, num_nodes: int, *, branching: int = 2, max_depth: int = 6) -> TokenTree:
        """A dynamic tree of at most ``num_nodes`` drafted nodes below the root (the context's
        last token), grown by the head's confidence (EAGLE-2, Li et al. 2024, arXiv 2406.16858,
        §4; :func:`~verispec.proposers.draft_tree.grow_dynamic_tree`): one head pass per level,
        every frontier node a row fed its parent's output, attending to the real rows and to its
        own ancestors (a tree mask over the head's cache). The head's cache is back to its real
        rows afterwards. The root alone when the head cannot draft (see :meth:`propose`)."""
        context = request.context
        root = TokenTree((context[-1],), (-1,))
        if num_nodes <= 0:
            return root
        if not self._rows_match(context):
            self._restart(len(context), self._pending[:0])
            return root
        real = len(self._row_token_ids)
        self.head.truncate(real)
        logits, hidden = self._catch_up(context)
        if logits is None:
            return root
        real = self.head.num_cached_tokens
        first_position = len(context) - 1  # of a depth-1 node's row (row L - 2 is the last real one)
        outputs = {0: hidden}  # node -> the head's output row that scores its children ([1, hidden])

        def score_level(token_ids: list[int], parents: list[int], first_new: int) -> Tensor:
            tree = TokenTree(tuple(token_ids), tuple(parents))
            new = range(first_new, len(token_ids))
            mask = torch.zeros(len(new), real + len(token_ids) - 1, dtype=torch.bool)
            mask[:, :real] = True  # node n's row is cache row real + n - 1 (levels are fed in node order)
            for row, node in enumerate(new):
                mask[row, [real + a - 1 for a in tree.path_to(node)]] = True
            depths = tree.depths()
            level_logits, out = self.head(
                [token_ids[n] for n in new], hidden=torch.cat([outputs[parents[n]] for n in new]),
                positions=torch.tensor([first_position + depths[n] - 1 for n in new]), attention_mask=mask,
            )
            outputs.update({n: out[row : row + 1] for row, n in enumerate(new)})
            return torch.cat([self._target_row(row) for row in level_logits])

        tree = grow_dynamic_tree(request, self._target_row(logits[0]), num_nodes, branching, max_depth, score_level)
        self.head.truncate(real)
        return tree

    def _rows_match(self, context: Sequence[int]) -> bool:
        """The real rows were built from this context's tokens (else the context changed under them)."""
        rows = self._row_token_ids
        return common_prefix_length(rows, context[self._start + 1 : self._start + 1 + len(rows)]) == len(rows)

    def _catch_up(self, context: Sequence[int]) -> tuple[Tensor | None, Tensor | None]:
        """Feed the pending features whose next token is known; the last row's ``(logits [1,
        draft_vocab], hidden [1, hidden])`` when it is row ``len(context) - 2``, else ``(None, None)``."""
        first = self._start + len(self._row_token_ids)
        count = min(self._pending.shape[0], len(context) - 1 - first)
        if count <= 0 or first + count != len(context) - 1:
            return None, None
        token_ids = list(context[first + 1 : first + 1 + count])
        logits, hidden = self.head(token_ids, features=self._pending[:count], positions=torch.arange(first, first + count))
        self._row_token_ids.extend(token_ids)
        self._pending = self._pending[count:]
        return logits[-1:], hidden[-1:]

    def _draft(self, request: DraftRequest, logits: Tensor, hidden: Tensor, num_tokens: int) -> DraftOutput:
        """The chain: each step scores one row, picks a token as the target would, and feeds the
        row's own output back at the next position."""
        position = len(request.context) - 1  # of the first draft row (row L - 2 is the last real one)
        draft_token_ids: list[int] = []
        draft_rows: list[Tensor] = []
        for step in range(num_tokens):
            row = self._target_row(logits[0])
            rows = process_logits(
                row, request.params, request.prompt_token_ids, list(request.output_token_ids) + draft_token_ids,
                allowed=request.allowed_after(draft_token_ids, row.shape[-1]),
            )
            if not torch.isfinite(rows.logits).any():  # every allowed token is outside the draft vocabulary
                break
            if rows.probs is None:
                token = int(rows.greedy_token_ids[0])
                confidence = float(torch.softmax(rows.logits[0], dim=-1)[token]) if request.draft_stop_threshold else 1.0
            else:
                token = sample_from(rows.probs[0], request.generator)
                draft_rows.append(rows.probs[0])
                confidence = float(rows.probs[0].max())
            draft_token_ids.append(token)
            if step + 1 == num_tokens or confidence < request.draft_stop_threshold:
                break
            logits, hidden = self.head([token], hidden=hidden, positions=torch.tensor([position + step]))
        return DraftOutput(draft_token_ids, torch.stack(draft_rows) if draft_rows else None)

    def _target_row(self, draft_logits: Tensor) -> Tensor:
        """``[1, vocab]`` float32: the head's scores at their target ids, ``-inf`` elsewhere."""
        row = torch.full((1, self.head.shape.vocab_size), float("-inf"))
        row[0, self.head.d2t] = draft_logits.float()
        return row


class EagleTreeProposer(Proposer):
    """The proposer protocol over :meth:`EagleProposer.propose_tree` (drafter ``"eagle-tree"``,
    method ``eagle-tree``), for runners that verify token trees. Shares the wrapped drafter's
    head, cache and features (the engine feeds them to the chain drafter it wraps).

    Args:
        eagle: the chain drafter whose head drafts the trees.
        branching, max_depth: children expanded per frontier node, levels at most (>= 1 each).
    Raises:
        ValueError: ``branching`` or ``max_depth`` below 1.
    """

    def __init__(self, eagle: EagleProposer, *, branching: int = 2, max_depth: int = 6) -> None:
        if branching < 1 or max_depth < 1:
            raise ValueError("branching and max_depth must be >= 1")
        self.eagle, self.branching, self.max_depth = eagle, branching, max_depth

    def over(self, eagle: EagleProposer) -> EagleTreeProposer:
        """This tree's settings over another chain drafter (another sequence's)."""
        return EagleTreeProposer(eagle, branching=self.branching, max_depth=self.max_depth)

    def new_sequence(self) -> EagleTreeProposer:
        return self.over(self.eagle.new_sequence())

    def catch_up_rows(self, request: DraftRequest) -> int:
        return self.eagle.catch_up_rows(request)

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        return DraftOutput.of_tree(self.eagle.propose_tree(request, num_speculative_tokens, branching=self.branching,
                                                           max_depth=self.max_depth))

    def release(self) -> None:
        self.eagle.release()
