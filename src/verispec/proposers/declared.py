"""What each drafter declares about itself (:class:`Declaration`), and the table of every declared
drafter (:func:`declared_drafters`) that the methods, the CLI choices, the loader and the exports read.

A drafter class states its facts once, on itself (``declaration = Declaration(...)``): its name,
its kind, what must be loaded for it, whether it scores its own drafts, which chain a tree
branches and how ``auto`` uses it. Every module of :mod:`verispec.proposers` is imported on the
first call of :func:`declared_drafters`, so a new drafter is one new module: nothing else lists
it. Knows nothing about drafting itself.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from verispec.errors import InvalidParameterError


class Kind(StrEnum):
    """What a drafter drafts with."""

    LOOKUP = "lookup"  # matches the context (and past requests) without any model pass
    MODEL = "model"  # runs a draft model (a smaller model, or the target's first layers), a chain
    HEAD = "head"  # runs an EAGLE head over the target's own features, a chain
    TREE = "tree"  # proposes a token tree (several branches verified in one target pass)


class Needs(StrEnum):
    """What must be loaded before the drafter exists."""

    NOTHING = "nothing"  # built for every engine
    DRAFT_MODEL = "draft model"  # --draft
    HEAD = "EAGLE head"  # --eagle-head
    FLOAT_TARGET = "float target"  # the target's transformers model (the torch runner)


class AutoRole(StrEnum):
    """How method ``auto`` uses the drafter (:func:`verispec.engine.methods.drafter_order`)."""

    NONE = "none"  # never
    LOOKUP = "lookup"  # tried first each step (the first loaded by priority); drafts when it matches
    BACKUP = "backup"  # ranked per step by realised rate behind the lookup; a tree joins its chain
    FALLBACK = "fallback"  # only where no backup is loaded


@dataclass(frozen=True)
class Declaration:
    """The facts of one drafter, declared on its class.

    Attributes:
        name: the drafter's name (the key of the engine's drafter mapping; the ``--method`` value
            when ``selectable``).
        kind: :class:`Kind`. A ``TREE`` drafter's budget is a node count (its schedule prices trees).
        needs: :class:`Needs`: what must be loaded for the drafter to exist.
        hint: how to load what ``needs`` names (the error when a method's drafter is missing).
        summary: what the drafter drafts, in a few words (the CLI's ``--method`` help).
        selectable: a ``--method`` of its own (a lookup's tree is chosen through its chain's method).
        chain: for a tree, the chain drafter whose proposals it branches; None for a chain.
        wraps_chain: the tree is built over its chain drafter object and shares its index
            (``Tree(chain)``, ``tree.over(chain)`` for another sequence); False: it holds its own
            state (the draft model's tree runs its own sequence).
        scores_own_drafts: implements :meth:`~verispec.proposers.Proposer.draft_confidences`: the
            policy sizes its draft by those scores.
        auto: :class:`AutoRole`.
        in_tree_method: method ``tree`` uses it (lookup branches first, else the draft model's tree).
        for_chain_method: a lookup's tree its chain's method drafts with instead of the chain where
            the target verifies trees (``suffix``: its frequency-scored tree).
        priority: order among drafters of the same role (lower first): ``auto``'s lookup and
            backups, the tree method's members, the listing of the methods.
    Raises:
        InvalidParameterError: a tree without its chain, or a chain naming one.
    """

    name: str
    kind: Kind
    needs: Needs = Needs.NOTHING
    hint: str = ""
    summary: str = ""
    selectable: bool = True
    chain: str | None = None
    wraps_chain: bool = False
    scores_own_drafts: bool = False
    auto: AutoRole = AutoRole.NONE
    in_tree_method: bool = False
    for_chain_method: bool = False
    priority: int = 100

    def __post_init__(self) -> None:
        if (self.kind is Kind.TREE) != (self.chain is not None):
            raise InvalidParameterError(f"drafter {self.name!r}: a tree names its chain, and only a tree does")
        if self.wraps_chain and self.chain is None:
            raise InvalidParameterError(f"drafter {self.name!r} wraps a chain but names none")


REGISTERED: dict[str, type] = {}  # name -> drafter class (a Proposer subclass), filled as the classes are defined


def register(cls: type) -> None:
    """Add ``cls`` (a :class:`~verispec.proposers.Proposer` subclass declaring itself) to the table.

    Raises:
        InvalidParameterError: another class already declared the same name.
    """
    name = cls.declaration.name
    other = REGISTERED.get(name)
    if other is not None and other.__qualname__ != cls.__qualname__:
        raise InvalidParameterError(f"drafter {name!r} is declared by both {other.__qualname__} and {cls.__qualname__}")
    REGISTERED[name] = cls


@functools.cache
def import_drafter_modules() -> None:
    """Import every module of :mod:`verispec.proposers` (the drafters' folder), so each declares its
    drafters; the folder is listed on the first call only."""
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{module.name}")


def declared_drafters() -> dict[str, type]:
    """Every declared drafter class by name, in priority order (ties by name)."""
    import_drafter_modules()
    return dict(sorted(REGISTERED.items(), key=lambda item: (item[1].declaration.priority, item[0])))
