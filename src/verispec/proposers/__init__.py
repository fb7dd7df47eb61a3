"""Drafters: whatever proposes the tokens the target will verify.

:mod:`.base` declares the protocol every drafter implements (:class:`Proposer`, its hooks and
their defaults); :mod:`.factory` decides which drafters an engine gets. The drafters: a draft
model's chains (:mod:`.draft_model`) and trees (:mod:`.draft_tree`), layer skip
(:mod:`.layer_skip`), n-gram lookup (:mod:`.ngram`), suffix lookup over earlier requests and a
corpus datastore (:mod:`.suffix`, :mod:`.datastore`).
"""

from verispec.algorithms.draft import DraftOutput
from verispec.proposers.base import DraftCacheSequences, DraftRequest, Proposer, TokenMasks, common_prefix_length

__all__ = ["DraftCacheSequences", "DraftOutput", "DraftRequest", "Proposer", "TokenMasks", "common_prefix_length"]
