"""Shaping one response's choices: non-streaming bodies and Server-Sent Events.

Owns: the choices of a request (``n`` per prompt, each with its job), what a choice shows (echo,
logprobs in the endpoint's shape, parsed tool calls), the merged event stream of several jobs,
and reading a job's next event (a failed job becomes an :class:`APIError`, a client that left
:class:`ClientGone`). A stream that a fault cuts (the engine failing, a bug here) ends with an
error event then ``[DONE]``, counted in ``/metrics`` by reason, as is a client that leaves it.
Knows nothing about routes or decoding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import Request

from verispec.engine import StreamChunk
from verispec.server import logprobs, protocol, tools
from verispec.server.faults import DONE_EVENT, APIError, error_event
from verispec.server.prom import ServerMetrics
from verispec.server.worker import Job, JobFailed

log = logging.getLogger("verispec.server")
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The client disconnected while its request was queued or generating."""


@dataclasses.dataclass
class Choice:
    """One choice of a response: its index, which prompt it continues, its job."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    job: Job


class ChoiceView:
    """How one response shows its choices: echo, logprobs in the endpoint's shape, tool calls."""

    def __init__(self, texts: logprobs.TokenText, tokenizer, body, header: protocol.ResponseHeader) -> None:
        self.texts = texts
        self.tokenizer = tokenizer
        self.header = header
        self.echo = bool(getattr(body, "echo", False))
        self.tools = body.tools if header.chat and body.tools and body.tool_choice != "none" else None

    def prompt_text(self, choice: Choice) -> str:
        return self.tokenizer.decode(choice.prompt_ids, skip_special_tokens=False) if self.echo else ""

    def logprobs(self, choice: Choice, token_ids, entries, prefix: bytes = b"", prompt_entries=None):
        """The ``logprobs`` of ``token_ids`` (``entries``: theirs; None: not asked for);
        ``prompt_entries``: echo's prompt tokens after the first, shown before them."""
        if entries is None:
            return None
        if self.header.chat:
            return logprobs.chat_logprobs(self.texts, entries)
        if prompt_entries is not None and self.echo:
            token_ids, entries = (
                list(choice.prompt_ids) + list(token_ids),
                [None] + list(prompt_entries) + list(entries),
            )
        return logprobs.completion_logprobs(self.texts, entries, token_ids, prefix)

    def choice_body(self, choice: Choice, output) -> dict:
        text, finish_reason, calls = output.text, output.finish_reason, None
        if self.tools is not None:
            text, calls = tools.parse_tool_calls(text, self.tools)
            finish_reason = "tool_calls" if calls else finish_reason
        entries = self.logprobs(choice, output.token_ids, output.logprobs, prompt_entries=output.prompt_logprobs or [])
        if not self.header.chat:
            text = self.prompt_text(choice) + text
        return self.header.choice(choice.index, text, finish_reason, entries, calls)


async def sse(
    metrics: ServerMetrics,
    choices: list[Choice],
    firsts: list[StreamChunk],
    view: ChoiceView,
    include_usage: bool,
    on_finished: Callable[[], None] | None = None,
) -> AsyncIterator[str]:
    """Server-Sent Events: text deltas as accepted (each with its choice's index), a finish chunk
    per choice, usage if asked, ``[DONE]``; ``on_finished`` is called once every choice finished
    without an error (before ``[DONE]``). With tools, a choice's text streams as content until it
    may be a call (:class:`~verispec.server.tool_parser.ToolCallStream`); the rest is sent when it
    ends, as content and ``tool_calls``. A fault once the stream started (a failed job,
    any exception here) sends an error event in OpenAI's shape, then ``[DONE]``. A client that
    disconnects cancels this generator (counted ``client_disconnected``); ``finally`` then
    cancels the jobs.
    """
    header = view.header
    held = {choice.index: tools.ToolCallStream(view.tools) for choice in choices} if view.tools is not None else {}
    shown = {choice.index: b"" for choice in choices}  # bytes of each choice's text so far (offsets)
    results = []
    try:
        for opening in _opening_frames(view, choices, firsts, shown):
            yield opening
        async for choice, chunk in merged_events(choices, firsts):
            entries = view.logprobs(choice, chunk.token_ids, chunk.logprobs, shown[choice.index])
            if not header.chat and chunk.logprobs is not None:
                shown[choice.index] += logprobs.token_bytes(view.texts, chunk.token_ids)
            text = held[choice.index].feed(chunk.text) if view.tools is not None else chunk.text
            if text or entries:
                yield frame(header.chunk(text, index=choice.index, logprobs=entries))
            if chunk.output is not None:
                for closing in _finish_frames(view, choice, chunk.output, held.get(choice.index)):
                    yield closing
                results.append((choice.prompt_index, chunk.output.metrics, choice.job.queue_s))
        if include_usage:
            yield frame(header.usage_chunk(protocol.usage(results)))
        if on_finished is not None:
            on_finished()
    except APIError as exc:  # the response has started: the error travels as an event
        yield _failed(metrics, exc)
    except (asyncio.CancelledError, GeneratorExit):  # the client left (or the server stops)
        metrics.failed.labels(reason="client_disconnected").inc()
        raise
    except Exception as exc:  # a bug while shaping the stream: still an error event, never a cut
        error_id = uuid.uuid4().hex[:12]
        log.error("stream failed (error id %s)", error_id, exc_info=exc)
        yield _failed(
            metrics,
            APIError(
                500,
                f"internal server error (error id {error_id})",
                type="server_error",
                code="server_error",
                reason="internal_error",
            ),
        )
    finally:
        metrics.in_flight.dec()
        for choice in choices:
            choice.job.cancel()
    yield DONE_EVENT


