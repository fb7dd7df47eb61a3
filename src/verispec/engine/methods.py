"""Which drafters each speculative method uses, derived from what the drafters declare
(:mod:`verispec.proposers.declared`): the method names, the drafter order per method, which methods
need a draft model or an EAGLE head, and what loads a missing one. The engine, the loader, the CLI
and the exports read these; no list of drafter names is kept anywhere else. Knows nothing about
drafting itself (:mod:`verispec.engine.policy`).
"""

from __future__ import annotations

from collections.abc import Sequence

from verispec.errors import InvalidParameterError
from verispec.proposers.declared import AutoRole, Declaration, Kind, Needs, declared_drafters

_DECLARED: dict[str, Declaration] = {name: cls.declaration for name, cls in declared_drafters().items()}


def _named(keep) -> tuple[str, ...]:
    return tuple(name for name, d in _DECLARED.items() if keep(d))


# "none": plain decoding; "auto": per step, the lookup when it matches, else the best model drafter;
# "tree": token trees (the lookup's branches when it matches, else the draft model's tree); then each drafter's own
METHODS = ("none", "auto", *(name for name in _named(lambda d: d.selectable) if name not in ("none", "auto")))
LOOKUP_DRAFTERS = _named(lambda d: d.auto is AutoRole.LOOKUP and d.chain is None)  # auto: the first loaded one
MODEL_DRAFTERS = _named(lambda d: d.auto is AutoRole.BACKUP and d.chain is None)  # auto: every loaded one backs up
FALLBACK_DRAFTERS = _named(lambda d: d.auto is AutoRole.FALLBACK)  # auto: where no model drafter is loaded
ALTERNATIVE_DRAFTERS = _named(lambda d: d.auto is AutoRole.BACKUP)  # auto: ranked per step by realised rate
TREE_DRAFTERS = _named(lambda d: d.in_tree_method)  # method tree: in this order
TREE_SCHEDULED = _named(lambda d: d.kind is Kind.TREE)  # drafters whose budget is a tree's node count
MISSING_DRAFTER_HINTS = {name: d.hint for name, d in _DECLARED.items() if d.needs is not Needs.NOTHING and d.hint}
DRAFT_MODEL_DRAFTERS = _named(lambda d: d.needs is Needs.DRAFT_MODEL)  # drafters over the draft model
HEAD_DRAFTERS = _named(lambda d: d.needs is Needs.HEAD)  # drafters over an EAGLE head


def drafter_order(method: str, loaded: Sequence[str], trees: bool = False) -> list[str]:
    """Drafters tried each step, in order, for ``method`` given the ``loaded`` drafter names.

    ``auto``: the lookup drafter (the first loaded of :data:`LOOKUP_DRAFTERS`), then the model
    drafters loaded (:data:`MODEL_DRAFTERS`, each followed, where the target runner can verify
    token trees (``trees``), by its tree; :meth:`DraftPolicy.draft` ranks them per step by
    realised rate), else the fallback (layer skip). A chain method whose lookup has a tree uses
    the tree where the target verifies trees (``suffix``); ``tree``: :data:`TREE_DRAFTERS` loaded.

    Raises:
        InvalidParameterError: the method needs a drafter that is not loaded.
    """
    if method == "none":
        return []
    if method == "auto":
        models = []
        for name in MODEL_DRAFTERS:
            if name in loaded:
                models.append(name)
                models += [t for t in ALTERNATIVE_DRAFTERS if trees and t in loaded and _DECLARED[t].chain == name]
        fallback = models or [name for name in FALLBACK_DRAFTERS if name in loaded][:1]
        lookup = [name for name in LOOKUP_DRAFTERS if name in loaded][:1]
        return lookup + fallback
    if method in LOOKUP_DRAFTERS and method in loaded:  # its own tree where the target verifies trees
        own_tree = [
            t for t in TREE_SCHEDULED if _DECLARED[t].chain == method and t in loaded and _DECLARED[t].for_chain_method
        ]
        return own_tree[:1] if trees and own_tree else [method]
    if method == "tree" and any(name in loaded for name in TREE_DRAFTERS):
        return [name for name in TREE_DRAFTERS if name in loaded]
    if method not in loaded:
        names = ", ".join(sorted(loaded)) or "none"
        hint = MISSING_DRAFTER_HINTS.get(method, "")
        raise InvalidParameterError(
            f"method {method!r} needs its drafter loaded (loaded: {names})" + (f": {hint}" if hint else "")
        )
    return [method]


def uses_draft_model(method: str) -> bool:
    """Whether ``method`` drafts with the draft model where one is loaded (``draft``, ``tree``,
    and ``auto``, which backs its lookups with it)."""
    return method == "auto" or method in DRAFT_MODEL_DRAFTERS


def needs_head(method: str) -> bool:
    """Whether ``method`` cannot run without an EAGLE head (``--eagle-head``)."""
    return method in HEAD_DRAFTERS


def needs_trees(method: str) -> bool:
    """Whether ``method`` only drafts token trees, so the target runner must verify them."""
    return method in _DECLARED and _DECLARED[method].kind is Kind.TREE and _DECLARED[method].selectable


def method_help() -> str:
    """The ``--method`` help of the CLI: ``auto``, then each selectable drafter with its declared
    summary, then ``none``."""
    own = ", ".join(f"{name} ({_DECLARED[name].summary})" if _DECLARED[name].summary else name for name in METHODS[2:])
    return (
        "auto (per step: the lookup where it matches, else the faster of the EAGLE head and the draft model, "
        f"chains or trees; layer skip only on --runner torch without either), {own}, or none (plain decoding)."
    )
