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
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from verispec.bench.audit import QualityAuditor
from verispec.engine import SpeculativeConfig
from verispec.errors import CacheFileError
from verispec.metrics import peak_rss_bytes
from verispec.models.cache_files import report_damaged
from verispec.proposers.suffix_file import SuffixSnapshots
from verispec.server import logprobs, protocol, tokenize
from verispec.server.config import ServerConfig
from verispec.server.faults import RETRY_AFTER_S, APIError
from verispec.server.handlers import install_error_handlers, openapi_without_422
from verispec.server.limits import BodyLimitMiddleware, check_method, fit_window
from verispec.server.prefix_files import PrefixCacheFiles, check_writable
from verispec.server.prom import ServerMetrics
from verispec.server.responses import Choice, ChoiceView, next_event, sse
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
    snapshots = _suffix_snapshots(pipeline, config)
    prefix_files = PrefixCacheFiles(pipeline, config.prefix_cache_file, config.warm_prompts)
    app = FastAPI(  # strict_content_type=False: a body without Content-Type is read as JSON (curl -d, OpenAI)
        title="verispec",
        version="0.1.0",
        lifespan=_lifespan(state, snapshots, prefix_files),
        summary="OpenAI-compatible lossless speculative decoding",
        strict_content_type=False,
    )
    app.state.verispec = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    install_error_handlers(app, state.metrics)
    authorized = [Depends(_authorization(config))]
    _add_status_routes(app, state, metrics_exposition)
    _add_model_routes(app, state, authorized)
    _add_generation_routes(app, state, authorized)
    tokenize.install(app, pipeline, lambda name: _check_model(state, name), authorized)
    app.openapi = openapi_without_422(app)
    return app


def _suffix_snapshots(pipeline, config: ServerConfig) -> SuffixSnapshots | None:
    """The suffix cache's file (``config.suffix_cache``): read now if it exists (a damaged one is
    said and replaced), snapshotted while serving; None without a file or a suffix cache."""
    cache = pipeline.suffix_cache
    if config.suffix_cache is None or cache is None:
        return None
    check_writable(config.suffix_cache, "suffix cache")
    written = None  # what the file holds: None writes a first snapshot at once
    if os.path.exists(config.suffix_cache):
        try:
            log.info("suffix cache: %d past requests from %s", cache.load(config.suffix_cache), config.suffix_cache)
            written = cache.num_changes
        except CacheFileError as exc:  # ours, damaged: never read; the first snapshot replaces it
            report_damaged(config.suffix_cache, str(exc), "the server starts with an empty suffix cache")
    return SuffixSnapshots(cache, config.suffix_cache, config.suffix_snapshot_s, written)


def _lifespan(state: _State, snapshots: SuffixSnapshots | None, prefix_files: PrefixCacheFiles):
    """The app's lifespan: the models said in the log, the prefix cache's files, the engine
    worker and the suffix snapshots started; at shutdown stopped in the reverse order."""
    pipeline = state.pipeline

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for summary in pipeline.model_summaries():
            size_mib = summary.param_bytes / 2**20
            log.info("%s %s: loaded in %.1f s, %.0f MiB", summary.role, summary.name, summary.load_time_s, size_mib)
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

    return lifespan


def _authorization(config: ServerConfig):
    """The dependency of every ``/v1`` route: the Bearer key, where ``config.api_key`` asks one."""

    async def authorized(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    return authorized


def _add_status_routes(app: FastAPI, state: _State, metrics_exposition) -> None:
    """``/health`` and ``/metrics`` (no key needed)."""

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


def _add_model_routes(app: FastAPI, state: _State, authorized: list) -> None:
    """``/v1/models`` and ``/v1/models/{id}``: the one model this server serves."""

    def model_card() -> ModelCard:
        return ModelCard(id=state.model_name, created=state.created)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES, dependencies=authorized)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES, dependencies=authorized)
    async def get_model(model_id: str) -> ModelCard:
        _check_model(state, model_id, param=None)
        return model_card()


def _add_generation_routes(app: FastAPI, state: _State, authorized: list) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``: the prompts read, then :func:`_serve`."""
    pipeline = state.pipeline

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=GENERATE_RESPONSES,
        dependencies=authorized,
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
        dependencies=authorized,
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        prompts = [protocol.chat_prompt_ids(pipeline, body)]
        header = protocol.ResponseHeader(chat=True, model=body.model, system_fingerprint=state.fingerprint)
        return await _serve(state, request, body, prompts, header)


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
    _check_ready(state)
    choices = _choices(state, body, prompts, header)
    _submit(state, choices)
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
            tokenizer = state.pipeline.tokenizer
            state.traffic.record(chat_record(body.messages) if header.chat else completion_records(tokenizer, prompts))

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            sse(state.metrics, choices, firsts, view, include_usage, on_finished=finished),
            media_type="text/event-stream",
        )
    outputs = await _outputs(state, request, choices, firsts)
    finished()
    bodies = [view.choice_body(choice, output) for choice, output in zip(choices, outputs)]
    results = [(c.prompt_index, o.metrics, c.job.queue_s) for c, o in zip(choices, outputs)]
    return JSONResponse(header.body(bodies, protocol.usage(results)))


def _check_ready(state: _State) -> None:
    """503 while the models load or warm up, and while the engine cannot generate."""
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


def _choices(state: _State, body, prompts: list[list[int]], header: protocol.ResponseHeader) -> list[Choice]:
    """The request's choices (``n`` per prompt), each a job with its own sampling, after its
    parameters are checked against the window, the vocabulary, the loaded drafters and the queue."""
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
    return choices


def _submit(state: _State, choices: list[Choice]) -> None:
    """Queue every choice, or none: 429 (the ones queued cancelled) when the queue is full."""
    submitted = []
    try:
        for choice in choices:
            state.worker.submit(choice.job)
            submitted.append(choice)
    except QueueFullError as exc:
        for choice in submitted:
            choice.job.cancel()
        raise APIError(429, f"{exc}: retry later", type="rate_limit_error", code="queue_full") from None


async def _outputs(state: _State, request: Request, choices: list[Choice], firsts: list) -> list:
    """Every choice's final output (a JSON answer), the request then out of flight."""
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
    return outputs
