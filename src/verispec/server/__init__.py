"""The OpenAI-compatible server (``verispec serve``): FastAPI app, engine worker, metrics.

Needs the ``server`` extra (fastapi, uvicorn, prometheus-client). Knows nothing about decoding:
it queues requests for the engine and formats what the engine streams. ``ServerConfig`` and
``create_app`` are imported on first use, so that :mod:`verispec.server.faults` (run by Ray
Serve's proxies) loads without the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verispec.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    """``ServerConfig`` and ``create_app`` from :mod:`verispec.server.app`; raises AttributeError for other names."""
    if name in __all__:
        from verispec.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'verispec.server' has no attribute {name!r}")
