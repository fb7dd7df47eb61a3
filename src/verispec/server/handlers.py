"""The app's HTTP error handling (:func:`install_error_handlers`: OpenAI-shaped errors for every
failure, each counted in ``/metrics``) and its OpenAPI document (:func:`openapi_without_422`), apart
from the routes of :mod:`verispec.server.app`."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.server.faults import APIError
from verispec.server.limits import validation_error
from verispec.server.prom import ServerMetrics
from verispec.server.responses import ClientGone

log = logging.getLogger("verispec.server")


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every failure answered in OpenAI's error shape and counted in ``metrics``: API errors as
    raised, invalid bodies 400 (not FastAPI's 422), unknown routes 404/405, a client gone 499
    (nobody reads it), anything else 500 with an error id in the log."""

    def respond(status: int, body: dict, headers: dict | None = None, reason: str | None = None) -> JSONResponse:
        metrics.http_errors.labels(status=str(status)).inc()
        if reason is not None:
            metrics.failed.labels(reason=reason).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc.status, exc.body(), exc.headers(), exc.reason)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(400, validation_error(exc.errors(), request.headers.get("content-type")).body())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return respond(exc.status_code, APIError(exc.status_code, str(exc.detail), code=code).body())

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        metrics.failed.labels(reason="client_disconnected").inc()
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def server_fault(request: Request, exc: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex[:12]
        log.error("unhandled error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        message = f"internal server error (error id {error_id})"
        return respond(
            500, APIError(500, message, type="server_error", code="server_error").body(), reason="internal_error"
        )


def openapi_without_422(app: FastAPI):
    """FastAPI documents 422 for bodies; this server answers 400 instead, so drop them."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
