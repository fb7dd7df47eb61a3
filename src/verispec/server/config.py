"""The server's options (:class:`ServerConfig`: the CLI's ``serve`` flags), apart from the app
that reads them (:mod:`verispec.server.app`) so replicas can carry them without importing it."""

from __future__ import annotations

import dataclasses

from verispec.engine import SpeculativeConfig
from verispec.proposers.suffix_file import SNAPSHOT_INTERVAL_S


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Server options (the CLI's ``serve`` flags).

    Attributes:
        api_key: when set, every /v1 route needs ``Authorization: Bearer <api_key>``.
        max_tokens_cap: largest ``max_tokens`` a request may ask for (chat's default).
        max_queue: requests that may wait for the engine before 429.
        max_body_bytes: request bodies above this are refused with 413.
        default_spec: speculation of requests that send no ``speculative`` field.
        model_name: the name clients send as ``model`` (default: the target's name).
        audit_rate: fraction of delivered responses re-decoded plainly in idle time, in [0, 1]
            (:mod:`verispec.bench.audit`); counts in ``/metrics`` and ``/health``.
        max_num_seqs: requests batched into one target pass (continuous batching); None: 8
            where the runners can hold several sequences, else 1.
        max_kv_tokens: KV-cache positions the running requests may reserve together; a
            request that does not fit waits (:class:`verispec.engine.scheduler.Scheduler`).
        suffix_cache: a file holding the suffix drafter's cache of past requests: loaded at
            start when it exists (a damaged one is said on stderr and ignored), snapshotted
            atomically at most ``suffix_snapshot_s`` after it changed and at shutdown
            (:class:`verispec.proposers.suffix_file.SuffixSnapshots`).
        suffix_snapshot_s: seconds a change of the suffix cache may wait before it is on disk.
        record_traffic: a folder where every answered request's prompt is appended as training
            JSONL for ``train-head --prompts`` (:mod:`verispec.server.traffic`); None: nothing kept.
        unhealthy_is_unavailable: requests get 503 (``Retry-After``) and ``/health`` 503 as soon
            as the engine reports any health problem (:meth:`EngineWorker.health_problem`:
            replicas, which Ray replaces); False: only while it cannot run at all
            (:meth:`EngineWorker.stopped_problem`), other failures being each request's 500.
        sampling: the sampling mode of requests that name none (``"coupled"``: a seed gives the
            same text under every method, batched or alone; ``"rejection"``), see
            :class:`verispec.algorithms.sampling.SamplingParams`.
        prefix_cache_file: a file the prefix cache is saved to at shutdown and read from at start
            (:mod:`verispec.engine.prefix_file`; a damaged one, or one written for other weights or
            kernels, is said once and not used); None: the cache starts empty.
        warm_prompts: text files prefilled at start (each a system prompt, through the chat
            template), so the first requests that share them find them cached.
    """

    api_key: str | None = None
    max_tokens_cap: int = 2048
    max_queue: int = 64
    max_body_bytes: int = 4 * 1024 * 1024
    default_spec: SpeculativeConfig | None = None
    model_name: str | None = None
    audit_rate: float = 0.0
    max_num_seqs: int | None = None
    max_kv_tokens: int | None = None
    suffix_cache: str | None = None
    suffix_snapshot_s: float = SNAPSHOT_INTERVAL_S
    record_traffic: str | None = None
    unhealthy_is_unavailable: bool = False
    sampling: str = "coupled"
    prefix_cache_file: str | None = None
    warm_prompts: tuple[str, ...] = ()
