"""Which drafters each speculative method uses: the one definition the engine, the loader and the
CLI read (the drafter order per method, which methods need a draft model or an EAGLE head, and
what loads a missing one). Knows nothing about drafting itself (:mod:`verispec.engine.policy`).
"""

from __future__ import annotations

from collections.abc import Sequence

from verispec.errors import InvalidParameterError

LOOKUP_DRAFTERS = ("suffix", "ngram")  # auto: the first loaded one drafts whenever its lookup matches
MODEL_DRAFTERS = ("eagle", "draft")  # auto: every loaded one backs up the lookup (the better per step)
ALTERNATIVE_DRAFTERS = (
    "eagle",
    "eagle-tree",
    "draft",
    "tree",
)  # auto: per step, the best realised rate of those offered
TREE_DRAFTERS = ("ngram-tree", "tree")  # tree: n-gram branches when the lookup matches, else the draft tree
TREE_SCHEDULED = (*TREE_DRAFTERS, "suffix-tree", "eagle-tree")  # drafters whose budget is a tree's node count
MISSING_DRAFTER_HINTS = {  # what loads a model drafter, for the error when it is not loaded
    "layer-skip": "layer skip runs the first layers of the target's float model, which the gguf and llama.cpp "
    "runners (and int8 from a GGUF file) do not hold: use --runner torch",
    "eagle": "load a head with --eagle-head (a file verispec train-head writes, or a published EAGLE-3 folder)",
    "eagle-tree": "load a head with --eagle-head (a file verispec train-head writes, or a published EAGLE-3 folder)",
    "draft": "load a draft model with --draft",
}


def drafter_order(method: str, loaded: Sequence[str], trees: bool = False) -> list[str]:
    """Drafters tried each step, in order, for ``method`` given the ``loaded`` drafter names.

    ``auto``: the lookup drafter (suffix, else n-gram), then the model drafters loaded (the EAGLE
    head's chain, the draft model's chain and, where the target runner can verify token trees
    (``trees``), the head's tree and the draft model's tree; :meth:`DraftPolicy.draft` ranks them
    per step by realised rate), else layer skip.

    Raises:
        InvalidParameterError: the method needs a drafter that is not loaded.
    """
    if method == "none":
        return []
    if method == "auto":
        models = [name for name in MODEL_DRAFTERS if name in loaded]
        if trees and "eagle" in models and "eagle-tree" in loaded:
            models.insert(models.index("eagle") + 1, "eagle-tree")
        if trees and "draft" in models and "tree" in loaded:
            models.append("tree")
        fallback = models or [name for name in ("layer-skip",) if name in loaded]
        lookup = [name for name in LOOKUP_DRAFTERS if name in loaded][:1]
        return lookup + fallback
    if method == "suffix" and "suffix" in loaded:  # its frequency-scored tree where the target verifies trees
        return ["suffix-tree"] if trees and "suffix-tree" in loaded else ["suffix"]
    if method == "tree" and any(name in loaded for name in TREE_DRAFTERS):
        return [name for name in TREE_DRAFTERS if name in loaded]
    if method not in loaded:
        names = ", ".join(sorted(loaded)) or "none"
        hint = MISSING_DRAFTER_HINTS.get(method, "")
        raise InvalidParameterError(
            f"method {method!r} needs its drafter loaded (loaded: {names})" + (f": {hint}" if hint else "")
        )
    return [method]


DRAFT_MODEL_DRAFTERS = ("draft", "tree")  # drafters over the draft model (tree: its token tree)
HEAD_DRAFTERS = ("eagle", "eagle-tree")  # drafters over an EAGLE head


def uses_draft_model(method: str) -> bool:
    """Whether ``method`` drafts with the draft model where one is loaded (``draft``, ``tree``,
    and ``auto``, which backs its lookups with it)."""
    return method == "auto" or method in DRAFT_MODEL_DRAFTERS


def needs_head(method: str) -> bool:
    """Whether ``method`` cannot run without an EAGLE head (``--eagle-head``)."""
    return method in HEAD_DRAFTERS
