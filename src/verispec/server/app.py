"""The OpenAI-compatible HTTP server: routes, streaming, errors, auth and limits.

Owns the FastAPI app built by :func:`create_app`: ``/v1/completions`` and
``/v1/chat/completions`` (JSON or Server-Sent Events), ``/v1/models``, ``/health``,
``/metrics``, ``/openapi.json`` and the tokenizer's ``/tokenize`` and ``/detokenize``
(:mod:`~verispec.server.tokenize`); OpenAI-shaped errors for every failure (client mistakes are
4xx, never 500); the optional Bearer key on ``/v1``; the request body limit. Generation is the
engine worker's (:mod:`verispec.server.worker`); wire translation is :mod:`~verispec.server.protocol`'s,
the shape of choices and event streams :mod:`~verispec.server.responses`', the error shape and
the ASGI layer of Ray Serve's proxies :mod:`~verispec.server.faults`'. A request that dies (the
engine failing, the server's own bug, the client leaving, an engine that cannot serve: 503 with
``Retry-After``) is counted in ``/metrics`` by reason.
Knows nothing about decoding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.bench.audit import QualityAuditor
from verispec.engine import SpeculativeConfig
from verispec.errors import CacheFileError
from verispec.metrics import peak_rss_bytes
from verispec.models.cache_files import report_damaged
from verispec.proposers.suffix_file import SuffixSnapshots
from verispec.server import logprobs, protocol, tokenize
from verispec.server.config import ServerConfig
from verispec.server.faults import RETRY_AFTER_S, APIError
from verispec.server.limits import BodyLimitMiddleware, check_method, fit_window, validation_error
from verispec.server.prefix_files import PrefixCacheFiles, check_writable
from verispec.server.prom import ServerMetrics
from verispec.server.responses import Choice, ChoiceView, ClientGone, next_event, sse
from verispec.server.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from verispec.server.traffic import TrafficRecorder, chat_record, completion_records
from verispec.server.worker import EngineWorker, Job, QueueFullError

log = logging.getLogger("verispec.server")
ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}
GENERATE_RESPONSES = {**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}}


class _State:
    def __init__(self, pipeline, config: ServerConfig) -> None:
        self.pipeline = pipeline
        self.config = config
        self.model_name = config.model_name or pipeline.target.name
        self.created = int(time.time())
        self.fingerprint = protocol.system_fingerprint(pipeline.target.path)
        self.metrics = ServerMetrics()
        self.metrics.describe_runner(pipeline.runner_kind, pipeline.runner_choice.facts)
        self.token_texts = logprobs.TokenText(pipeline.tokenizer)
        self.traffic = None if config.record_traffic is None else TrafficRecorder(config.record_traffic)
        self.auditor = QualityAuditor(config.audit_rate)
        self.metrics.track_audits(self.auditor)
        if pipeline.prefix_cache is not None:
            self.metrics.track_prefix_cache(pipeline.prefix_cache)
        self.default_spec = config.default_spec or SpeculativeConfig(
            method="draft" if "draft" in pipeline.engine.proposers else "none"
        )
        warmup_prompt = pipeline.encode("Hello")
        pipeline.engine.check_request(warmup_prompt, self.default_spec)  # its drafter not loaded: refused now
        self.worker = EngineWorker(
            pipeline.engine,
            max_queue=config.max_queue,
            metrics=self.metrics,
            warmup_prompt_token_ids=warmup_prompt,
            warmup_spec=self.default_spec,
            auditor=self.auditor,
            max_num_seqs=config.max_num_seqs,
            max_kv_tokens=config.max_kv_tokens,
        )


def create_app(pipeline, config: ServerConfig | None = None, *, metrics_exposition=None, **options) -> FastAPI:
    """The FastAPI app serving ``pipeline`` (a loaded :class:`~verispec.engine.loader.SpeculativePipeline`).

    ``options`` override fields of ``config`` (e.g. ``create_app(pipe, api_key="k", max_queue=4)``).
    ``metrics_exposition``: an async callable returning the Prometheus text ``/metrics`` serves
    instead of this app's own (replicas merge all replicas' counters: :mod:`verispec.server.replicas`).
    The engine worker starts, warms up and stops with the app's lifespan; ``/health`` answers
    503 until the warm-up is done. Raises InvalidParameterError for an audit rate outside [0, 1], a
    ``default_spec`` whose drafter is not loaded, or a ``suffix_cache`` file that is not one (a
    suffix cache that fails its check is said once on stderr and ignored).
    """
    config = dataclasses.replace(config or ServerConfig(), **options)
    state = _State(pipeline, config)
    cache = pipeline.suffix_cache
    snapshots = None
    if config.suffix_cache is not None and cache is not None:
        check_writable(config.suffix_cache, "suffix cache")
        written = None  # what the file holds: None writes a first snapshot at once
        if os.path.exists(config.suffix_cache):
            try:
                log.info("suffix cache: %d past requests from %s", cache.load(config.suffix_cache), config.suffix_cache)
                written = cache.num_changes
            except CacheFileError as exc:  # ours, damaged: never read; the first snapshot replaces it
                report_damaged(config.suffix_cache, str(exc), "the server starts with an empty suffix cache")
        snapshots = SuffixSnapshots(cache, config.suffix_cache, config.suffix_snapshot_s, written)
    prefix_files = PrefixCacheFiles(pipeline, config.prefix_cache_file, config.warm_prompts)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for summary in pipeline.model_summaries():
            log.info(
                "%s %s: loaded in %.1f s, %.0f MiB",
                summary.role,
                summary.name,
                summary.load_time_s,
                summary.param_bytes / 2**20,
            )
        log.info("%s (--max-context)", pipeline.window_summary(state.worker.max_num_seqs))
        prefix_files.start()
        log.info("peak RSS after loading: %.0f MiB; warming up", peak_rss_bytes() / 2**20)
        state.worker.start()
        if snapshots is not None:
            snapshots.start()
        yield
        state.worker.stop()
        if snapshots is not None:
            snapshots.stop()  # the last snapshot, after the last request
        prefix_files.stop()

    app = FastAPI(  # strict_content_type=False: a body without Content-Type is read as JSON (curl -d, OpenAI)
        title="verispec",
        version="0.1.0",
        lifespan=lifespan,
        summary="OpenAI-compatible lossless speculative decoding",
        strict_content_type=False,
    )
    app.state.verispec = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    _install_error_handlers(app, state)

    async def authorized(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def model_card() -> ModelCard:
        return ModelCard(id=state.model_name, created=state.created)

    @app.get("/health", responses={503: {"model": dict}})
    async def health() -> JSONResponse:
        """200 once the models are loaded and warmed up (with the audit counters); 503 before,
        and while the engine cannot serve (``{"status": "unavailable", "problem": ...}``)."""
        if not state.worker.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        problem = _engine_problem(state)
        if problem is not None:
            return JSONResponse(
                {"status": "unavailable", "problem": problem},
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        audit = {"rate": state.auditor.rate, "pending": state.auditor.num_pending, **state.auditor.snapshot().to_dict()}
        return JSONResponse({"status": "ok", "model": state.model_name, "audit": audit})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus text exposition."""
        if metrics_exposition is not None:
            return Response((await metrics_exposition()).encode(), media_type=CONTENT_TYPE_LATEST)
        data, content_type = state.metrics.exposition()
        return Response(data, media_type=content_type)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES, dependencies=[Depends(authorized)])
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=ModelCard,
        responses=ERROR_RESPONSES,
        dependencies=[Depends(authorized)],
    )
    async def get_model(model_id: str) -> ModelCard:
        _check_model(state, model_id, param=None)
        return model_card()

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=GENERATE_RESPONSES,
        dependencies=[Depends(authorized)],
    )
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        prompts = protocol.completion_prompts(pipeline, body.prompt)
        header = protocol.ResponseHeader(chat=False, model=body.model, system_fingerprint=state.fingerprint)
        return await _serve(state, request, body, prompts, header)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=GENERATE_RESPONSES,
        dependencies=[Depends(authorized)],
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        prompts = [protocol.chat_prompt_ids(pipeline, body)]
        header = protocol.ResponseHeader(chat=True, model=body.model, system_fingerprint=state.fingerprint)
        return await _serve(state, request, body, prompts, header)

    tokenize.install(app, pipeline, lambda name: _check_model(state, name), [Depends(authorized)])
    app.openapi = _openapi_without_422(app)
    return app


