"""The engine worker: one thread owns the engine and runs every admitted request in batched passes.

HTTP handlers put a :class:`Job` in a bounded FIFO queue (full -> :class:`QueueFullError`, a
429) and read the job's events from an asyncio queue that this thread fills through the event
loop. Each turn the thread moves queued jobs into the :class:`verispec.engine.scheduler.Scheduler`
while it has free sequences (continuous batching: a new request joins at the next pass), drops
jobs whose client went away (a queued job is skipped, a running one's slot is freed at once),
and runs one target pass over all running requests. On a batch-invariant runner a request's
output is the output it would get alone. Quality audits (plain re-decodes of delivered
responses, :mod:`verispec.bench.audit`) run here too, one at a time and only while no request runs or
waits, so they never delay the response they audit. Knows nothing about HTTP or JSON.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from verispec.algorithms.sampling import SamplingParams
from verispec.bench.audit import QualityAuditor
from verispec.engine import SpeculativeConfig, SpeculativeEngine, StreamChunk
from verispec.engine.scheduler import ScheduledRequest, Scheduler
from verispec.errors import VerispecError
from verispec.runners.cpu.gguf_weights import release_freed_memory
from verispec.runners.openmp import release_thread_pool
from verispec.server.prom import ServerMetrics

log = logging.getLogger("verispec.server")
WARMUP_TOKENS = 4
MAX_CONSECUTIVE_ERRORS = 3  # failed passes in a row after which the engine reports itself broken
# Seconds between two hand-backs of the C heap's free pages (glibc malloc_trim, ~4 ms after a
# 40000-token prompt was tokenized, ~0.1 ms when there is nothing to give). Without them the
# transient buffers of a large request (the tokenizer's: +45 MiB for a 40000-token prompt) stay
# resident for good: glibc keeps free chunks inside the heap, and after the loader's large frees
# it trims the heap's top only beyond 64 MiB.
HEAP_TRIM_EVERY_S = 10.0


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
    scheduled: ScheduledRequest | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the job: skipped if still queued, its slot freed before the next pass if running."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class EngineWorker:
    """The thread that runs :class:`Job` s on ``engine``, batched, admitted in arrival order.

    Args:
        engine: the engine it owns from :meth:`start` on; nothing else may call it.
        max_queue: jobs that may wait (running ones not counted) before submit refuses.
        metrics: where answered requests (request_success) and every pass are counted; a request
            that dies is counted once, by the HTTP layer, in requests_failed (:mod:`~verispec.server.prom`).
        warmup_prompt_token_ids, warmup_spec: one short greedy generation run before ready.
        auditor: offered every delivered output (it draws which to audit); its pending audits
            run on ``engine`` while nothing runs or waits, one per idle turn. None: no audits.
        max_num_seqs: requests in one pass; None: 8 where the engine can batch, else 1.
        max_kv_tokens: KV-cache positions the running requests may reserve together
            (:class:`verispec.engine.scheduler.Scheduler`); None: ``max_num_seqs`` context windows.
        heap_trim_every_s: the engine thread hands the C heap's free pages back to the OS
            (:func:`verispec.runners.cpu.gguf_weights.release_freed_memory`) at most this often,
            between passes: the freed buffers of any thread's large requests do not stay resident.
    Raises:
        InvalidParameterError: ``max_num_seqs`` > 1 on an engine that cannot batch, or an
            impossible budget.
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
        max_num_seqs: int | None = None,
        max_kv_tokens: int | None = None,
        heap_trim_every_s: float = HEAP_TRIM_EVERY_S,
    ) -> None:
        self.engine = engine
        self.heap_trim_every_s = heap_trim_every_s
        self.last_heap_trim = time.monotonic()
        self.heap_trims = 0
        self.auditor = auditor
        self.metrics = metrics
        if max_num_seqs is None:
            max_num_seqs = 8 if engine.supports_batching else 1
        self.scheduler = Scheduler(engine, max_num_seqs=max_num_seqs, max_kv_tokens=max_kv_tokens)
        self.ready = threading.Event()
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stopping = threading.Event()
        self._warmup = (list(warmup_prompt_token_ids), warmup_spec)
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self.warmup_failed = False
        self.consecutive_errors = 0  # passes (or loop turns) in a row that raised, with no good pass between
        self._pass_outcome: str | None = None  # of the current turn: "ok", "failed" or None (no pass)
        self.last_turn_end = time.monotonic()

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    def health_problem(self, stall_s: float = 120.0) -> str | None:
        """Why this engine cannot serve (for a supervisor that replaces it, e.g. Ray Serve's
        health check), or None: :meth:`stopped_problem`, its warm-up failed, or its last
        ``MAX_CONSECUTIVE_ERRORS`` passes failed with no good one between."""
        problem = self.stopped_problem(stall_s)
        if problem is not None:
            return problem
        if self.warmup_failed:
            return "the engine's warm-up failed"
        if self.consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
            return f"the engine's last {self.consecutive_errors} passes failed"
        return None

    def stopped_problem(self, stall_s: float = 120.0) -> str | None:
        """Why no request can be answered now whatever it asks, or None: the engine thread
        ended, or no turn ended for ``stall_s`` seconds while requests run or wait (a hung pass;
        a whole long prompt is one pass when its request runs alone, so ``stall_s`` must exceed
        the longest prefill)."""
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping.is_set():
            return "the engine thread ended"
        busy = self._jobs.qsize() > 0 or self.scheduler.running or self.scheduler.waiting
        if self.ready.is_set() and busy and time.monotonic() - self.last_turn_end > stall_s:
            return f"no engine turn ended in {stall_s:.0f} s while requests wait"
        return None

    def start(self) -> None:
        """Start the engine thread (call it on the thread that loaded the models: that thread's
        OpenMP pool is released so the engine thread's passes get the cores, see
        :mod:`verispec.runners.openmp`)."""
        release_thread_pool()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the current pass: running and queued jobs are cancelled; end the thread."""
        self._stopping.set()
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
            try:
                self._pass_outcome = None
                self._turn()
                if self._pass_outcome == "failed":
                    self.consecutive_errors += 1
                elif self._pass_outcome == "ok":  # idle turns change nothing: only a good pass resets
                    self.consecutive_errors = 0
            except Exception:  # never let the engine thread die: fail what runs, go on
                self.consecutive_errors += 1
                error_id = uuid.uuid4().hex[:12]
                log.exception("engine loop error (error id %s)", error_id)
                for request in self.scheduler.fail_running():
                    _emit(
                        request.tag, JobFailed("the server failed to generate", client_error=False, error_id=error_id)
                    )
            finally:
                self.last_turn_end = time.monotonic()
                if self.last_turn_end - self.last_heap_trim >= self.heap_trim_every_s:
                    self._trim_heap()
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.cancel(request)

    def _trim_heap(self) -> None:
        try:
            release_freed_memory()
        except Exception:  # only memory is at stake, never a request
            log.exception("handing the heap's free pages back failed")
        self.heap_trims += 1
        self.last_heap_trim = time.monotonic()

    def _turn(self) -> None:
        self._admit()
        self._drop_cancelled()
        scheduler = self.scheduler
        self.metrics.running.set(len(scheduler.running))
        if scheduler.running or scheduler.waiting:
            self._step()
        elif not self._audit():
            self._admit(wait_s=0.1)

    def _report_failed_starts(self) -> None:
        """Requests the engine refused to start (:attr:`Scheduler.failed`): each gets its error."""
        for request, exc in self.scheduler.failed:
            self.metrics.waiting.dec()
            client = isinstance(exc, VerispecError)
            error_id = None if client else uuid.uuid4().hex[:12]
            if not client:
                log.error("a request failed to start (error id %s)", error_id, exc_info=exc)
            message = str(exc) if client else "the server failed to start the request"
            _emit(request.tag, JobFailed(message, client_error=client, error_id=error_id))
        self.scheduler.failed.clear()

    def _admit(self, wait_s: float = 0.0) -> None:
        """Move queued jobs into the scheduler while it has free sequences (the first one waited
        for up to ``wait_s``). The waiting gauge counts a job from submit until it runs."""
        while self.scheduler.num_free_seqs > 0:
            try:
                job = self._jobs.get(timeout=wait_s) if wait_s > 0 else self._jobs.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            if job.cancelled:
                self.metrics.waiting.dec()
                continue
            try:
                job.scheduled = self.scheduler.add(job.prompt_token_ids, job.params, job.spec, tag=job)
            except VerispecError as exc:
                self.metrics.waiting.dec()
                _emit(job, JobFailed(str(exc), client_error=True))

    def _drop_cancelled(self) -> None:
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            if request.tag.cancelled:
                if not request.running:
                    self.metrics.waiting.dec()
                self.scheduler.cancel(request)

    def _audit(self) -> bool:
        """Nothing runs or waits: run one pending audit; False when there is none."""
        if self.auditor is None or not self.auditor.num_pending:
            return False
        try:
            self.auditor.run_pending(self.engine, max_audits=1)
        except Exception:  # counted as failed by the auditor; serving goes on
            log.exception("quality audit failed")
        finally:
            self.engine.slot.release()
        return True

    def _step(self) -> None:
        scheduler = self.scheduler
        self._count_admitted(scheduler.admit())  # before the pass: the gauges say what it runs
        self._report_failed_starts()
        self.metrics.running.set(len(scheduler.running))
        prefilling = sum(r.state.prefilling for r in scheduler.running)
        start = time.perf_counter()
        try:
            events = scheduler.step()
        except Exception:
            self._pass_outcome = "failed"
            error_id = uuid.uuid4().hex[:12]
            log.exception("generation failed (error id %s)", error_id)
            for request in scheduler.fail_running():
                _emit(request.tag, JobFailed("the server failed to generate", client_error=False, error_id=error_id))
            return
        self._pass_outcome = "ok"
        self._report_failed_starts()  # admitted by step() itself
        self.metrics.observe_pass(self.engine.last_pass_num_seqs, self.engine.last_pass_rows)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step: %d running (%d prefilling), %d waiting, pass of %d rows over %d sequences, %d chunks, %.3f s",
                len(scheduler.running) + sum(r.done for r, _ in events),
                prefilling,
                len(scheduler.waiting),
                self.engine.last_pass_rows,
                self.engine.last_pass_num_seqs,
                len(events),
                time.perf_counter() - start,
            )
        for request, chunk in events:
            job = request.tag
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

    def _count_admitted(self, admitted: list[ScheduledRequest]) -> None:
        """Requests that just started: no longer waiting; their queue time."""
        for request in admitted:
            self.metrics.waiting.dec()
            request.tag.queue_s = request.state.times.start - request.tag.arrival_s

    def _warm_up(self) -> None:
        prompt, spec = self._warmup
        start = time.perf_counter()
        try:
            self.engine.generate(prompt, SamplingParams(max_tokens=WARMUP_TOKENS), spec, learn=False)
        except Exception:  # a broken engine must still answer /health and requests with errors
            self.warmup_failed = True
            log.exception("warm-up failed; requests will report the error")
        finally:
            self.engine.slot.release()
        log.info(
            "warm-up done in %.2f s; ready (up to %d requests per pass)", time.perf_counter() - start, self.max_num_seqs
        )
        self.ready.set()


def _emit(job: Job, event: StreamChunk | JobFailed) -> None:
    try:
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)
    except RuntimeError:  # the event loop is closed: the server is shutting down
        job.cancel()
