"""The engine: one generate loop (:mod:`.loop`), the request types it takes and gives
(:mod:`.request`, :mod:`.state`), the scheduler that batches requests, the draft policy, token
constraints, and the loader that builds an engine from model references (:mod:`.loader`).

The public types are re-exported here (``from verispec.engine import SpeculativeEngine``).
"""

from verispec.engine.loop import SpeculativeEngine
from verispec.engine.request import (
    MAX_SPECULATIVE_TOKENS,
    METHODS,
    GenerationOutput,
    SpeculativeConfig,
    StreamChunk,
)
from verispec.engine.state import RequestState, Slot

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "METHODS",
    "GenerationOutput",
    "RequestState",
    "Slot",
    "SpeculativeConfig",
    "SpeculativeEngine",
    "StreamChunk",
]