def _engine_problem(state: _State) -> str | None:
    """Why the engine cannot serve now (:attr:`ServerConfig.unhealthy_is_unavailable`), or None."""
    worker = state.worker
    return worker.health_problem() if state.config.unhealthy_is_unavailable else worker.stopped_problem()


def _check_model(state: _State, name: str, param: str | None = "model") -> None:
    if name != state.model_name:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            param=param,
            code="model_not_found",
        )


async def _serve(state: _State, request: Request, body, prompts: list[list[int]], header: protocol.ResponseHeader):
    """Validate, queue every choice (``n`` per prompt), then answer with JSON or SSE. Errors
    before the first token are HTTP errors."""
    if not state.worker.ready.is_set():
        raise APIError(
            503, "the server is still loading the models: retry shortly", type="server_error", code="not_ready"
        )
    problem = _engine_problem(state)
    if problem is not None:
        raise APIError(
            503,
            f"this server cannot generate now ({problem}): retry later",
            type="server_error",
            code="engine_unavailable",
            reason="engine_unavailable",
            retry_after_s=RETRY_AFTER_S,
        )
    structured = protocol.structured_output(body, state.pipeline.tokenizer)
    max_tokens = protocol.max_tokens_of(body, cap=state.config.max_tokens_cap)
    max_tokens = fit_window(state.pipeline, body, prompts, max_tokens, "messages" if header.chat else "prompt")
    params = protocol.sampling_params(
        body,
        max_tokens=max_tokens,
        vocab_size=state.pipeline.target.vocab_size,
        structured=structured,
        default_sampling=state.config.sampling,
    )
    spec = protocol.speculative_config(body.speculative, state.default_spec)
    check_method(state.pipeline, prompts[0], spec)
    loop = asyncio.get_running_loop()
    choices = [
        Choice(
            i * body.n + j,
            i,
            prompt_ids,
            Job(prompt_ids, protocol.choice_params(params, i * body.n + j), spec, loop=loop, request_id=header.id),
        )
        for i, prompt_ids in enumerate(prompts)
        for j in range(body.n)
    ]
    if len(choices) > state.config.max_queue:
        raise APIError(
            400,
            f"n x prompts = {len(choices)} choices exceed this server's queue of {state.config.max_queue}: "
            "send fewer per request",
            param="n",
        )
    submitted = []
    try:
        for choice in choices:
            state.worker.submit(choice.job)
            submitted.append(choice)
    except QueueFullError as exc:
        for choice in submitted:
            choice.job.cancel()
        raise APIError(429, f"{exc}: retry later", type="rate_limit_error", code="queue_full") from None
    state.metrics.in_flight.inc()
    try:
        firsts = [await next_event(choice.job, request) for choice in choices]
    except BaseException:
        state.metrics.in_flight.dec()
        for choice in choices:
            choice.job.cancel()
        raise
    view = ChoiceView(state.token_texts, state.pipeline.tokenizer, body, header)

    def finished() -> None:  # every choice ended without an error: the prompt joins the recorded traffic
        if state.traffic is not None:
            state.traffic.record(
                chat_record(body.messages) if header.chat else completion_records(state.pipeline.tokenizer, prompts)
            )

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            sse(state.metrics, choices, firsts, view, include_usage, on_finished=finished),
            media_type="text/event-stream",
        )
    outputs = []
    try:
        for choice, chunk in zip(choices, firsts):
            while chunk.output is None:
                chunk = await next_event(choice.job, request)
            outputs.append(chunk.output)
    finally:
        state.metrics.in_flight.dec()
        for choice in choices:
            choice.job.cancel()
    finished()
    bodies = [view.choice_body(choice, output) for choice, output in zip(choices, outputs)]
    results = [(c.prompt_index, o.metrics, c.job.queue_s) for c, o in zip(choices, outputs)]
    return JSONResponse(header.body(bodies, protocol.usage(results)))


def _install_error_handlers(app: FastAPI, state: _State) -> None:
    def respond(status: int, body: dict, headers: dict | None = None, reason: str | None = None) -> JSONResponse:
        state.metrics.http_errors.labels(status=str(status)).inc()
        if reason is not None:
            state.metrics.failed.labels(reason=reason).inc()
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
        state.metrics.failed.labels(reason="client_disconnected").inc()
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def server_fault(request: Request, exc: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex[:12]
        log.error("unhandled error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        message = f"internal server error (error id {error_id})"
        return respond(
            500, APIError(500, message, type="server_error", code="server_error").body(), reason="internal_error"
        )


def _openapi_without_422(app: FastAPI):
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