def _opening_frames(view: ChoiceView, choices: list[Choice], firsts: list[StreamChunk], shown: dict) -> Iterator[str]:
    """The stream's first events: each chat choice's role, or each echoed prompt (with its
    logprobs where asked; ``shown`` then holds its bytes)."""
    header = view.header
    if header.chat:
        for choice in choices:
            yield frame(header.chunk("", role=True, index=choice.index))
    elif view.echo:
        for choice, first in zip(choices, firsts):
            text = view.prompt_text(choice)
            shown[choice.index] = text.encode("utf-8")
            prompt = first.prompt_logprobs if first.output is None else first.output.prompt_logprobs
            entries = None
            if prompt is not None:  # echo with logprobs: the prompt's tokens, the first one null
                entries = logprobs.completion_logprobs(view.texts, [None] + list(prompt), choice.prompt_ids)
            yield frame(header.chunk(text, index=choice.index, logprobs=entries))


def _finish_frames(view: ChoiceView, choice: Choice, output, held) -> Iterator[str]:
    """A choice's last events: with tools, the text held back and its calls; then its finish."""
    header, finish_reason = view.header, output.finish_reason
    if held is not None:
        content, calls = held.finish()
        finish_reason = "tool_calls" if calls else finish_reason
        if content:
            yield frame(header.chunk(content, index=choice.index))
        if calls:
            yield frame(header.chunk(None, index=choice.index, tool_calls=calls))
    yield frame(header.chunk(None if header.chat else "", finish_reason, index=choice.index))


def _failed(metrics: ServerMetrics, error: APIError) -> str:
    """Count ``error`` (its status, its reason) and return its event."""
    metrics.http_errors.labels(status=str(error.status)).inc()
    if error.reason is not None:
        metrics.failed.labels(reason=error.reason).inc()
    return error_event(error)


async def merged_events(choices: list[Choice], firsts: list[StreamChunk]):
    """``(choice, chunk)`` of every job as they come (each job's own chunks in order)."""
    getters = {}
    try:
        for choice, first in zip(choices, firsts):
            yield choice, first
            if first.output is None:
                getters[asyncio.ensure_future(next_event(choice.job, None))] = choice
        while getters:
            done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
            for getter in done:
                choice = getters.pop(getter)
                chunk = getter.result()
                yield choice, chunk
                if chunk.output is None:
                    getters[asyncio.ensure_future(next_event(choice.job, None))] = choice
    finally:
        for getter in getters:
            getter.cancel()


def frame(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def next_event(job: Job, request: Request | None) -> StreamChunk:
    """The job's next chunk. Raises APIError for a failed job, ClientGone if ``request`` disconnected."""
    getter = asyncio.ensure_future(job.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            if request is not None and _poll_due(request) and await request.is_disconnected():
                raise ClientGone()  # checked every DISCONNECT_POLL_S even while chunks keep coming
            if done:
                break
    finally:
        getter.cancel()
    event = getter.result()
    if isinstance(event, JobFailed):
        if event.client_error:
            raise APIError(400, event.message)
        raise APIError(
            500,
            f"{event.message} (error id {event.error_id})",
            type="server_error",
            code="server_error",
            reason="worker_error",
        )
    return event


def _poll_due(request: Request) -> bool:
    """Whether ``DISCONNECT_POLL_S`` passed since this request's connection was last checked."""
    now = time.monotonic()
    if now - getattr(request.state, "disconnect_polled_s", 0.0) < DISCONNECT_POLL_S:
        return False
    request.state.disconnect_polled_s = now
    return True
