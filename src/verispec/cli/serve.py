"""``verispec serve``: the OpenAI-compatible HTTP server, in this process (uvicorn) or, with any of
the ``--replicas`` family of options, as Ray Serve replicas (:mod:`verispec.cli.replicas`)."""

from __future__ import annotations

import errno
import gc
import logging
import signal
import socket
from pathlib import Path

import typer

from verispec.cli.common import (
    DEFAULT_METHOD,
    K_SERVE,
    draft_option,
    dtype_option,
    eagle_head_option,
    err,
    head_quantization_option,
    max_context_option,
    num_speculative_tokens_option,
    resolve_draft,
    runner_option,
    target_option,
    user_errors,
)
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import DrafterOptions, SpeculativePipeline
from verispec.engine.prefix_cache import DEFAULT_PREFIX_CACHE_GIB
from verispec.errors import InvalidParameterError, VerispecError
from verispec.models.preflight import check_before_loading
from verispec.runners.select import RunnerOptions

LOG_LEVELS = ("debug", "info", "warning", "error")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    target: str = target_option(),
    draft: str | None = draft_option(
        "Draft model reference, or 'none' (no draft model: auto then drafts by lookup only; --method none serves "
        "plain decoding)."
    ),
    method: str = typer.Option(
        DEFAULT_METHOD,
        help="Default method of requests without 'speculative': auto (lookup where it matches, else the draft "
        "model; plain steps where a batch makes speculation cost more), draft, none, ... (as generate).",
    ),
    num_speculative_tokens: int = num_speculative_tokens_option(K_SERVE),
    schedule: str = typer.Option(
        "cost", help="Default draft-length schedule: cost (batch-aware cost model), heuristic or constant."
    ),
    sampling: str = typer.Option(
        "coupled",
        help="Default sampling mode: coupled (a seed gives the same text under every method, batched or "
        'alone) or rejection (modified rejection sampling); requests may send "sampling".',
    ),
    host: str = typer.Option("127.0.0.1", help="Address to bind; loopback unless you say otherwise."),
    port: int = typer.Option(8000, min=1, max=65535, help="TCP port."),
    api_key: str | None = typer.Option(
        None, envvar="VERISPEC_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1."
    ),
    dtype: str = dtype_option(),
    runner: str = runner_option(),
    max_context: int | None = max_context_option(),
    max_queue: int = typer.Option(64, min=1, help="Requests that may wait for the engine before 429."),
    max_num_seqs: int | None = typer.Option(
        None, min=1, help="Requests batched into one target pass (default 8; 1 on the llama.cpp runner)."
    ),
    max_kv_tokens: int | None = typer.Option(
        None, min=1, help="KV-cache tokens the running requests may reserve together (default: a context each)."
    ),
    max_num_batched_tokens: int = typer.Option(
        256, min=1, help="Prompt tokens prefilled per pass while other requests decode (chunked prefill)."
    ),
    max_tokens_cap: int = typer.Option(2048, min=1, help="Largest max_tokens a request may ask for."),
    suffix_cache: Path | None = typer.Option(
        None,
        help="File for the suffix drafter's cache of past requests: loaded at start if present, written atomically "
        "within --suffix-snapshot-seconds of a change and at shutdown.",
    ),
    suffix_snapshot_seconds: float = typer.Option(
        60.0,
        help="The longest a change of --suffix-cache waits before it is on disk (what a crash or kill -9 can lose).",
    ),
    datastore: Path | None = typer.Option(
        None, help="A corpus datastore (verispec datastore build) the suffix drafter also reads."
    ),
    record_traffic: Path | None = typer.Option(
        None,
        help="Append each answered request's prompt (user turns or completion prompt; no answers, no system "
        "messages, no client details) to DIR/traffic-<pid>.jsonl, for verispec train-head --prompts. Off by "
        "default.",
    ),
    eagle_head: Path | None = eagle_head_option(),
    head_quantization: str = head_quantization_option(),
    prefix_cache_gib: float = typer.Option(
        DEFAULT_PREFIX_CACHE_GIB,
        min=0.0,
        help="Memory for automatic prefix caching: KV entries of earlier prompts and answers reused bit for bit "
        "(a chat's next turn, a shared system prompt); least recently used blocks evicted. 0 turns it off.",
    ),
    prefix_cache_file: Path | None = typer.Option(
        None,
        help="Save the prefix cache here at shutdown and read it at start (checksummed; a damaged file, or one "
        "for other weights or kernels, is said and not used).",
    ),
    warm_prompt: list[Path] | None = typer.Option(
        None, help="A text file prefilled at start as a system prompt, so the first requests find it cached."
    ),
    max_body_bytes: int = typer.Option(4 * 1024 * 1024, min=1024, help="Largest request body (bytes)."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    audit_rate: float = typer.Option(
        0.0, help="Fraction of responses re-decoded plainly when the engine is idle, to count agreement (0 = off)."
    ),
    replicas: int | None = typer.Option(
        None, help="Serve N replicas on Ray Serve, each its own batched engine (needs verispec[ray])."
    ),
    ray_address: str | None = typer.Option(
        None, help="Join this Ray cluster (e.g. auto or ray://host:10001) instead of starting one."
    ),
    min_replicas: int | None = typer.Option(None, help="Autoscale replicas from this many (Ray Serve autoscaling)."),
    max_replicas: int | None = typer.Option(None, help="Autoscale replicas up to this many."),
    target_ongoing_requests: float | None = typer.Option(
        None, help="Requests in flight per replica the autoscaler aims at."
    ),
    ray_temp_dir: str | None = typer.Option(
        None,
        help="Folder a Ray cluster started by --replicas keeps its session files in (default: $VERISPEC_HOME/ray; "
        "at most 40 characters, for Ray's socket paths).",
    ),
    replica_cpus: float | None = typer.Option(
        None,
        help="CPUs Ray reserves for each replica, its runners' threads (default: the cores / replicas; 1 on "
        "--ray-address).",
    ),
) -> None:
    """Serve the models over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    with user_errors():
        try:
            import uvicorn

            from verispec.cli.replicas import ReplicaOptions, serve_replicas
            from verispec.server import ServerConfig, create_app
            from verispec.server.replicas import ReplicaSpec
        except ImportError as exc:
            raise VerispecError(f"the server's dependencies are missing ({exc}): pip install -e .") from None
        if log_level.lower() not in LOG_LEVELS:
            raise InvalidParameterError(f"--log-level must be debug, info, warning or error, got {log_level!r}")
        check_listen(host, port)  # before minutes of loading, not uvicorn's error after them
        if record_traffic is not None:
            from verispec.server.traffic import check_folder

            check_folder(record_traffic)  # before minutes of loading
        if not suffix_snapshot_seconds > 0:
            raise InvalidParameterError(f"--suffix-snapshot-seconds must be > 0, got {suffix_snapshot_seconds}")
        if not 0.0 <= audit_rate <= 1.0:
            raise InvalidParameterError(f"--audit-rate must be in [0, 1], got {audit_rate}")
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        draft_ref = resolve_draft(target, draft)
        if host not in LOOPBACK and api_key is None:
            err.print(
                f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone who can reach it can use it"
            )
        spec = SpeculativeConfig(
            method=method,
            num_speculative_tokens=num_speculative_tokens,
            schedule=schedule,
        )
        config = ServerConfig(
            api_key=api_key,
            max_tokens_cap=max_tokens_cap,
            max_queue=max_queue,
            max_body_bytes=max_body_bytes,
            default_spec=spec,
            audit_rate=audit_rate,
            max_num_seqs=max_num_seqs,
            max_kv_tokens=max_kv_tokens,
            suffix_cache=None if suffix_cache is None else str(suffix_cache),
            suffix_snapshot_s=suffix_snapshot_seconds,
            record_traffic=None if record_traffic is None else str(record_traffic),
            sampling=sampling,
            prefix_cache_file=None if prefix_cache_file is None else str(prefix_cache_file),
            warm_prompts=tuple(str(p) for p in warm_prompt or ()),
        )
        for path in config.warm_prompts:  # before minutes of loading
            if not Path(path).is_file():
                raise InvalidParameterError(f"--warm-prompt {path}: no such file (a text file: a system prompt)")
        if prefix_cache_gib == 0 and (prefix_cache_file is not None or config.warm_prompts):
            raise InvalidParameterError(
                "--prefix-cache-file and --warm-prompt need a prefix cache: --prefix-cache-gib > 0"
            )
        scaling = ReplicaOptions(
            replicas, ray_address, min_replicas, max_replicas, target_ongoing_requests, replica_cpus, ray_temp_dir
        )
        if spec.method in ("eagle", "eagle-tree") and eagle_head is None:
            raise InvalidParameterError(
                f"--method {spec.method} needs --eagle-head FILE (a head from verispec train-head) or a published "
                "EAGLE-3 folder"
            )
        if eagle_head is not None and not eagle_head.exists():
            raise InvalidParameterError(
                f"--eagle-head {eagle_head}: no such file or folder (a head from verispec train-head, or a published "
                "EAGLE-3 folder)"
            )
        DrafterOptions(
            eagle_head=eagle_head, head_quantization=head_quantization
        )  # its checks, before minutes of loading
        if scaling.requested:  # load() checks these itself; replicas would each fail after starting
            check_before_loading(target, draft_ref)
        if scaling.requested and eagle_head is not None:
            with err.status(f"checking the EAGLE head {eagle_head} against {target} (before starting the replicas)"):
                checked = (
                    SpeculativePipeline.load(  # the same checks a replica runs: one clear error here, not N in Ray
                        target,
                        None,
                        dtype=dtype,
                        runners=RunnerOptions(kind=runner, max_context_length=max_context),
                        max_num_batched_tokens=max_num_batched_tokens,
                        drafters=DrafterOptions(eagle_head=eagle_head, head_quantization=head_quantization),
                    )
                )
                del checked
                gc.collect()
        if scaling.requested:
            models = ReplicaSpec(
                target,
                draft_ref,
                dtype,
                runner,
                config,
                max_num_batched_tokens,
                None if datastore is None else str(datastore),
                None if eagle_head is None else str(eagle_head.resolve()),
                head_quantization,
                max_context,
                prefix_cache_gib,
            )
            stopped_by = serve_replicas(models, scaling, host=host, port=port)
            if stopped_by == signal.SIGINT:
                raise typer.Exit(130)  # 128 + SIGINT, as a shell expects; SIGTERM: a clean stop, 0
            return
        with err.status(f"loading {target}" + (f" + {draft_ref}" if draft_ref else "")):
            pipe = SpeculativePipeline.load(
                target,
                draft_ref,
                dtype=dtype,
                runners=RunnerOptions(kind=runner, max_context_length=max_context),
                max_num_batched_tokens=max_num_batched_tokens,
                drafters=DrafterOptions(
                    eagle_head=eagle_head, head_quantization=head_quantization, datastore=datastore
                ),
                prefix_cache_gib=prefix_cache_gib,
            )
        server = create_app(pipe, config)
    interrupted: list[int] = []

    def on_sigint(signum, frame) -> None:  # uvicorn re-raises a Ctrl-C here after its graceful shutdown
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        uvicorn.run(server, host=host, port=port, log_level=log_level.lower())  # swallows that KeyboardInterrupt
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
