"""A reduced draft head plus the rows of the tokens its sequence has seen.

A reduced draft vocabulary (FR-Spec, Zhao et al. 2025, §3; :mod:`verispec.runners.cpu.reduced_vocab`)
drops most of the head's rows, and with them the identifiers, names and rare words a request keeps
repeating: on code the draft chain's acceptance fell from 0.646 (full head) to 0.569 with the 32,768
lowest BPE ranks (AMD Zen 4, 10 dev HumanEval prompts, k = 5). Adding back the rows of every token the
sequence has seen (its prompt and what it produced) recovers most of it: 0.620. Each sequence keeps its
own extra rows (:class:`SequenceHeadRows`), built from the full head as the runner multiplies it
(:class:`ContextHeadRows`), so a token's logit is the full head's bit for bit, and a sequence's rows
never depend on another sequence's. Only the draft's proposals change; verification scores the full
vocabulary with the target. Knows nothing about files or the decoder pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from verispec.runners.cpu.gguf_blocks import GGUFLinear, loaded_kernels

MAX_CONTEXT_ROWS = 16_384  # extra rows a sequence may add: past it, tokens stay outside the head
MAX_PARTS = 4  # extra row groups a sequence multiplies separately before they are repacked as one


class ContextHeadRows:
    """The full LM head's rows as the runner multiplies them, to repack any subset of.

    Args:
        raw: uint8 ``[vocab, row_bytes]``, each row one output row of the head in block type
            ``qtype`` (already re-quantized where the loader re-quantizes the head).
        qtype: the ggml block type id of ``raw``.
        in_features: the hidden size (values per row).
        kept: int64 ``[kept]`` ids of the reduced head's own rows (never added again).
    """

    def __init__(self, raw: Tensor, qtype: int, in_features: int, kept: Tensor) -> None:
        self.raw, self.qtype, self.in_features = raw, qtype, in_features
        self.kept = frozenset(kept.tolist())

    @property
    def vocab_size(self) -> int:
        return self.raw.shape[0]

    def linear(self, token_ids: Tensor) -> GGUFLinear:
        """The head restricted to rows ``token_ids`` (int64 ``[n]``): ``[rows, hidden] ->
        [rows, n]`` float32, each column the full head's bit for bit (the products are row-local)."""
        block = self.raw[token_ids].contiguous()
        packed = loaded_kernels().repack(block.view(-1), self.qtype, block.shape[0], self.in_features)
        return GGUFLinear([(packed, self.qtype, block.shape[0])], self.in_features)

    def sequence(self) -> SequenceHeadRows:
        return SequenceHeadRows(self)


class SequenceHeadRows:
    """One sequence's extra head rows: every token it was fed that the reduced head lacks (up to
    :data:`MAX_CONTEXT_ROWS`), kept until :meth:`reset`. Tokens of rolled-back rows stay (a
    superset costs a few rows, never a wrong logit)."""

    def __init__(self, rows: ContextHeadRows) -> None:
        self.rows = rows
        self.seen: set[int] = set()  # the token ids of the rows in parts
        self.parts: list[tuple[Tensor, GGUFLinear]] = []  # (token ids [n] int64, their head rows)

    def add(self, token_ids: Iterable[int]) -> None:
        """Add the rows of ``token_ids`` (full-vocabulary ids) not yet in the head (a set lookup a
        token: a drafting pass's one token costs ~1 us)."""
        kept, seen, vocab = self.rows.kept, self.seen, self.rows.vocab_size
        new = sorted({t for t in token_ids if t not in seen and t not in kept and 0 <= t < vocab})
        new = new[: MAX_CONTEXT_ROWS - len(seen)]
        if not new:
            return
        seen.update(new)
        ids = torch.tensor(new, dtype=torch.long)
        self.parts.append((ids, self.rows.linear(ids)))
        if len(self.parts) > MAX_PARTS:
            merged = torch.cat([p for p, _ in self.parts])
            self.parts = [(merged, self.rows.linear(merged))]

    def copy_from(self, other: SequenceHeadRows) -> None:
        """Hold ``other``'s rows (a sequence that copied ``other``'s cache)."""
        self.seen = set(other.seen)
        self.parts = list(other.parts)

    def reset(self) -> None:
        self.seen = set()
        self.parts = []

    def logits(self, normed: Tensor, logits: Tensor) -> None:
        """Write the extra rows' logits of ``normed`` (``[rows, hidden]`` float32, after the final
        norm) into ``logits`` (``[rows, vocab]`` float32, in place)."""
        for ids, head in self.parts:
            logits[:, ids] = head(normed)
