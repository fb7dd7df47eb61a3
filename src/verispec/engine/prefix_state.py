"""A request's view of the prefix cache, kept in its state between the engine's steps.

Owns :class:`PrefixState` (a request's block names, the blocks it holds, the prompt tokens it read
from the cache, the target features it saw) and :class:`FeatureLog`. What the engine does with
them is :mod:`verispec.engine.prefix_reuse`'s; knows nothing about passes or the store's insides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class FeatureLog:
    """The target features of a sequence's positions ``0 .. len - 1`` as handed to its feature
    drafters (``[tokens, layers * hidden]`` float32 pieces), so its blocks can keep them."""

    pieces: list[Tensor] = field(default_factory=list)
    length: int = 0

    def put(self, features: Tensor, position: int) -> None:
        """Features of positions ``position ..``; the log is cut there first (a rollback). A gap
        (features never handed over) empties the log: its blocks keep no features then."""
        if position > self.length:
            self.pieces, self.length = [], 0
            return
        if position < self.length:
            kept = torch.cat(self.pieces)[:position] if position else None
            self.pieces, self.length = ([kept] if kept is not None else []), position
        self.pieces.append(features)
        self.length += features.shape[0]

    def rows(self, start: int, end: int) -> Tensor | None:
        """Features of positions ``start .. end - 1``, or None where the log does not hold them."""
        if end > self.length or not self.pieces:
            return None
        if len(self.pieces) > 1:
            self.pieces = [torch.cat(self.pieces)]
        return self.pieces[0][start:end]


@dataclass
class PrefixState:
    """One request's view of the prefix cache: ``names`` of its prompt's full blocks, the blocks
    it ``held``, the prompt tokens it read from the cache (``num_cached_tokens``, the most over its
    lookups), whether its lookup was counted, and its ``features`` (where a feature drafter reads)."""

    names: list[bytes]
    held: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    counted: bool = False
    features: FeatureLog | None = None
