"""What a request that dies answers, wherever it dies: always OpenAI's error shape.

Owns OpenAI's error shape (:class:`APIError`, re-exported by :mod:`verispec.server.protocol`),
the Server-Sent Events that end a stream cut by a fault (an error event, then ``[DONE]``), and
:class:`FaultLayer`, the ASGI layer Ray Serve's HTTP proxies run in front of the replicas
(``verispec serve --replicas``): a replica that died or that Ray cannot reach answers 503 with
OpenAI's error JSON and ``Retry-After`` instead of Ray's own text 500, and a stream it was
serving ends with an error event instead of a bare cut. The proxy counts those requests by reason
in its own ``verispec_requests_failed`` and adds them to the ``/metrics`` answers it carries.
Imports neither the engine nor Ray: the proxies load it (:func:`proxy_middlewares`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from verispec.server.prom import failure_counter, merge_expositions

log = logging.getLogger("verispec.server")

RETRY_AFTER_S = 1  # a dead replica's requests go to the others at once; Ray replaces it in seconds
# Ray Serve reads RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in each proxy: this returns its middlewares
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "verispec.server.faults:proxy_middlewares"
# What the proxy's own answers (Ray's text) become: status -> (type, code = reason counted)
_RAY_ANSWERS = {
    408: ("timeout", "timeout", "the request timed out in Ray Serve's proxy: retry"),
    429: ("rate_limit_error", "overloaded", "every replica's queue is full: retry later"),
}
_UNAVAILABLE = (
    "server_error",
    "replica_unavailable",
    "the replica serving this request is unavailable (it died or restarts): retry, another replica will answer",
)


class APIError(Exception):
    """An error response in OpenAI's shape: ``{"error": {message, type, param, code}}``.

    ``reason``: set when the error ends an accepted request that died (one of
    :data:`verispec.server.prom.FAILURE_REASONS`, counted in ``/metrics``); None for a refusal
    (a client's mistake, a full queue). ``retry_after_s``: sent as ``Retry-After``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        reason: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.reason, self.retry_after_s = reason, retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str] | None:
        """``Retry-After`` when set, else None."""
        return None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def error_event(error: APIError) -> str:
    """The Server-Sent Event carrying ``error`` (OpenAI's shape: ``data: {"error": {...}}``)."""
    return f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"


DONE_EVENT = "data: [DONE]\n\n"


class FaultLayer:
    """ASGI middleware in front of Ray Serve's ingress (each HTTP proxy runs one; any ASGI app
    can be wrapped): whatever goes wrong between the proxy and a replica reaches the client in
    OpenAI's shape.

    - The app ends (returns or raises) before answering: 503 (408 for a ``TimeoutError``),
      OpenAI's error JSON, ``Retry-After`` (Ray's proxy answers nothing, or raises, when the
      replica died: Ray's ``ActorDiedError`` / ``ActorUnavailableError``).
    - An answer of the app's that is an error but not JSON (Ray's own text: 503 deployment
      unavailable, 500, 408 timeout, 429 queue full): OpenAI's shape, every 5xx as a 503
      (``replica_unavailable``), ``Retry-After`` on 503 and 429.
    - A stream (``text/event-stream``) cut before ``[DONE]``: an error event, then ``[DONE]``.
    - The client left (``http.disconnect`` seen): nothing sent, counted ``client_disconnected``.
    - ``GET /metrics``: this layer's ``verispec_requests_failed`` added to the replicas' counts.
    Ray's own paths (``/-/...``) pass untouched. Requests that died are counted by reason in
    ``registry`` (a private one per process by default).
    """

    def __init__(self, app, *, retry_after_s: int = RETRY_AFTER_S, registry: CollectorRegistry | None = None) -> None:
        self.app = app
        self.retry_after_s = retry_after_s
        self.registry = registry or CollectorRegistry()
        self.failed = failure_counter(self.registry)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith("/-/"):
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(self, scope, receive, send)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception as exc:  # the proxy's own failure (Ray catches the replica's): answered below
            log.warning(
                "request %s %s failed in the proxy: %s: %s",
                scope.get("method"),
                scope.get("path"),
                type(exc).__name__,
                exc,
            )
            await exchange.finish(exc)
        else:
            await exchange.finish(None)

    def unavailable(self, exc: BaseException | None) -> tuple[APIError, str]:
        """The error answering a request the app left unanswered, and its reason."""
        if isinstance(exc, TimeoutError):
            type_, reason, message = _RAY_ANSWERS[408]
            return APIError(408, message, type=type_, code=reason), reason
        type_, reason, message = _UNAVAILABLE
        return APIError(503, message, type=type_, code=reason, retry_after_s=self.retry_after_s), reason

    def rewritten(self, status: int, text: str) -> tuple[APIError, str]:
        """Ray's own error answer ``text`` with ``status`` in OpenAI's shape, and its reason."""
        type_, reason, message = _RAY_ANSWERS.get(status, _UNAVAILABLE)
        if status < 500 and status not in _RAY_ANSWERS:  # e.g. 404 for a route Ray does not know
            return APIError(status, text.strip() or "request failed", code="not_found" if status == 404 else None), ""
        status = 503 if status >= 500 else status  # Ray's text 500 / 502 / 503: the replica is out of reach
        retry = self.retry_after_s if status in (429, 503) else None
        return APIError(
            status,
            f"{message} ({text.strip()})" if text.strip() else message,
            type=type_,
            code=reason,
            retry_after_s=retry,
        ), reason

    def metrics_text(self) -> str:
        return generate_latest(self.registry).decode()


class _Exchange:
    """One request through :class:`FaultLayer`: what was sent so far, what is held back."""

    def __init__(self, layer: FaultLayer, scope, receive, send) -> None:
        self.layer, self.scope, self._receive, self._send = layer, scope, receive, send
        self.started = False  # a response start went to the client
        self.open = False  # ... and its body is not complete
        self.stream = False
        self.tail = b""  # the end of what a stream sent (was it [DONE]?)
        self.held: dict | None = None  # a response start held back (rewritten or extended)
        self.held_body = b""
        self.gone = False
        self.is_metrics = scope.get("method") == "GET" and scope.get("path") == "/metrics"

    async def receive(self):
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.gone = True
        return message

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            headers = {k.lower(): v for k, v in message.get("headers", [])}
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            status = message["status"]
            if (status >= 400 and "json" not in content_type) or (self.is_metrics and status == 200):
                self.held = message
                return
            self.stream = content_type.startswith("text/event-stream")
            self.started = self.open = True
        elif message["type"] == "http.response.body":
            more = message.get("more_body", False)
            if self.held is not None:
                self.held_body += message.get("body", b"")
                if not more:
                    await self._release()
                return
            self.open = more
            if self.stream:
                self.tail = (self.tail + message.get("body", b""))[-32:]
        await self._send(message)

    async def _release(self) -> None:
        """Send the held answer: /metrics with this layer's counts, or Ray's error rewritten."""
        held, body = self.held, self.held_body
        self.held = None
        status = held["status"]
        if status == 200:  # /metrics
            with contextlib.suppress(ValueError):  # not the exposition format: as it came
                body = merge_expositions([body.decode(), self.layer.metrics_text()], count_replicas=False).encode()
            headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
            await self._send({**held, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await self._send({"type": "http.response.body", "body": body})
            self.started = True
            return
        error, reason = self.layer.rewritten(status, body.decode("utf-8", "replace"))
        if reason:
            self.layer.failed.labels(reason=reason).inc()
        await self._answer(error)

    async def _answer(self, error: APIError) -> None:
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers() or {}).items()]
        await self._send({"type": "http.response.start", "status": error.status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})
        self.started, self.open = True, False

    async def finish(self, exc: BaseException | None) -> None:
        """The app ended (``exc``: what it raised): complete whatever it left incomplete."""
        if self.held is not None:  # a held answer whose body never ended
            self.held_body, held_status = b"", self.held["status"]
            if held_status != 200:
                await self._release()
                return
            self.held = None
        if self.gone and (not self.started or self.open):
            self.layer.failed.labels(reason="client_disconnected").inc()
            return
        if not self.started:
            error, reason = self.layer.unavailable(exc)
            self.layer.failed.labels(reason=reason).inc()
            await self._answer(error)
        elif self.open and self.stream:
            if not self.tail.rstrip().endswith(b"data: [DONE]"):
                error, reason = self.layer.unavailable(exc)
                self.layer.failed.labels(reason=reason).inc()
                lead = b"" if not self.tail or self.tail.endswith(b"\n\n") else b"\n\n"
                await self._send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": lead + error_event(error).encode() + DONE_EVENT.encode(),
                    }
                )
            await self._send({"type": "http.response.body", "body": b""})
        elif self.open:  # a JSON body cut midway cannot be mended: the client sees the cut
            self.layer.failed.labels(reason="replica_unavailable").inc()
            if exc is not None:
                raise exc


def proxy_middlewares() -> list:
    """The middlewares Ray Serve's HTTP proxy runs (named by ``PROXY_CALLBACK_ENV``): a
    :class:`FaultLayer`. Raises ImportError without starlette (Ray Serve brings it)."""
    from starlette.middleware import Middleware

    return [Middleware(FaultLayer)]
