"""Translation between the OpenAI wire format and the library: requests in, payloads out.

Owns: OpenAI's error shape (:class:`APIError`), turning a validated request into prompt token
ids, :class:`~verispec.sampling.SamplingParams` and a
:class:`~verispec.engine.SpeculativeConfig` (library errors become 400s), and building
response bodies, stream chunks and usage from a :class:`~verispec.engine.GenerationOutput`.
Knows nothing about routes, queues or threads.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Sequence

from verispec.engine import SpeculativeConfig
from verispec.errors import InvalidParameterError, VerispecError
from verispec.metrics import RequestMetrics
from verispec.sampling import SamplingParams
from verispec.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SpeculativeOptions,
    Usage,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """An error response in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def sampling_params(body: CompletionRequest | ChatCompletionRequest, *, max_tokens: int) -> SamplingParams:
    """SamplingParams of a request. Raises APIError 400 for n != 1 or an out-of-range value."""
    if body.n != 1:
        raise bad_request(f"n = {body.n} is not supported yet: verispec returns one choice per request (n = 1)", "n")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            max_tokens=max_tokens,
            stop=stop,
            seed=body.seed,
        )
    except InvalidParameterError as exc:
        raise bad_request(str(exc)) from None


def max_tokens_of(body: CompletionRequest | ChatCompletionRequest, *, cap: int) -> int:
    """The request's token budget: ``max_completion_tokens``, else ``max_tokens``, else a default.

    The default is 16 for completions (as OpenAI) and ``cap`` for chat. Raises APIError 400
    above ``cap``.
    """
    param, value = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        param, value = "max_completion_tokens", body.max_completion_tokens
    if value is None:
        return cap if isinstance(body, ChatCompletionRequest) else min(DEFAULT_COMPLETION_MAX_TOKENS, cap)
    if value > cap:
        raise bad_request(f"{param} = {value} exceeds this server's limit of {cap}", param)
    return value


def speculative_config(options: SpeculativeOptions | None, default: SpeculativeConfig) -> SpeculativeConfig:
    """The server's default config with the request's ``speculative`` fields applied."""
    if options is None:
        return default
    changes = {k: v for k, v in options.model_dump().items() if v is not None}
    try:
        return dataclasses.replace(default, **changes)
    except InvalidParameterError as exc:
        raise bad_request(str(exc), "speculative") from None


def completion_prompt_ids(pipeline, prompt: str | list[str] | list[int]) -> list[int]:
    """Token ids of a completions ``prompt``: text, a one-element list of text, or token ids.

    Raises APIError 400 for batches, ids outside the vocabulary, or an empty prompt.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise bad_request(
                f"batched prompts ({len(prompt)}) are not supported yet: send one prompt per request", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, list):
        vocab_size = pipeline.target.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        return list(prompt)
    try:
        return pipeline.encode(prompt)
    except VerispecError as exc:
        raise bad_request(str(exc), "prompt") from None


def chat_prompt_ids(pipeline, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of ``messages`` through the target's chat template, ready for the assistant turn."""
    tokenizer = pipeline.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(f"{pipeline.target.name} has no chat template: use /v1/completions", "messages")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as exc:  # jinja raises TemplateError for conversations a template refuses
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
    return list(ids)


def check_context(prompt_token_ids: Sequence[int], context_length: int, param: str) -> None:
    """Raises APIError 400 (context_length_exceeded) unless one token fits after the prompt."""
    if len(prompt_token_ids) >= context_length:
        raise bad_request(
            f"the prompt has {len(prompt_token_ids)} tokens but the model's context window is {context_length}: shorten it",
            param,
            "context_length_exceeded",
        )


def usage(metrics: RequestMetrics, queue_s: float) -> Usage:
    spec = metrics.spec
    return Usage(
        prompt_tokens=metrics.prompt_tokens,
        completion_tokens=metrics.output_tokens,
        total_tokens=metrics.prompt_tokens + metrics.output_tokens,
        num_drafts=spec.num_drafts,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        acceptance_rate=spec.acceptance_rate,
        mean_acceptance_length=spec.mean_acceptance_length,
        ttft_ms=metrics.ttft_ms,
        tpot_ms=metrics.tpot_ms,
        queue_ms=queue_s * 1e3,
    )


@dataclasses.dataclass
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    chat: bool
    model: str
    id: str = ""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def body(self, text: str, finish_reason: str, usage_: Usage) -> dict[str, Any]:
        """The non-streaming response."""
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._frame("chat.completion" if self.chat else "text_completion", [choice], usage_.model_dump())

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict[str, Any]:
        """One streamed chunk; ``text=None`` sends an empty delta (chat's closing chunk)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._frame("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage_: Usage) -> dict[str, Any]:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return self._frame("chat.completion.chunk" if self.chat else "text_completion", [], usage_.model_dump())

    def _frame(self, kind: str, choices: list, usage_: dict | None = None) -> dict[str, Any]:
        frame = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage_ is not None:
            frame["usage"] = usage_
        return frame
