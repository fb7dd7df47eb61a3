"""Translation between the OpenAI wire format and the library: requests in, payloads out.

Owns: turning a validated request into prompt token
ids, :class:`~verispec.algorithms.sampling.SamplingParams` and a
:class:`~verispec.engine.SpeculativeConfig` (library errors become 400s), and building
response bodies, stream chunks and usage from a :class:`~verispec.engine.GenerationOutput`.
OpenAI's error shape, :class:`APIError`, is :mod:`verispec.server.faults`' (re-exported here).
Knows nothing about routes, queues or threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.constraints import StructuredOutput
from verispec.errors import InvalidParameterError, VerispecError
from verispec.metrics import RequestMetrics, acceptance_rate, mean_acceptance_length
from verispec.models.conversation import ConversationError, conversation_ids
from verispec.server import tools
from verispec.server.faults import APIError
from verispec.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    SpeculativeOptions,
    Usage,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    vocab_size: int,
    structured: StructuredOutput | None = None,
    default_sampling: str = "coupled",
) -> SamplingParams:
    """SamplingParams of a request (``structured``: its grammar, :func:`structured_output`;
    ``default_sampling``: the mode of a request that names none, the server's ``--sampling``).

    Raises APIError 400 for a ``logit_bias`` id outside the vocabulary or an out-of-range value.
    """
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    bias = {int(token): value for token, value in (body.logit_bias or {}).items()}  # keys checked: ASCII digits
    bad = [t for t in bias if t >= vocab_size]
    if bad:
        raise bad_request(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "logit_bias")
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
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
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_output=structured,
            sampling=body.sampling or default_sampling,
        )
    except InvalidParameterError as exc:
        raise bad_request(str(exc)) from None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: its own generator, seeded ``seed + index`` when seeded
    (modulo 2**64, within the seeds a generator takes: ``2**64 - 1`` then 0)."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index) % 2**64
    return dataclasses.replace(params, seed=seed)


def structured_output(body: CompletionRequest | ChatCompletionRequest, tokenizer=None) -> StructuredOutput | None:
    """The grammar ``response_format`` (or, in chat, a forced ``tool_choice``) asks for
    (``tokenizer``: the target's, which a forced call's grammar needs for its tag tokens).

    Raises APIError 400 for a format without its schema, regex or grammar, or one that does not
    compile (checked without a tokenizer; the engine checks again with it).
    """
    fmt = body.response_format
    param = "response_format"
    if isinstance(body, ChatCompletionRequest) and body.tool_choice not in (None, "none", "auto") and not body.tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if isinstance(body, ChatCompletionRequest) and body.tools:
        names = [t.function.name for t in body.tools]
        if len(set(names)) != len(names):
            raise bad_request("tools has two functions of the same name", "tools")
    forced = isinstance(body, ChatCompletionRequest) and body.tools and body.tool_choice not in (None, "none", "auto")
    if forced:
        if fmt is not None and fmt.type != "text":
            raise bad_request("response_format cannot be combined with a forced tool_choice", "response_format")
        name = None if body.tool_choice == "required" else body.tool_choice.function.name
        if name is not None and name not in {t.function.name for t in body.tools}:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        output, param = tools.forced_call_grammar(body.tools, name, tokenizer), "tools"
    elif fmt is None or fmt.type == "text":
        return None
    else:
        try:
            if fmt.type == "json_object":
                output = StructuredOutput("json_object")
            elif fmt.type == "json_schema":
                if fmt.json_schema is None:
                    raise bad_request("response_format json_schema needs its json_schema", "response_format")
                output = StructuredOutput.json_schema(fmt.json_schema.schema_)
            else:
                text = getattr(fmt, fmt.type)
                if not text:
                    raise bad_request(f"response_format {fmt.type} needs its {fmt.type} text", "response_format")
                output = StructuredOutput(fmt.type, text)
        except InvalidParameterError as exc:
            raise bad_request(str(exc), "response_format") from None
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(output.grammar())
    except (ValueError, RecursionError) as exc:  # e.g. a schema nested beyond the compiler's limit
        error = str(exc)
    if error and not error.startswith("WARNING"):
        raise bad_request(f"the {output.kind} does not compile: {error}", param)
    return output


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


def completion_prompts(pipeline, prompt) -> list[list[int]]:
    """Token ids of each prompt of a completions ``prompt``: text, token ids, or a list of either.

    Raises APIError 400 for ids outside the vocabulary or an empty prompt.
    """
    if isinstance(prompt, str) or (isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    return [_prompt_ids(pipeline, p) for p in prompts]


def _prompt_ids(pipeline, prompt: str | list[int]) -> list[int]:
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


def chat_prompt_ids(pipeline, body: ChatCompletionRequest) -> list[int]:
    """Token ids of the messages (and ``tools``, unless ``tool_choice`` is "none") through the
    target's chat template, ready for the assistant turn: :func:`verispec.models.conversation.conversation_ids`,
    as the library's :meth:`~verispec.engine.loader.SpeculativePipeline.chat` renders them.

    Raises APIError 400 for a message without content (an assistant's may have ``tool_calls``
    instead), a model without a chat template, or messages the template refuses.
    """
    if not getattr(pipeline.tokenizer, "chat_template", None):
        raise bad_request(f"{pipeline.target.name} has no chat template: use /v1/completions", "messages")
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    use_tools = body.tools and body.tool_choice != "none"
    definitions = [tool.model_dump(exclude_none=True) for tool in body.tools] if use_tools else None
    try:
        return conversation_ids(pipeline.tokenizer, pipeline.target.name, messages, definitions)
    except ConversationError as exc:
        raise bad_request(str(exc), exc.param) from None


def usage(results: Sequence[tuple[int, RequestMetrics, float]]) -> Usage:
    """Usage of one response: ``(prompt index, metrics, queue seconds)`` per choice.

    Prompt tokens count once per prompt (and so do those the prefix cache supplied,
    ``prompt_tokens_details.cached_tokens``), completion tokens per choice; the speculative counts are
    sums (rates recomputed from them); with several choices ``ttft_ms`` and ``tpot_ms`` are means
    over the choices and ``queue_ms`` the longest wait.
    """
    prompts = {index: metrics.prompt_tokens for index, metrics, _ in results}
    prompt_tokens = sum(prompts.values())
    cached: dict[int, int] = {}  # per prompt, the most any of its choices read from the prefix cache
    for index, metrics, _ in results:
        cached[index] = max(cached.get(index, 0), metrics.cached_tokens)
    completion_tokens = sum(metrics.output_tokens for _, metrics, _ in results)
    drafts = sum(metrics.spec.num_drafts for _, metrics, _ in results)
    drafted = sum(metrics.spec.num_draft_tokens for _, metrics, _ in results)
    accepted = sum(metrics.spec.num_accepted_tokens for _, metrics, _ in results)
    tpots = [metrics.tpot_ms for _, metrics, _ in results if metrics.tpot_ms is not None]
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())),
        num_drafts=drafts,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        acceptance_rate=acceptance_rate(accepted, drafted),
        mean_acceptance_length=mean_acceptance_length(accepted, drafts),
        ttft_ms=sum(metrics.ttft_ms for _, metrics, _ in results) / len(results),
        tpot_ms=sum(tpots) / len(tpots) if tpots else None,
        queue_ms=max(queue_s for _, _, queue_s in results) * 1e3,
    )


@dataclasses.dataclass
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    chat: bool
    model: str
    id: str = ""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    system_fingerprint: str | None = None  # :func:`system_fingerprint`

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        logprobs: dict | None = None,
        tool_calls: list | None = None,
    ) -> dict[str, Any]:
        """One choice of a non-streaming response."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def body(self, choices: list[dict[str, Any]], usage_: Usage) -> dict[str, Any]:
        """The non-streaming response."""
        return self._frame("chat.completion" if self.chat else "text_completion", choices, usage_.model_dump())

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        index: int = 0,
        logprobs: dict | None = None,
        tool_calls: list | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk; ``text=None`` sends an empty delta (chat's closing chunk)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._frame("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage_: Usage) -> dict[str, Any]:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return self._frame("chat.completion.chunk" if self.chat else "text_completion", [], usage_.model_dump())

    def _frame(self, kind: str, choices: list, usage_: dict | None = None) -> dict[str, Any]:
        frame = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if self.system_fingerprint is not None:
            frame["system_fingerprint"] = self.system_fingerprint
        if usage_ is not None:
            frame["usage"] = usage_
        return frame


def system_fingerprint(model_path: str | Path | None) -> str:
    """OpenAI's ``system_fingerprint``: ``verispec-<version>-<digest>``, the digest the first 16
    hex digits of the sha256 of the target's model file (a folder: of its files' names and bytes,
    in name order; ``nodigest`` without a path). A seed gives the same text while it is unchanged
    (coupled sampling); read once at start (about 1 s per GB)."""
    from verispec import __version__

    digest = hashlib.sha256()
    if model_path is None:
        return f"verispec-{__version__}-nodigest"
    root = Path(model_path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        if path != root:
            digest.update(str(path.relative_to(root)).encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return f"verispec-{__version__}-{digest.hexdigest()[:16]}"
