"""EAGLE drafter: an EAGLE-3 head drafts a chain (several requests' chains in shared head passes)
or an EAGLE-2 dynamic tree (``eagle-tree``) from the target's own features.

Owns the head's per-sequence state: the target features handed over after each target pass
(:meth:`~verispec.proposers.Proposer.observe_features`) that the head has not read yet, and
which rows of the head's KV cache are real (a committed token's feature) rather than a draft's.
Knows nothing about verification or the target beyond those features; the head's arithmetic
lives in :mod:`verispec.runners.eagle.head`.

Alignment (Li et al. 2025, "EAGLE-3", arXiv 2503.01840, §3; EAGLE, arXiv 2401.15077, §4): head
row ``p`` pairs the target's feature of token ``p`` with token ``p + 1`` and predicts token
``p + 2``. After a verify pass the target has the features of every kept token but the last
(the bonus or recovered token, not fed yet), so with a context of ``L`` tokens the rows up to
``L - 2`` are real; row ``L - 2`` drafts token ``L``, and each later draft row feeds the head's
own output in place of the feature it does not have.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from verispec.algorithms.draft import DraftOutput
from verispec.algorithms.sampling import process_logits
from verispec.algorithms.step import pick_token
from verispec.algorithms.tree import TokenTree
from verispec.errors import InvalidParameterError
from verispec.proposers.base import DrafterSources, DraftRequest, Proposer, common_prefix_length
from verispec.proposers.declared import AutoRole, Declaration, Kind, Needs
from verispec.proposers.draft_tree import dynamic_tree_levels
from verispec.runners.eagle.head import EagleHead
from verispec.runners.eagle.passes import HeadCall, forward_heads

HEAD_QUANTIZATIONS = ("auto", "none", "q8_0", "iq4_nl")  # of an EAGLE head's linear layers (runners/eagle/blocks.py)
AUTO_HEAD_QUANTIZATION = "q8_0"  # "auto" over the gguf runner (measured: see DrafterOptions.head_quantization)
HEAD_HINT = "load a head with --eagle-head (a file verispec train-head writes, or a published EAGLE-3 folder)"

TREE_BRANCHING = 2  # eagle-tree: children expanded per frontier node (EAGLE-2's top-k) ...
TREE_MAX_DEPTH = 6  # ... over this many levels at most


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

    declaration = Declaration(
        "eagle",
        Kind.HEAD,
        Needs.HEAD,
        HEAD_HINT,
        auto=AutoRole.BACKUP,
        priority=30,
        summary="an EAGLE-3 head over the target's features, a chain; --eagle-head",
    )

    @classmethod
    def build(cls, sources: DrafterSources) -> EagleProposer | None:
        """The head of ``options.eagle_head`` over the target runner's embedding and features,
        its linear layers quantized as ``options.head_quantization`` says; None without a head.

        Raises:
            InvalidParameterError: a head for another target, or a runner without features to hand it.
            ModelNotFoundError, ModelIntegrityError: no head file, or a damaged one.
        """
        options, target_runner = sources.options, sources.target_runner
        if options.eagle_head is None:
            return None
        if target_runner is None or not target_runner.supports_features:
            kind = type(target_runner).__name__ if target_runner is not None else "no runner"
            raise InvalidParameterError(
                f"--eagle-head needs a runner that hands out the target's features (gguf, int8, torch), not {kind}"
            )
        head = EagleHead.load(options.eagle_head, target_runner)
        quantization = head_quantization_for(options.head_quantization, target_runner)
        if quantization != "none":
            from verispec.runners.eagle.blocks import quantize_head_

            quantize_head_(head, quantization)
        return cls(head)

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.feature_layers = tuple(head.shape.feature_layers)
        self._start = 0  # position of the head's first cache row
        self._row_token_ids: list[int] = []  # token p + 1 of each real row p = start, start + 1, ...
        self._pending = torch.zeros(
            0, head.fc.in_features
        )  # [rows, layers * hidden] features of positions start + len(rows) ...

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
        return self.propose_batch([(self, request, num_speculative_tokens)])[0]

    @property
    def batches(self) -> bool:
        """Requests decoding together draft in shared head passes (:meth:`propose_batch`)."""
        return True

    @staticmethod
    def propose_batch(items: Sequence[tuple[EagleProposer, DraftRequest, int]]) -> list[DraftOutput]:
        """Chains for several requests, each ``(its own drafter, its request, tokens at most)``:
        one head pass catches every head up on its new features, then one pass per draft step
        over the requests still drafting (:func:`~verispec.runners.eagle.head.forward_heads`:
        the head's weights read once per pass, not once per request). Each request's rows are
        processed with its own parameters and drawn with its own generator. Returns one
        :class:`DraftOutput` per item, in order (empty where the head cannot draft)."""
        outputs = [DraftOutput() for _ in items]
        calls, active = [], []  # active: [index, draft token ids, draft rows, tokens left]
        for index, (proposer, request, k) in enumerate(items):
            call = proposer._catch_up_call(request.context) if k > 0 else None
            if call is not None:
                calls.append(call)
                active.append([index, [], [], k])
        while active:
            results = forward_heads(calls)
            next_calls, still = [], []
            for entry, call, (logits, hidden) in zip(active, calls, results):
                index, draft_token_ids, draft_rows, left = entry
                proposer, request, _ = items[index]
                if call.features is not None:  # the catch-up: its rows are real now
                    proposer._caught_up(call)
                token, confidence = proposer._pick(request, logits[-1], draft_token_ids, draft_rows)
                if token is not None:
                    draft_token_ids.append(token)
                if token is None or left == 1 or confidence < request.draft_stop_threshold:
                    outputs[index] = DraftOutput(draft_token_ids, torch.stack(draft_rows) if draft_rows else None)
                    continue
                position = len(request.context) - 1 + len(draft_token_ids) - 1  # row L - 2 is the last real one
                next_calls.append(
                    HeadCall(proposer.head, [token], hidden=hidden[-1:], positions=torch.tensor([position]))
                )
                still.append([index, draft_token_ids, draft_rows, left - 1])
            calls, active = next_calls, still
        return outputs

    def propose_tree(
        self, request: DraftRequest, num_nodes: int, *, branching: int = TREE_BRANCHING, max_depth: int = TREE_MAX_DEPTH
    ) -> TokenTree:
        """A dynamic tree of at most ``num_nodes`` drafted nodes below the root (the context's
        last token), grown by the head's confidence (EAGLE-2, Li et al. 2024, arXiv 2406.16858,
        §4; :func:`~verispec.proposers.draft_tree.grow_dynamic_tree`): one head pass per level,
        every frontier node a row fed its parent's output, attending to the real rows and to its
        own ancestors (a tree mask over the head's cache). The head's cache is back to its real
        rows afterwards. The root alone when the head cannot draft (see :meth:`propose`)."""
        return EagleProposer.propose_trees([(self, request, num_nodes, branching, max_depth)])[0]

    @staticmethod
    def propose_trees(items: Sequence[tuple[EagleProposer, DraftRequest, int, int, int]]) -> list[TokenTree]:
        """:meth:`propose_tree` for several requests, each ``(its own drafter, its request, nodes
        at most, branching, levels at most)``, their trees grown in shared head passes: one pass
        catches every head up, then one pass per level over every tree still growing
        (:func:`~verispec.runners.eagle.head.forward_heads`). Returns one tree per item, in order."""
        trees = [TokenTree((request.context[-1],), (-1,)) for _, request, _, _, _ in items]
        calls, waiting = [], []
        for index, (proposer, request, num_nodes, _, _) in enumerate(items):
            call = proposer._catch_up_call(request.context) if num_nodes > 0 else None
            if call is not None:
                calls.append(call)
                waiting.append(index)
        growing = {}  # index -> [growth generator, level asked for, node outputs, real rows]
        for index, call, (logits, hidden) in zip(waiting, calls, forward_heads(calls) if calls else []):
            proposer, request, num_nodes, branching, max_depth = items[index]
            proposer._caught_up(call)
            growth = dynamic_tree_levels(request, proposer._target_row(logits[-1]), num_nodes, branching, max_depth)
            growing[index] = [growth, None, {0: hidden[-1:]}, proposer.head.num_cached_tokens]
            _advance(growing, index, trees, None)
        while growing:
            order = list(growing)
            calls = [items[i][0]._level_call(items[i][1], *growing[i][1:]) for i in order]
            for index, (logits, out) in zip(order, forward_heads(calls)):
                proposer = items[index][0]
                _, (token_ids, _, first_new), outputs, _ = growing[index]
                outputs.update({n: out[row : row + 1] for row, n in enumerate(range(first_new, len(token_ids)))})
                _advance(growing, index, trees, torch.cat([proposer._target_row(row) for row in logits]))
        for index in waiting:
            proposer = items[index][0]
            proposer.head.truncate(len(proposer._row_token_ids))  # back to the real rows
        return trees

    def _level_call(
        self, request: DraftRequest, level: tuple[list[int], list[int], int], outputs: dict, real: int
    ) -> HeadCall:
        """The head rows of a tree level's new nodes: each fed its parent's output at its depth's
        position, attending to the ``real`` rows and its own ancestors (node ``n``'s row is cache
        row ``real + n - 1``: levels are fed in node order)."""
        token_ids, parents, first_new = level
        tree = TokenTree(tuple(token_ids), tuple(parents))
        new = range(first_new, len(token_ids))
        mask = torch.zeros(len(new), real + len(token_ids) - 1, dtype=torch.bool)
        mask[:, :real] = True
        for row, node in enumerate(new):
            mask[row, [real + a - 1 for a in tree.path_to(node)]] = True
        depths, first_position = (
            tree.depths(),
            len(request.context) - 1,
        )  # a depth-1 node's row: row L - 2 is the last real one
        return HeadCall(
            self.head,
            [token_ids[n] for n in new],
            hidden=torch.cat([outputs[parents[n]] for n in new]),
            positions=torch.tensor([first_position + depths[n] - 1 for n in new]),
            attention_mask=mask,
        )

    def _rows_match(self, context: Sequence[int]) -> bool:
        """The real rows were built from this context's tokens (else the context changed under them)."""
        rows = self._row_token_ids
        return common_prefix_length(rows, context[self._start + 1 : self._start + 1 + len(rows)]) == len(rows)

    def _catch_up_call(self, context: Sequence[int]) -> HeadCall | None:
        """The head pass that feeds the pending features whose next token is known, up to row
        ``len(context) - 2`` (the last round's draft rows dropped first); None where the rows do
        not fit the context (restarted) or the features do not reach that row."""
        if not self._rows_match(context):
            self._restart(len(context), self._pending[:0])
            return None
        self.head.truncate(len(self._row_token_ids))
        first = self._start + len(self._row_token_ids)
        count = min(self._pending.shape[0], len(context) - 1 - first)
        if count <= 0 or first + count != len(context) - 1:
            return None
        return HeadCall(
            self.head,
            list(context[first + 1 : first + 1 + count]),
            features=self._pending[:count],
            positions=torch.arange(first, first + count),
        )

    def _caught_up(self, call: HeadCall) -> None:
        """``call`` (from :meth:`_catch_up_call`) ran: its rows are real, its features consumed."""
        self._row_token_ids.extend(call.token_ids)
        self._pending = self._pending[len(call.token_ids) :]

    def _catch_up(self, context: Sequence[int]) -> tuple[Tensor | None, Tensor | None]:
        """:meth:`_catch_up_call` run alone: the last row's ``(logits [1, draft_vocab], hidden [1,
        hidden])``, or ``(None, None)``."""
        call = self._catch_up_call(context)
        if call is None:
            return None, None
        logits, hidden = forward_heads([call])[0]
        self._caught_up(call)
        return logits[-1:], hidden[-1:]

    def _pick(
        self, request: DraftRequest, draft_logits: Tensor, draft_token_ids: list[int], draft_rows: list[Tensor]
    ) -> tuple[int | None, float]:
        """The next draft token from the head's row ``draft_logits`` (``[draft_vocab]``), chosen as
        the target would choose it after ``draft_token_ids`` (its processed row appended to
        ``draft_rows`` when sampling), and the draft's confidence in it; ``(None, 0.0)`` when
        every allowed token is outside the draft vocabulary."""
        row = self._target_row(draft_logits)
        rows = process_logits(
            row,
            request.params,
            request.prompt_token_ids,
            list(request.output_token_ids) + draft_token_ids,
            allowed=request.allowed_after(draft_token_ids, row.shape[-1]),
        )
        if not torch.isfinite(rows.logits).any():
            return None, 0.0
        if rows.probs is None:
            token = int(rows.greedy_token_ids[0])
            return token, float(torch.softmax(rows.logits[0], dim=-1)[token]) if request.draft_stop_threshold else 1.0
        draft_rows.append(rows.probs[0])
        position = len(request.prompt_token_ids) + len(request.output_token_ids) + len(draft_token_ids)
        return pick_token(rows, request.generator, position), float(rows.probs[0].max())

    def _target_row(self, draft_logits: Tensor) -> Tensor:
        """``[1, vocab]`` float32: the head's scores at their target ids, ``-inf`` elsewhere."""
        row = torch.full((1, self.head.shape.vocab_size), float("-inf"))
        row[0, self.head.d2t] = draft_logits.float()
        return row


def _advance(growing: dict, index: int, trees: list, level_rows: Tensor | None) -> None:
    """Step tree ``index``'s growth (:func:`dynamic_tree_levels`) with its level's rows (None: start
    it): keep the next level it asks for, or, when it is done, its tree (and stop following it)."""
    entry = growing[index]
    try:
        entry[1] = next(entry[0]) if level_rows is None else entry[0].send(level_rows)
    except StopIteration as done:
        trees[index] = done.value
        del growing[index]


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

    declaration = Declaration(
        "eagle-tree",
        Kind.TREE,
        Needs.HEAD,
        HEAD_HINT,
        chain="eagle",
        wraps_chain=True,
        auto=AutoRole.BACKUP,
        priority=31,
        summary="the EAGLE head's dynamic tree",
    )

    def __init__(
        self, eagle: EagleProposer, *, branching: int = TREE_BRANCHING, max_depth: int = TREE_MAX_DEPTH
    ) -> None:
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
        return EagleTreeProposer.propose_batch([(self, request, num_speculative_tokens)])[0]

    @property
    def batches(self) -> bool:
        """Requests decoding together grow their trees in shared head passes (:meth:`propose_batch`)."""
        return True

    @staticmethod
    def propose_batch(items: Sequence[tuple[EagleTreeProposer, DraftRequest, int]]) -> list[DraftOutput]:
        """Trees for several requests (``num_speculative_tokens``: nodes), grown level by level in
        shared head passes (:meth:`EagleProposer.propose_trees`)."""
        trees = EagleProposer.propose_trees(
            [(p.eagle, request, k, p.branching, p.max_depth) for p, request, k in items]
        )
        return [DraftOutput.of_tree(tree) for tree in trees]

    def release(self) -> None:
        self.eagle.release()


def head_quantization_for(choice: str, target_runner) -> str:
    """``choice`` with ``auto`` resolved: :data:`AUTO_HEAD_QUANTIZATION` when ``target_runner``
    runs the GGUF block kernels (:attr:`Runner.runs_block_kernels`: the gguf runner, its kernels
    built and the CPU bandwidth-bound), else ``none``."""
    if choice != "auto":
        return choice
    return AUTO_HEAD_QUANTIZATION if target_runner.runs_block_kernels else "none"
