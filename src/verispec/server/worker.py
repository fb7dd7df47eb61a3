"""The engine worker: one thread owns the engine and runs requests one at a time, first come first served.

The engine has one KV cache per runner, so generation is serialized here: HTTP handlers put a
:class:`Job` in a bounded FIFO queue (full -> :class:`QueueFullError`, a 429) and read the
job's events from an asyncio queue that this thread fills through the event loop. A job whose
client went away is skipped if still queued, or its ``engine.stream`` generator is closed
between verify steps and the target's KV cache emptied. Quality audits (plain re-decodes of
delivered responses, :mod:`verispec.audit`) run here too, one at a time and only while no job
waits, so they never delay the response they audit and a new request waits at most for the one
audit already running. Knows nothing about HTTP or JSON.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from verispec.audit import QualityAuditor
from verispec.engine import SpeculativeConfig, SpeculativeEngine, StreamChunk
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams
from verispec.server.prom import ServerMetrics

log = logging.getLogger("verispec.server")
WARMUP_TOKENS = 4


class QueueFullError(Exception):
    """The request queue holds ``max_queue`` jobs already."""


@dataclass
class JobFailed:
    """Event: the job ended with an error. ``client_error``: a VerispecError (a 400)."""

    message: str
    client_error: bool
    error_id: str | None = None


@dataclass
class Job:
    """One request for the engine and the channel its events come back on.

    Events put on ``events``: :class:`StreamChunk` (the last one carries ``output``) or one
    :class:`JobFailed`. ``arrival_s`` and ``queue_s`` are ``time.perf_counter`` seconds.
    ``request_id``: the response's id, recorded with an audit disagreement.
    """

    prompt_token_ids: Sequence[int]
    params: SamplingParams
    spec: SpeculativeConfig
    loop: asyncio.AbstractEventLoop
    request_id: str = ""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival_s: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the job: skipped if still queued, stopped after the current verify step if running."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class EngineWorker:
    """The thread that runs :class:`Job` s on ``engine`` in arrival order.

    Args:
        engine: the engine it owns from :meth:`start` on; nothing else may call it.
        max_queue: jobs that may wait (the running one not counted) before submit refuses.
        metrics: where finished, aborted and failed requests are counted.
        warmup_prompt_token_ids, warmup_spec: one short greedy generation run before ready.
        auditor: offered every delivered output (it draws which to audit); its pending audits
            run on ``engine`` while the job queue is empty, one per idle turn. None: no audits.
    """

    def __init__(
        self,
        engine: SpeculativeEngine,
        *,
        max_queue: int,
        metrics: ServerMetrics,
        warmup_prompt_token_ids: Sequence[int],
        warmup_spec: SpeculativeConfig,
        auditor: QualityAuditor | None = None,
    ) -> None:
        self.engine = engine
        self.auditor = auditor
        self.metrics = metrics
        self.ready = threading.Event()
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stopping = threading.Event()
        self._current: Job | None = None
        self._warmup = (list(warmup_prompt_token_ids), warmup_spec)
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the running job after its current step, drop the queue, and end the thread."""
        self._stopping.set()
        current = self._current
        if current is not None:
            current.cancel()
        while True:
            try:
                self._jobs.get_nowait().cancel()
            except queue.Empty:
                break
        self._thread.join(timeout_s)

    def submit(self, job: Job) -> None:
        """Queue ``job``. Raises QueueFullError when ``max_queue`` jobs are waiting."""
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFullError(f"the request queue is full ({self._jobs.maxsize} waiting)") from None
        self.metrics.waiting.inc()

    def _run(self) -> None:
        self._warm_up()
        while not self._stopping.is_set():
            job = self._next_job()
            if job is None:
                continue
            self.metrics.waiting.dec()
            if job.cancelled:
                self.metrics.observe_ended("abort")
                continue
            self._current = job
            try:
                self._execute(job)
            finally:
                self._current = None
                self.engine.target.truncate(0)  # free the KV cache between requests

    def _next_job(self) -> Job | None:
        """A waiting job if there is one; else run one pending audit (None), else wait 0.1 s for a job."""
        try:
            return self._jobs.get_nowait()
        except queue.Empty:
            pass
        if self.auditor is not None and self.auditor.num_pending:
            try:
                self.auditor.run_pending(self.engine, max_audits=1)
            except Exception:  # counted as failed by the auditor; serving goes on
                log.exception("quality audit failed")
            finally:
                self.engine.target.truncate(0)
            return None
        try:
            return self._jobs.get(timeout=0.1)
        except queue.Empty:
            return None

    def _warm_up(self) -> None:
        prompt, spec = self._warmup
        start = time.perf_counter()
        try:
            self.engine.generate(prompt, SamplingParams(max_tokens=WARMUP_TOKENS), spec)
        except Exception:  # a broken engine must still answer /health and requests with errors
            log.exception("warm-up failed; requests will report the error")
        finally:
            self.engine.target.truncate(0)
        log.info("warm-up done in %.2f s; ready", time.perf_counter() - start)
        self.ready.set()

    def _execute(self, job: Job) -> None:
        job.queue_s = time.perf_counter() - job.arrival_s
        stream = self.engine.stream(job.prompt_token_ids, job.params, job.spec)
        try:
            for chunk in stream:
                if job.cancelled:
                    self.metrics.observe_ended("abort")
                    return
                if chunk.output is not None:
                    self.metrics.observe_finished(
                        chunk.output.metrics,
                        chunk.output.finish_reason,
                        queue_s=job.queue_s,
                        e2e_s=time.perf_counter() - job.arrival_s,
                    )
                _emit(job, chunk)
                if chunk.output is not None and self.auditor is not None:  # delivered: audit later
                    self.auditor.submit(job.prompt_token_ids, job.params, chunk.output, request_id=job.request_id)
        except VerispecError as exc:
            _emit(job, JobFailed(str(exc), client_error=True))
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("generation failed (error id %s)", error_id)
            self.metrics.observe_ended("error")
            _emit(job, JobFailed("the server failed to generate", client_error=False, error_id=error_id))
        finally:
            stream.close()


def _emit(job: Job, event: StreamChunk | JobFailed) -> None:
    try:
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)
    except RuntimeError:  # the event loop is closed: the server is shutting down
        job.cancel()
