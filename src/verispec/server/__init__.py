"""The OpenAI-compatible server (``verispec serve``): FastAPI app, engine worker, metrics.

Needs the ``server`` extra (fastapi, uvicorn, prometheus-client). Knows nothing about decoding:
it queues requests for the engine and formats what the engine streams.
"""

from verispec.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
