"""Drafters: whatever proposes the tokens the target will verify.

:mod:`.base` declares the protocol every drafter implements (:class:`Proposer`, its hooks and
their defaults); :mod:`.declared` the facts each drafter class declares about itself (name, kind,
what it needs loaded, its role in ``auto``) and the table of them; :mod:`.factory` builds an
engine's drafters from those. The drafters: a draft model's chains (:mod:`.draft_model`) and
trees (:mod:`.draft_tree`), layer skip (:mod:`.layer_skip`), n-gram lookup (:mod:`.ngram`),
suffix lookup over earlier requests and a corpus datastore (:mod:`.suffix`, :mod:`.datastore`),
an EAGLE-3 head's chains and trees (:mod:`.eagle`). A new drafter is one new module here.
"""

from verispec.algorithms.draft import DraftOutput
from verispec.proposers.base import (
    DraftCacheSequences,
    DrafterSources,
    DraftRequest,
    Proposer,
    TokenMasks,
    common_prefix_length,
)
from verispec.proposers.declared import AutoRole, Declaration, Kind, Needs, declared_drafters

__all__ = [
    "AutoRole",
    "Declaration",
    "DraftCacheSequences",
    "DraftOutput",
    "DraftRequest",
    "DrafterSources",
    "Kind",
    "Needs",
    "Proposer",
    "TokenMasks",
    "common_prefix_length",
    "declared_drafters",
]
