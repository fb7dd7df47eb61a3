"""verispec: lossless speculative decoding.

The public API, all a library user imports::

    from verispec import SpeculativePipeline, SpeculativeConfig, SamplingParams

The pipeline and its types load on first use (PEP 562 module ``__getattr__``): ``import verispec``
and every ``verispec.<module>`` import stay light (no torch, no engine), and no module of the
package imports this facade's exports, so no import cycle can pass through here. The errors are
plain classes and are imported eagerly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from verispec.errors import (
    ContextLengthError,
    IncompatibleDraftError,
    InvalidParameterError,
    ModelFetchError,
    ModelIntegrityError,
    ModelNotFoundError,
    VerispecError,
)

__version__ = "0.1.0"

# name -> the module that defines it; loaded on first attribute access
LAZY_EXPORTS = {
    "SpeculativePipeline": "verispec.engine.loader",
    "SpeculativeConfig": "verispec.engine.request",
    "GenerationOutput": "verispec.engine.request",
    "StreamChunk": "verispec.engine.request",
    "Scheduler": "verispec.engine.scheduler",
    "SamplingParams": "verispec.algorithms.sampling",
    "RequestMetrics": "verispec.metrics",
}

__all__ = [
    *LAZY_EXPORTS,
    "ContextLengthError",
    "IncompatibleDraftError",
    "InvalidParameterError",
    "ModelFetchError",
    "ModelIntegrityError",
    "ModelNotFoundError",
    "VerispecError",
    "__version__",
]

# for type checkers and IDEs only; at run time __getattr__ loads these ("X as X": a re-export, PEP 484)
if TYPE_CHECKING:
    from verispec.algorithms.sampling import SamplingParams as SamplingParams
    from verispec.engine.loader import SpeculativePipeline as SpeculativePipeline
    from verispec.engine.request import GenerationOutput as GenerationOutput
    from verispec.engine.request import SpeculativeConfig as SpeculativeConfig
    from verispec.engine.request import StreamChunk as StreamChunk
    from verispec.engine.scheduler import Scheduler as Scheduler
    from verispec.metrics import RequestMetrics as RequestMetrics


def __getattr__(name: str):
    """The lazy exports of :data:`LAZY_EXPORTS`; AttributeError for any other name."""
    if name not in LAZY_EXPORTS:
        raise AttributeError(f"module 'verispec' has no attribute {name!r}")
    value = getattr(importlib.import_module(LAZY_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY_EXPORTS))
