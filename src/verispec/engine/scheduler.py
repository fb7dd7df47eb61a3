"""Continuous batching: which requests share the engine's next target pass.

Owns admission (first come, first served: at most ``max_num_seqs`` running, each holding a
reservation of KV-cache tokens out of a budget; the head of the queue waits until both fit),
the pool of sequence slots (made on first need and reused; a slot goes back to the pool without
its request's KV pages, so memory follows the requests running, not the longest ones ever run),
cancellation (the slot is free at once), prompt sharing (a request admitted while another one
with the same prompt runs, as the ``n`` choices of one API request are, copies that one's prompt
cache instead of prefilling it again) and one step over the running requests. The step itself
is the engine's one generate loop (:meth:`verispec.engine.SpeculativeEngine.step`). Knows
nothing about HTTP, threads or text.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verispec.algorithms.sampling import SamplingParams
from verispec.engine.loop import SpeculativeEngine
from verispec.engine.request import SpeculativeConfig, StreamChunk
from verispec.engine.state import RequestState, Slot
from verispec.errors import InvalidParameterError

DEFAULT_MAX_NUM_SEQS = 8


@dataclass
class ScheduledRequest:
    """One request in the scheduler. ``tag``: the caller's handle (the server's job).

    ``kv_tokens``: cache positions reserved for it (prompt + output + one draft), held from
    admission to the end. ``state``: the engine's request state once admitted, else None.
    ``prompt_source``: a running request with the same prompt whose cache this one copies once
    that one has prefilled it (:meth:`Scheduler.step`); None: it prefills its own.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    spec: SpeculativeConfig
    kv_tokens: int
    tag: Any = None
    state: RequestState | None = None
    slot: Slot | None = field(default=None, repr=False)
    done: bool = False  # finished, cancelled or failed: out of the scheduler
    prompt_source: ScheduledRequest | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        """Admitted and not yet done."""
        return self.state is not None and not self.done


