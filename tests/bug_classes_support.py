"""The engine of the bug-class tests (``tests/engine/test_bug_classes.py`` and its misconfiguration
half, ``test_bug_classes_refusals.py``): tiny torch models with every kind of drafter, the
prompts, and the constant-schedule speculative config their runs use. Their target is the
``target`` fixture of ``tests/conftest.py``."""

from __future__ import annotations

from helpers import CharTokenizer, default_pieces
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.proposers.layer_skip import LayerSkipProposer
from verispec.proposers.ngram import NgramProposer
from verispec.runners.torch_runner import TransformersRunner

VOCAB = 96
PROMPTS = [
    [5, 17, 33, 2, 9, 5, 17],
    [8, 9, 8, 9, 8, 9, 8],
    [60, 61, 62],
    [90, 4, 22, 4, 90, 4],
    [11, 12, 13, 14, 15, 16],
]


def spec(method: str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_speculative_tokens=k, schedule="constant")


PLAIN = SpeculativeConfig(method="none")


def make_engine(target, draft, *, draft_context_length: int | None = None, ngram: NgramProposer | None = None):
    """The target with every kind of drafter: the draft model's chain and tree, layer skip (the
    target's first layer), and the n-gram and suffix lookups the engine adds itself."""
    proposers = {
        "draft": DraftModelProposer(
            TransformersRunner(draft, max_context_length=draft_context_length), context_window=None
        ),
        "tree": DraftTreeProposer(TransformersRunner(draft), branching=2, max_depth=3),
        "layer-skip": LayerSkipProposer(target, 1),
    }
    if ngram is not None:
        proposers["ngram"] = ngram
    return SpeculativeEngine(
        TransformersRunner(target), CharTokenizer(default_pieces(VOCAB)), eos_token_ids=(), proposers=proposers
    )
