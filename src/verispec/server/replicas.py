"""The OpenAI app served by Ray Serve replicas (``verispec serve --replicas N``).

Owns what a replica loads (:class:`ReplicaSpec`), the deployment's scaling options
(:class:`ScalingOptions`: a fixed count or Ray Serve's autoscaling, passed through), the replica
id header on every response, ``/metrics`` merged over all replicas, the health check that lets
Ray restart a replica whose engine died (an unhealthy replica answers 503 meanwhile), and
starting / stopping it all, with :class:`verispec.server.faults.FaultLayer` in every Ray proxy
(a dead replica's requests get 503 + OpenAI's error JSON + ``Retry-After``, its streams an error
event, instead of Ray's text 500 or a cut). Ray Serve's proxy and
router spread the requests; each replica is one process owning one batched engine and the same
app :func:`verispec.server.create_app` builds for one machine. Knows nothing about decoding;
the command line's launch (checks before Ray starts) is :mod:`verispec.cli.replicas`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from verispec.engine.loader import DrafterOptions
from verispec.engine.prefix_cache import DEFAULT_PREFIX_CACHE_GIB
from verispec.errors import InvalidParameterError, VerispecError
from verispec.server.app import ServerConfig
from verispec.server.faults import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from verispec.server.prom import merge_expositions
from verispec.server.ray_session import serve_until_stopped

log = logging.getLogger("verispec.server")

RAY_MISSING = "serving replicas needs Ray Serve: pip install 'verispec[ray]' (the 'ray[serve]' package)"
REPLICA_HEADER = "x-verispec-replica"
SUFFIX_CACHE_REFUSED = "--suffix-cache is one file per process: it cannot be used with --replicas"
PREFIX_CACHE_FILE_REFUSED = "--prefix-cache-file is one file per process: it cannot be used with --replicas"
APP_NAME = "verispec"
DEPLOYMENT_NAME = "VerispecReplica"
WARM_UP_WAIT_S = 600.0  # longest a replica's startup waits for its engine's warm-up


class RayMissingError(VerispecError):
    """Ray Serve is not installed (the ``ray`` extra)."""


class ReplicasFailedError(VerispecError):
    """The replicas did not start (for example a model a replica cannot load)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads and serves: the CLI's model and server flags, picklable.

    Attributes:
        target, draft: model references as the CLI takes them (draft None: plain decoding).
        dtype, runner: as :meth:`verispec.engine.loader.SpeculativePipeline.load`.
        config: the server options of each replica (:class:`ServerConfig`; its ``suffix_cache``
            must be None: replicas would overwrite one file).
        max_num_batched_tokens: chunked-prefill tokens per pass (the engine's).
        drafters: how every replica builds its drafters (:class:`verispec.engine.loader.DrafterOptions`:
            the CLI's; an EAGLE head file or folder and a datastore as absolute paths, since
            replicas start in other processes).
        max_context: the context window in tokens (``--max-context``; None: the runner's default).
        prefix_cache_gib: each replica's own prefix cache (``--prefix-cache-gib``).
    Raises:
        InvalidParameterError: a suffix cache file or a prefix cache file with replicas.
    """

    target: str
    draft: str | None = None
    dtype: str = "float32"
    runner: str = "auto"
    config: ServerConfig = field(default_factory=ServerConfig)
    max_num_batched_tokens: int = 256
    drafters: DrafterOptions = field(default_factory=DrafterOptions)
    max_context: int | None = None
    prefix_cache_gib: float = DEFAULT_PREFIX_CACHE_GIB

    def __post_init__(self) -> None:
        if self.config.suffix_cache is not None:
            raise InvalidParameterError(SUFFIX_CACHE_REFUSED)
        if self.config.prefix_cache_file is not None:
            raise InvalidParameterError(PREFIX_CACHE_FILE_REFUSED)


@dataclass(frozen=True)
class ScalingOptions:
    """How many replicas: ``num_replicas`` fixed, or Ray Serve autoscaling between
    ``min_replicas`` and ``max_replicas`` aiming at ``target_ongoing_requests`` per replica.

    Attributes:
        num_replicas: replicas when not autoscaling, >= 1.
        min_replicas, max_replicas: autoscaling bounds (either one set turns autoscaling on;
            min defaults to ``num_replicas``, max to the larger of the two); 0 <= min <= max,
            max >= 1.
        target_ongoing_requests: requests in flight per replica the autoscaler aims at (> 0;
            only with autoscaling); None: Ray Serve's default.
        num_cpus: CPUs Ray reserves for each replica (> 0); the replica's runners use that
            many threads (Ray sets ``OMP_NUM_THREADS`` from it).
        max_ongoing_requests: requests Ray sends one replica at a time (its batch plus its
            queue); further ones wait in Ray's proxy for a free replica.
    Raises:
        InvalidParameterError: a bound or count out of range.
    """

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    num_cpus: float = 1.0
    max_ongoing_requests: int = 72

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise InvalidParameterError(f"--replicas must be >= 1, got {self.num_replicas}")
        low, high = self.bounds
        if (self.autoscaling and not 0 <= low <= high) or high < 1:
            raise InvalidParameterError(
                f"autoscaling needs 0 <= min replicas <= max replicas and max >= 1, got {low} and {high} "
                "(--min-replicas defaults to --replicas)"
            )
        if self.target_ongoing_requests is not None and not self.autoscaling:
            raise InvalidParameterError(
                "--target-ongoing-requests steers autoscaling: give --min-replicas / --max-replicas too"
            )
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise InvalidParameterError(f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}")
        if not (self.num_cpus > 0 and math.isfinite(self.num_cpus)):
            raise InvalidParameterError(f"--replica-cpus must be > 0, got {self.num_cpus}")
        if self.max_ongoing_requests < 1:
            raise InvalidParameterError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas: both ``num_replicas`` without autoscaling."""
        low = self.num_replicas if self.min_replicas is None else self.min_replicas
        high = max(self.num_replicas, low) if self.max_replicas is None else self.max_replicas
        return (low, high) if self.autoscaling else (self.num_replicas, self.num_replicas)

    def deployment_options(self) -> dict:
        """Keyword arguments of ``ray.serve.deployment``."""
        options: dict = {
            "ray_actor_options": {"num_cpus": self.num_cpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": 2.0,
            "health_check_timeout_s": 30.0,
        }
        if self.autoscaling:
            low, high = self.bounds
            autoscaling = {
                "min_replicas": low,
                "max_replicas": high,
                "initial_replicas": max(low, min(self.num_replicas, high)),
            }
            if self.target_ongoing_requests is not None:
                autoscaling["target_ongoing_requests"] = self.target_ongoing_requests
            options["autoscaling_config"] = autoscaling
        else:
            options["num_replicas"] = self.num_replicas
        return options


def import_serve():
    """``ray`` and ``ray.serve``; raises :class:`RayMissingError` saying how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise RayMissingError(f"{RAY_MISSING} ({exc})") from None
    return ray, serve


class ReplicaHeader:
    """ASGI middleware: ``x-verispec-replica: <id>`` on every HTTP response (streams included),
    and a client that left is an ``http.disconnect`` message: Ray Serve's ``receive`` raises
    ``TaskCancelledError`` instead when its proxy cancels the request, which the app took for its
    own fault (a logged traceback and a 500 counted as ``internal_error`` per hang-up)."""

    def __init__(self, app, replica_id: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())
        try:
            from ray.exceptions import TaskCancelledError

            self.cancelled: tuple = (TaskCancelledError,)
        except ImportError:
            self.cancelled = ()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        async def receive_or_disconnect():
            try:
                return await receive()
            except self.cancelled:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, tagged)


def replica_app(spec: ReplicaSpec, replica_id: str, merged_metrics=None):
    """The FastAPI app of one replica: ``spec``'s models loaded, :func:`create_app`'s routes
    (503 with ``Retry-After`` while the engine is unhealthy: Ray replaces it),
    ``x-verispec-replica: replica_id`` on every response, and ``/metrics`` from
    ``merged_metrics`` (an async callable returning the exposition text) when given.

    Raises what :meth:`SpeculativePipeline.load` and :func:`create_app` raise.
    """
    from verispec.engine.loader import SpeculativePipeline
    from verispec.runners.select import RunnerOptions
    from verispec.server.app import create_app

    pipe = SpeculativePipeline.load(
        spec.target,
        spec.draft,
        dtype=spec.dtype,
        runners=RunnerOptions(kind=spec.runner, max_context_length=spec.max_context),
        max_num_batched_tokens=spec.max_num_batched_tokens,
        drafters=spec.drafters,
        prefix_cache_gib=spec.prefix_cache_gib,
    )
    config = dataclasses.replace(spec.config, unhealthy_is_unavailable=True)
    app = create_app(pipe, config, metrics_exposition=merged_metrics)
    app.add_middleware(ReplicaHeader, replica_id=replica_id)
    return startup_waits_for_warm_up(app)


def startup_waits_for_warm_up(app, timeout_s: float = WARM_UP_WAIT_S):
    """``app`` (from :func:`create_app`) whose lifespan startup ends only once its engine's warm-up
    is done (or ``timeout_s`` passed). Ray Serve routes requests to a replica as soon as its
    startup ends: a replica restarted after a crash otherwise answered its first requests 503
    not_ready while it warmed up (the fault soak with --replicas 2). Returns ``app``."""
    original = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(application):
        async with original(application) as value:
            await asyncio.to_thread(app.state.verispec.worker.ready.wait, timeout_s)
            yield value

    app.router.lifespan_context = lifespan
    return app


class ReplicaBase:
    """The replica class Ray Serve runs (one actor per replica); ``serve.ingress`` adds the app."""

    def metrics_text(self) -> str:
        """This replica's own Prometheus exposition (merged by whichever replica serves /metrics)."""
        return _own_exposition(self.app)

    def check_health(self) -> None:
        """Ray Serve's periodic health check: raising makes Ray replace this replica (its engine
        thread ended, its warm-up failed, its passes keep failing, or one hangs:
        :meth:`EngineWorker.health_problem`)."""
        problem = self.app.state.verispec.worker.health_problem()
        if problem is not None:
            raise RuntimeError(f"replica unhealthy: {problem}")


def _own_exposition(app) -> str:
    """The Prometheus text of the one replica whose app is ``app``."""
    return app.state.verispec.metrics.exposition()[0].decode()


def build_deployment(spec: ReplicaSpec, scaling: ScalingOptions):
    """The Ray Serve application: :class:`ReplicaBase` replicas, each serving
    :func:`replica_app`. Raises :class:`RayMissingError` without Ray Serve."""
    _, serve = import_serve()

    def build():  # runs in each replica's process, when Ray starts it
        context = serve.get_replica_context()
        replica_id = context.replica_id.unique_id
        own: list = []

        async def merged_metrics() -> str:
            handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=context.app_name)
            try:
                results = await handle.broadcast("metrics_text").results_async(timeout_s=10, return_exceptions=True)
            except Exception as exc:  # a replica too slow to answer, or the deployment unavailable
                log.warning("/metrics: could not reach every replica (%s); serving this replica's alone", exc)
                results = [_own_exposition(own[0])]
            return merge_expositions([r for r in results if isinstance(r, str)])  # a failing replica is left out

        own.append(replica_app(spec, replica_id, merged_metrics))
        return own[0]

    cls = serve.ingress(build)(ReplicaBase)
    return serve.deployment(cls, name=DEPLOYMENT_NAME, **scaling.deployment_options()).bind()


def run_replicas(
    spec: ReplicaSpec,
    scaling: ScalingOptions,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ray_address: str | None = None,
    ray_temp_dir: str | None = None,
    blocking: bool = True,
):
    """Start (or join, with ``ray_address``) a Ray cluster, deploy the replicas behind one HTTP
    endpoint at ``host:port`` and, with ``blocking``, serve until SIGTERM or SIGINT, then shut Serve
    down, and Ray where this call started it (:mod:`verispec.server.ray_session`), and return the
    signal's number. Returns the ingress handle when not blocking. ``ray_temp_dir``: where a local
    cluster keeps its files (:func:`~verispec.server.ray_session.ray_temp_dir`; None: Ray's
    default). Ray's HTTP proxies run :class:`~verispec.server.faults.FaultLayer` (set through the
    Serve controller's environment, which its proxies inherit; a Serve instance already running in
    the cluster keeps its own).

    Raises:
        RayMissingError: Ray Serve is not installed.
        ReplicasFailedError: the replicas did not start (the replica's own error in the message).
    """
    ray, serve = import_serve()
    started_ray = _start_ray(ray, scaling, ray_address, ray_temp_dir)
    serve.start(
        http_options={"host": host, "port": port},
        controller_options={"runtime_env": {"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK}}},
    )
    try:
        handle = serve.run(build_deployment(spec, scaling), name=APP_NAME, route_prefix="/")
    except Exception as exc:  # a replica that cannot load: Ray wraps the error
        serve.shutdown()
        raise ReplicasFailedError(f"the replicas did not start: {_first_line(exc)}") from None
    low, high = scaling.bounds
    log.info(
        "serving %s on http://%s:%d with %s replicas", APP_NAME, host, port, low if low == high else f"{low}-{high}"
    )
    if not blocking:
        return handle
    return serve_until_stopped(ray, serve, started_ray)


def _start_ray(ray, scaling: ScalingOptions, ray_address: str | None, ray_temp_dir: str | None) -> bool:
    """Start Ray here, or join ``ray_address``, unless this process already did; returns whether
    this call started it. Raises ReplicasFailedError: a local cluster too small for the replicas."""
    started_ray = not ray.is_initialized()
    if started_ray:
        if ray_address:
            ray.init(address=ray_address, logging_level=logging.WARNING)
        else:
            where = {} if ray_temp_dir is None else {"_temp_dir": ray_temp_dir}
            ray.init(include_dashboard=False, logging_level=logging.WARNING, **where)
    if not ray_address:  # a local cluster cannot grow: replicas that do not fit would wait forever
        total = ray.cluster_resources().get("CPU", 0.0)
        need = scaling.bounds[0] * scaling.num_cpus
        if need > total + 1e-9:
            raise ReplicasFailedError(
                f"{scaling.bounds[0]} replicas x {scaling.num_cpus:g} CPUs need {need:g} CPUs but this machine's Ray "
                f"cluster has {total:g}: lower --replicas or --replica-cpus"
            )
    return started_ray


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in reversed(text.splitlines()):  # Ray's message ends with the replica's own error
        if "Error:" in line or "error:" in line:
            return line.strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = [
    "RAY_MISSING",
    "REPLICA_HEADER",
    "RayMissingError",
    "ReplicaSpec",
    "ReplicasFailedError",
    "ScalingOptions",
    "build_deployment",
    "import_serve",
    "merge_expositions",
    "replica_app",
    "run_replicas",
]
