"""The wire format of the OpenAI-compatible API: pydantic request and response models.

Owns field names, JSON types and the ranges the API documents in ``/openapi.json`` (the
library's :class:`~verispec.algorithms.sampling.SamplingParams` checks its own, wider ranges again; the
API's keep float32 sampling finite). Requests are strict: a wrong JSON type or an unknown field
is a 400, as with OpenAI. Knows nothing about models, queues or decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_validator

from verispec.engine import MAX_SPECULATIVE_TOKENS, METHODS, SpeculativeConfig

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 16
# Numerically safe ranges: temperatures near 1e-38 or penalties near 1e-300 turn float32 logits
# into inf and the sampling distribution into NaN.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-5  # below ~1e-45 top_p rounds to 0 in float32 and drops every token
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _integral(value):
    """JSON Schema counts 3.0 as an integer; strict pydantic would not (3.5 still fails)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[int, BeforeValidator(_integral)]
StopString = Annotated[str, Field(min_length=1)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _check_text(value: str) -> str:
    """Reject lone surrogates (``"\\ud800"`` in JSON): they are not encodable text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return value


def _speculative_options() -> type[BaseModel]:
    """Extension ``speculative``: any field of :class:`~verispec.engine.SpeculativeConfig`.

    Built from the dataclass so the API follows the library; every field is optional (the
    server's command line gives the defaults) and the config itself checks the values.
    """
    hints = get_type_hints(SpeculativeConfig)
    fields = {}
    for f in dataclasses.fields(SpeculativeConfig):
        kind = Integer if hints[f.name] is int else hints[f.name]
        fields[f.name] = (kind | None, Field(None, description=_SPEC_HELP.get(f.name)))
    doc = "Extension: how to speculate for this request; omitted fields take the server's defaults."
    return create_model("SpeculativeOptions", __base__=_Request, __doc__=doc, **fields)


_SPEC_HELP = {
    "method": f"none (plain decoding) or a loaded drafter: {', '.join(m for m in METHODS if m != 'none')}",
    "num_speculative_tokens": f"draft tokens per target pass, 1..{MAX_SPECULATIVE_TOKENS}",
}
SpeculativeOptions = _speculative_options()


class StreamOptions(_Request):
    include_usage: bool = False


MAX_N = 16
MAX_PROMPTS = 16


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``, plus the extensions ``regex`` and ``grammar`` (Lark, llguidance's
    dialect): the output follows it exactly, speculated tokens included."""

    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions (OpenAI names and defaults)."""

    model: str
    max_tokens: Integer | None = Field(None, ge=1, description="new tokens at most; capped by the server")
    temperature: float = Field(1.0, ge=0, description=f"0 = greedy; else at least {MIN_TEMPERATURE}")
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1, description="nucleus mass in (0, 1]")
    top_k: Integer = Field(0, ge=0, description="extension: keep the k most likely tokens (0 = off)")
    seed: Integer | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Integer = Field(1, ge=1, le=MAX_N, description="choices per prompt, each with its own generator (seed + index)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(
        1.0,
        ge=REPETITION_PENALTY_RANGE[0],
        le=REPETITION_PENALTY_RANGE[1],
        description="extension: CTRL repetition penalty (1 = off)",
    )
    speculative: SpeculativeOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    min_tokens: Integer = Field(0, ge=0, description="extension: EOS is masked until the output has this many tokens")
    ignore_eos: bool = Field(False, description="extension: keep generating past EOS")
    sampling: Literal["coupled", "rejection"] | None = Field(
        None,
        description="extension: coupled (a seed gives the same text under every method, batched or alone) or "
        "rejection (modified rejection sampling); default: the server's --sampling",
    )
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        for token, value in (bias or {}).items():
            if not (token.isascii() and token.isdigit() and len(token) <= 12):
                raise ValueError(f"keys are token ids as strings, got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases are in [-100, 100], got {value}")
        return bias

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, temperature):
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return temperature

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        for s in [stop] if isinstance(stop, str) else stop or []:
            _check_text(s)
        return stop


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: text, token ids, or a list of either (one choice set each)."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | list[Integer]
        | Annotated[list[list[Integer]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    echo: bool = False
    logprobs: Integer | None = Field(
        None, ge=0, le=20, description="alternatives per token (0..20) with log-probabilities"
    )

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, prompt):
        for item in [prompt] if isinstance(prompt, str) else prompt:
            if isinstance(item, str):
                _check_text(item)
        return prompt


class TextPart(_Request):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _part_text(cls, text):
        return _check_text(text)


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """Name a part that is not text (``image_url``, ``input_audio``, ``file``) rather than fail every branch."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"part {i} is of type {kind!r}: only text content parts are supported (text models)")
        return content

    @field_validator("content")
    @classmethod
    def _content_text(cls, content):
        return _check_text(content) if isinstance(content, str) else content

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``; the prompt is the model's chat template over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1, description="preferred over max_tokens")
    logprobs: bool = False
    top_logprobs: Integer | None = Field(None, ge=0, le=20, description="alternatives per token, with logprobs")
    tools: list[Tool] | None = Field(None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


# ----- responses -----


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``."""

    cached_tokens: int = Field(description="prompt tokens read from the prefix cache instead of computed")


class Usage(BaseModel):
    """OpenAI usage plus verispec's speculative figures (definitions: :mod:`verispec.metrics`)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(
        default_factory=lambda: PromptTokensDetails(cached_tokens=0),
        description="cached_tokens: prompt tokens the prefix cache supplied (counted once per prompt)",
    )
    num_drafts: int = Field(description="verify steps that had at least one drafted token")
    num_draft_tokens: int = Field(description="tokens drafted")
    num_accepted_tokens: int = Field(description="drafted tokens the target accepted")
    acceptance_rate: float | None = Field(description="accepted / drafted; null without drafts")
    mean_acceptance_length: float | None = Field(description="1 + accepted / drafts: tokens per target pass")
    ttft_ms: float = Field(description="generation start to first token, ms (queue time excluded)")
    tpot_ms: float | None = Field(description="ms per output token after the first")
    queue_ms: float = Field(description="time the request waited for the engine, ms")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "verispec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape; 500s carry ``code = "server_error"`` and an id in the message."""

    error: ErrorBody
