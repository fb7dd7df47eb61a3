"""``verispec serve``: the OpenAI-compatible HTTP server, in this process (uvicorn) or, with any of
the ``--replicas`` family of options, as Ray Serve replicas (:mod:`verispec.cli.replicas`).

The steps: the server's own options checked and made a :class:`~verispec.server.ServerConfig`,
the pipeline's checked (:class:`~verispec.cli.options.PipelineOptions`), both before minutes of
loading; then the replicas launched, or the pipeline loaded and served here until Ctrl-C or SIGTERM."""

from __future__ import annotations

import dataclasses
import errno
import gc
import logging
import signal
import socket
from pathlib import Path
from typing import Annotated, Any

import typer

from verispec.cli.common import (
    DEFAULT_METHOD,
    K_SERVE,
    Dtype,
    EagleHead,
    HeadQuantization,
    MaxContext,
    NumSpeculativeTokens,
    Runner,
    Target,
    draft_option,
    err,
    user_errors,
)
from verispec.cli.options import PipelineOptions, from_params
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import DEFAULT_TARGET
from verispec.engine.prefix_cache import DEFAULT_PREFIX_CACHE_GIB
from verispec.errors import InvalidParameterError, VerispecError

LOG_LEVELS = ("debug", "info", "warning", "error")
LOOPBACK = ("127.0.0.1", "localhost", "::1")

# serve's own options, each declared once (the shared ones are verispec.cli.common's)
Draft = Annotated[
    str | None,
    draft_option(
        "Draft model reference, or 'none' (no draft model: auto then drafts by lookup only; --method none serves "
        "plain decoding)."
    ),
]
Method = Annotated[
    str,
    typer.Option(
        help="Default method of requests without 'speculative': auto (lookup where it matches, else the draft "
        "model; plain steps where a batch makes speculation cost more), draft, none, ... (as generate).",
    ),
]
Schedule = Annotated[
    str, typer.Option(help="Default draft-length schedule: cost (batch-aware cost model), heuristic or constant.")
]
Sampling = Annotated[
    str,
    typer.Option(
        help="Default sampling mode: coupled (a seed gives the same text under every method, batched or "
        'alone) or rejection (modified rejection sampling); requests may send "sampling".',
    ),
]
Host = Annotated[str, typer.Option(help="Address to bind; loopback unless you say otherwise.")]
Port = Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")]
ApiKey = Annotated[
    str | None, typer.Option(envvar="VERISPEC_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1.")
]
MaxQueue = Annotated[int, typer.Option(min=1, help="Requests that may wait for the engine before 429.")]
MaxNumSeqs = Annotated[
    int | None,
    typer.Option(min=1, help="Requests batched into one target pass (default 8; 1 on the llama.cpp runner)."),
]
MaxKvTokens = Annotated[
    int | None,
    typer.Option(min=1, help="KV-cache tokens the running requests may reserve together (default: a context each)."),
]
MaxNumBatchedTokens = Annotated[
    int, typer.Option(min=1, help="Prompt tokens prefilled per pass while other requests decode (chunked prefill).")
]
MaxTokensCap = Annotated[int, typer.Option(min=1, help="Largest max_tokens a request may ask for.")]
SuffixCache = Annotated[
    Path | None,
    typer.Option(
        help="File for the suffix drafter's cache of past requests: loaded at start if present, written atomically "
        "within --suffix-snapshot-seconds of a change and at shutdown.",
    ),
]
SuffixSnapshotSeconds = Annotated[
    float,
    typer.Option(
        help="The longest a change of --suffix-cache waits before it is on disk (what a crash or kill -9 can lose).",
    ),
]
Datastore = Annotated[
    Path | None, typer.Option(help="A corpus datastore (verispec datastore build) the suffix drafter also reads.")
]
RecordTraffic = Annotated[
    Path | None,
    typer.Option(
        help="Append each answered request's prompt (user turns or completion prompt; no answers, no system "
        "messages, no client details) to DIR/traffic-<pid>.jsonl, for verispec train-head --prompts. Off by "
        "default.",
    ),
]
PrefixCacheGib = Annotated[
    float,
    typer.Option(
        min=0.0,
        help="Memory for automatic prefix caching: KV entries of earlier prompts and answers reused bit for bit "
        "(a chat's next turn, a shared system prompt); least recently used blocks evicted. 0 turns it off.",
    ),
]
PrefixCacheFile = Annotated[
    Path | None,
    typer.Option(
        help="Save the prefix cache here at shutdown and read it at start (checksummed; a damaged file, or one "
        "for other weights or kernels, is said and not used).",
    ),
]
WarmPrompt = Annotated[
    list[Path] | None,
    typer.Option(help="A text file prefilled at start as a system prompt, so the first requests find it cached."),
]
MaxBodyBytes = Annotated[int, typer.Option(min=1024, help="Largest request body (bytes).")]
LogLevel = Annotated[str, typer.Option(help="debug, info, warning or error.")]
AuditRate = Annotated[
    float,
    typer.Option(
        help="Fraction of responses re-decoded plainly when the engine is idle, to count agreement (0 = off)."
    ),
]
Replicas = Annotated[
    int | None,
    typer.Option(help="Serve N replicas on Ray Serve, each its own batched engine (needs verispec[ray])."),
]
RayAddress = Annotated[
    str | None,
    typer.Option(help="Join this Ray cluster (e.g. auto or ray://host:10001) instead of starting one."),
]
MinReplicas = Annotated[int | None, typer.Option(help="Autoscale replicas from this many (Ray Serve autoscaling).")]
MaxReplicas = Annotated[int | None, typer.Option(help="Autoscale replicas up to this many.")]
TargetOngoingRequests = Annotated[
    float | None, typer.Option(help="Requests in flight per replica the autoscaler aims at.")
]
RayTempDir = Annotated[
    str | None,
    typer.Option(
        help="Folder a Ray cluster started by --replicas keeps its session files in (default: $VERISPEC_HOME/ray; "
        "at most 40 characters, for Ray's socket paths).",
    ),
]
ReplicaCpus = Annotated[
    float | None,
    typer.Option(
        help="CPUs Ray reserves for each replica, its runners' threads (default: the cores / replicas; 1 on "
        "--ray-address).",
    ),
]