class Scheduler:
    """Runs many requests through one engine, one batched target pass per :meth:`step`.

    Args:
        engine: the engine; its own sequence slot is the first of the pool.
        max_num_seqs: requests running at once (vLLM's ``--max-num-seqs``).
        max_kv_tokens: KV-cache positions the running requests may reserve together;
            None: ``max_num_seqs`` full context windows.
    Raises:
        InvalidParameterError: ``max_num_seqs`` < 1, > 1 on an engine that cannot batch
            (:attr:`SpeculativeEngine.supports_batching`), or a budget below one context window.
    """

    def __init__(
        self, engine: SpeculativeEngine, *, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_kv_tokens: int | None = None
    ) -> None:
        if max_num_seqs < 1:
            raise InvalidParameterError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_seqs > 1 and not engine.supports_batching:
            raise InvalidParameterError(
                f"the {type(engine.target).__name__} (or a drafter) holds one sequence: use --max-num-seqs 1 "
                "or the gguf, int8 or torch runner"
            )
        context = engine.target.max_context_length
        budget = max_num_seqs * context if max_kv_tokens is None else max_kv_tokens
        if budget < context:
            raise InvalidParameterError(
                f"max_kv_tokens {budget} is below one context window ({context} tokens): a long request could never run"
            )
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.max_kv_tokens = budget
        self.waiting: deque[ScheduledRequest] = deque()
        self.running: list[ScheduledRequest] = []
        self.last_admitted: list[ScheduledRequest] = []  # started by the last step
        self.failed: list[tuple[ScheduledRequest, Exception]] = []  # refused by engine.start; the caller empties it
        self._free_slots: list[Slot] = [engine.slot]
        self._num_slots = 1
        self._reserved = 0

    @property
    def num_free_seqs(self) -> int:
        """Requests that could start now if the KV budget allows (running slots not in use)."""
        return self.max_num_seqs - len(self.running) - len(self.waiting)

    @property
    def reserved_kv_tokens(self) -> int:
        return self._reserved

    def add(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, spec: SpeculativeConfig, tag: Any = None
    ) -> ScheduledRequest:
        """Queue a request; it starts at a later :meth:`step` when a slot and its KV tokens are free.

        Raises (before queueing anything):
            InvalidParameterError, ContextLengthError: :meth:`SpeculativeEngine.check_request`.
        What only starting can refuse (a grammar that does not compile) lands in :attr:`failed`.
        """
        prompt = [int(t) for t in prompt_token_ids]
        self.engine.check_request(prompt, spec)
        context = self.engine.target.max_context_length
        kv_tokens = min(context, len(prompt) + params.max_tokens + spec.num_speculative_tokens + 1)
        request = ScheduledRequest(prompt, params, spec, kv_tokens, tag)
        self.waiting.append(request)
        return request

    def cancel(self, request: ScheduledRequest) -> None:
        """Drop ``request`` at once: out of the queue, or its slot and KV tokens freed."""
        if request in self.waiting:
            self.waiting.remove(request)
            request.done = True
        elif request in self.running:
            self.engine.end(request.state)  # the prefix cache keeps what it computed
            self._release(request)

    def step(self) -> list[tuple[ScheduledRequest, StreamChunk]]:
        """Admit what fits, run one target pass over the running requests, retire the finished.

        Returns the chunks that pass committed, per request (a finished request's last chunk
        carries its output). An exception from the engine leaves every running request in
        :attr:`running`; :meth:`fail_running` then frees them.
        """
        self.admit()
        self._copy_shared_prompts()
        running = [r for r in self.running if r.prompt_source is None]  # the others wait for their source
        if not running:
            return []
        chunks = self.engine.step([r.state for r in running])
        events = []
        for request, chunk in zip(running, chunks):
            if chunk is not None:
                events.append((request, chunk))
            if request.state.finished:
                self._release(request)
        return events

    def fail_running(self) -> list[ScheduledRequest]:
        """Free every running request (after an engine error); returns them."""
        failed = list(self.running)
        for request in failed:
            self.engine.end(request.state, failed=True)
            self._release(request)
        return failed

    def admit(self) -> list[ScheduledRequest]:
        """Start the queued requests that fit now, in order (:meth:`step` does it first too);
        returns them (also kept as :attr:`last_admitted`). A request the engine refuses to
        start goes to :attr:`failed` with its exception (the caller takes them from there)."""
        self.last_admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            if self._reserved + head.kv_tokens > self.max_kv_tokens:
                break  # first come, first served: later requests wait behind the head
            self.waiting.popleft()
            head.slot = self._take_slot()
            try:
                head.state = self.engine.start(head.prompt_token_ids, head.params, head.spec, head.slot)
            except Exception as exc:  # that request fails; the others go on
                self._free_slots.append(head.slot)
                head.done = True
                self.failed.append((head, exc))
                continue
            self._reserved += head.kv_tokens
            head.prompt_source = self._prompt_source(head)
            self.running.append(head)
            self.last_admitted.append(head)
        return self.last_admitted

    def _prompt_source(self, request: ScheduledRequest) -> ScheduledRequest | None:
        """The running request whose cache ``request`` can copy its prompt from: the same prompt,
        prefilling or prefilled by itself, the furthest along; None when there is none or either
        cannot share (:func:`_shares_prompt`)."""
        if not _shares_prompt(request):
            return None
        sources = [
            r
            for r in self.running
            if r.prompt_source is None and r.prompt_token_ids == request.prompt_token_ids and _shares_prompt(r)
        ]
        return max(sources, key=lambda r: r.state.num_prefilled, default=None)

    def _copy_shared_prompts(self) -> None:
        """Each request waiting for its prompt source: once the source's cache holds all of the
        prompt but its last token, copy those entries (the request then prefills that one token:
        its own first logits); a source that ended first leaves it to prefill its own prompt."""
        for request in self.running:
            source = request.prompt_source
            if source is None:
                continue
            shared = len(request.prompt_token_ids) - 1
            if source.done:
                request.prompt_source = None
            elif source.state.num_prefilled >= shared:
                request.slot.target.copy_prefix(source.slot.target, shared)
                request.state.num_prefilled = shared
                request.prompt_source = None

    def _take_slot(self) -> Slot:
        if self._free_slots:
            return self._free_slots.pop()
        self._num_slots += 1
        return self.engine.new_slot()

    def _release(self, request: ScheduledRequest) -> None:
        request.done = True
        self.running.remove(request)
        self._reserved -= request.kv_tokens
        request.slot.release()  # back in the pool without the request's KV pages (Slot.release)
        self._free_slots.append(request.slot)


def _shares_prompt(request: ScheduledRequest) -> bool:
    """Whether the request's prompt cache may be copied to or from another sequence: a runner
    with ``copy_prefix``, a prompt of 2 tokens or more, no prompt logprobs (every prompt row's
    logits are needed then) and no drafter reading the target's features of the prompt (an
    EAGLE head would restart from the copied position, drafting worse for a while)."""
    return (
        len(request.prompt_token_ids) >= 2
        and request.params.prompt_logprobs is None
        and request.slot.target.shares_prompts
        and not request.slot.feature_readers
    )
