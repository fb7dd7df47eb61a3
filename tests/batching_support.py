"""The tiny GGUF pair (``gguf_files``, a fixture of ``tests/conftest.py``) as one engine with a draft
model and a draft tree, the prompts the batching tests share, and a scheduler run of many requests
(``tests/engine/test_batching.py`` and the tests that batch the same way)."""

from gguf_models import VOCAB
from helpers import CharTokenizer, default_pieces
from verispec.engine import SpeculativeEngine
from verispec.engine.scheduler import Scheduler
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.runners.cpu.gguf_runner import GGUFRunner

PIECES = CharTokenizer(default_pieces(VOCAB))
PROMPTS = [
    [5, 17, 33, 2, 9],
    [70, 3],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [40] * 12,
    [8, 9, 8, 9, 8, 9, 8],
    [60, 61, 62],
    [1 + i % 50 for i in range(37)],
    [90, 4, 22, 4, 90, 4],
]


def gguf_engine(files, **options) -> SpeculativeEngine:
    target = GGUFRunner.from_file(files["target"], max_context_length=256)
    proposers = {
        "draft": DraftModelProposer(GGUFRunner.from_file(files["draft"], max_context_length=256)),
        "tree": DraftTreeProposer(
            GGUFRunner.from_file(files["draft"], max_context_length=256), branching=2, max_depth=4
        ),
    }
    return SpeculativeEngine(target, PIECES, eos_token_ids=(0,), proposers=proposers, **options)


def run_batched(engine, requests, max_num_seqs=8, cancel_after=None, **options):
    """Every request through one scheduler; returns token ids per request (None if cancelled)
    and the largest batch seen."""
    scheduler = Scheduler(engine, max_num_seqs=max_num_seqs, **options)
    handles = [scheduler.add(*r, tag=i) for i, r in enumerate(requests)]
    outputs, largest, steps = [None] * len(requests), 0, 0
    while scheduler.running or scheduler.waiting:
        largest = max(largest, len(scheduler.running))
        for handle, chunk in scheduler.step():
            if chunk.output is not None:
                outputs[handle.tag] = chunk.output.token_ids
        steps += 1
        if cancel_after is not None and steps == cancel_after[1]:
            scheduler.cancel(handles[cancel_after[0]])
    return outputs, largest