def serve(
    target: Target = DEFAULT_TARGET,
    draft: Draft = None,
    method: Method = DEFAULT_METHOD,
    num_speculative_tokens: NumSpeculativeTokens = K_SERVE,
    schedule: Schedule = "cost",
    sampling: Sampling = "coupled",
    host: Host = "127.0.0.1",
    port: Port = 8000,
    api_key: ApiKey = None,
    dtype: Dtype = "float32",
    runner: Runner = "auto",
    max_context: MaxContext = None,
    max_queue: MaxQueue = 64,
    max_num_seqs: MaxNumSeqs = None,
    max_kv_tokens: MaxKvTokens = None,
    max_num_batched_tokens: MaxNumBatchedTokens = 256,
    max_tokens_cap: MaxTokensCap = 2048,
    suffix_cache: SuffixCache = None,
    suffix_snapshot_seconds: SuffixSnapshotSeconds = 60.0,
    datastore: Datastore = None,
    record_traffic: RecordTraffic = None,
    eagle_head: EagleHead = None,
    head_quantization: HeadQuantization = "auto",
    prefix_cache_gib: PrefixCacheGib = DEFAULT_PREFIX_CACHE_GIB,
    prefix_cache_file: PrefixCacheFile = None,
    warm_prompt: WarmPrompt = None,
    max_body_bytes: MaxBodyBytes = 4 * 1024 * 1024,
    log_level: LogLevel = "info",
    audit_rate: AuditRate = 0.0,
    replicas: Replicas = None,
    ray_address: RayAddress = None,
    min_replicas: MinReplicas = None,
    max_replicas: MaxReplicas = None,
    target_ongoing_requests: TargetOngoingRequests = None,
    ray_temp_dir: RayTempDir = None,
    replica_cpus: ReplicaCpus = None,
) -> None:
    """Serve the models over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    params = dict(locals())
    with user_errors():
        server = server_modules()
        config = server_config(params)
        scaling = from_params(server.ReplicaOptions, params)
        pipeline = PipelineOptions.from_cli(params).check_before_loading(models=scaling.requested)
        if scaling.requested:
            serve_on_replicas(pipeline, config, scaling, host, port)
            return
        app = server.create_app(pipeline.load(), config)
    serve_here(server.uvicorn, app, host, port, log_level)


def server_modules() -> Any:
    """What serving needs beyond the CLI's own imports (uvicorn, FastAPI, the replicas'
    launch), as attributes.

    Raises:
        VerispecError: the server's dependencies are not installed.
    """
    from types import SimpleNamespace

    try:
        import uvicorn

        from verispec.cli.replicas import ReplicaOptions
        from verispec.server import create_app
    except ImportError as exc:
        raise VerispecError(f"the server's dependencies are missing ({exc}): pip install -e .") from None
    return SimpleNamespace(uvicorn=uvicorn, ReplicaOptions=ReplicaOptions, create_app=create_app)


def server_config(params: dict[str, Any]):
    """The server's options (``serve``'s parameters) checked, logging set up, and made a
    :class:`~verispec.server.ServerConfig`.

    Raises:
        InvalidParameterError: a bad log level, an address that cannot be listened on, a traffic
            folder that cannot be written, a non-positive snapshot interval, an audit rate outside
            [0, 1], a missing warm-prompt file, a prefix cache file or warm prompt without a cache.
    """
    from verispec.server import ServerConfig

    p = params
    if p["log_level"].lower() not in LOG_LEVELS:
        raise InvalidParameterError(f"--log-level must be debug, info, warning or error, got {p['log_level']!r}")
    check_listen(p["host"], p["port"])  # before minutes of loading, not uvicorn's error after them
    if p["record_traffic"] is not None:
        from verispec.server.traffic import check_folder

        check_folder(p["record_traffic"])  # before minutes of loading
    if not p["suffix_snapshot_seconds"] > 0:
        raise InvalidParameterError(f"--suffix-snapshot-seconds must be > 0, got {p['suffix_snapshot_seconds']}")
    if not 0.0 <= p["audit_rate"] <= 1.0:
        raise InvalidParameterError(f"--audit-rate must be in [0, 1], got {p['audit_rate']}")
    logging.basicConfig(level=p["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if p["host"] not in LOOPBACK and p["api_key"] is None:
        err.print(
            f"[yellow]warning:[/yellow] serving on {p['host']} without --api-key: anyone who can reach it can use it"
        )
    for path in p["warm_prompt"] or ():  # before minutes of loading
        if not Path(path).is_file():
            raise InvalidParameterError(f"--warm-prompt {path}: no such file (a text file: a system prompt)")
    if p["prefix_cache_gib"] == 0 and (p["prefix_cache_file"] is not None or p["warm_prompt"]):
        raise InvalidParameterError("--prefix-cache-file and --warm-prompt need a prefix cache: --prefix-cache-gib > 0")
    return from_params(
        ServerConfig,
        params,
        default_spec=from_params(SpeculativeConfig, params),
        suffix_cache=_text(p["suffix_cache"]),
        suffix_snapshot_s=p["suffix_snapshot_seconds"],
        record_traffic=_text(p["record_traffic"]),
        prefix_cache_file=_text(p["prefix_cache_file"]),
        warm_prompts=tuple(str(path) for path in p["warm_prompt"] or ()),
    )


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


def serve_on_replicas(pipeline: PipelineOptions, config, scaling, host: str, port: int) -> None:
    """Serve ``pipeline`` (checked) on Ray Serve replicas until SIGTERM, or Ctrl-C (exit 130).
    An EAGLE head is loaded here once against the target first: one clear error, not one per
    replica."""
    from verispec.cli.replicas import serve_replicas
    from verispec.server.replicas import ReplicaSpec

    if pipeline.eagle_head is not None:
        status = (
            f"checking the EAGLE head {pipeline.eagle_head} against {pipeline.target} (before starting the replicas)"
        )
        checked = dataclasses.replace(pipeline, draft_model=None, datastore=None).load(status=status)
        del checked
        gc.collect()
    spec = ReplicaSpec(
        pipeline.target,
        pipeline.draft_model,
        pipeline.dtype,
        pipeline.runner,
        config,
        pipeline.max_num_batched_tokens,
        drafters=pipeline.drafters(),
        max_context=pipeline.max_context,
        prefix_cache_gib=pipeline.prefix_cache_gib,
    )
    if serve_replicas(spec, scaling, host=host, port=port) == signal.SIGINT:
        raise typer.Exit(130)  # 128 + SIGINT, as a shell expects; SIGTERM: a clean stop, 0


def serve_here(uvicorn, app, host: str, port: int, log_level: str) -> None:
    """Run ``app`` on uvicorn in this process until Ctrl-C (then exit 130) or SIGTERM."""
    interrupted: list[int] = []

    def on_sigint(signum, frame) -> None:  # uvicorn re-raises a Ctrl-C here after its graceful shutdown
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level.lower())  # swallows that KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise typer.Exit(130)  # 128 + SIGINT, as a shell expects, not 0


def check_listen(host: str, port: int) -> None:
    """Bind ``host``:``port`` once and let it go, as uvicorn (and Ray Serve's proxy) will bind it.

    Raises:
        InvalidParameterError: the address is in use, is not one of this machine's, or needs
            privileges this process lacks.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise InvalidParameterError(f"--host {host}: not an address to listen on ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            sock.bind(address)
        except OSError as exc:
            why = {
                errno.EADDRINUSE: "the port is in use: stop what listens there or choose another --port",
                errno.EADDRNOTAVAIL: "the address is not one of this machine's: choose another --host",
                errno.EACCES: "ports below 1024 need privileges: choose another --port",
            }.get(exc.errno, exc.strerror)
            raise InvalidParameterError(f"cannot listen on {host}:{port}: {why}") from None
