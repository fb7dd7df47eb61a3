"""``POST /tokenize`` and ``POST /detokenize``: the target's tokenizer over HTTP, in the shapes vLLM's
server uses (llama.cpp's field names accepted too), for evaluation harnesses and clients that count
or build prompts in token ids.

``/tokenize`` gives the ids the generation routes feed the model: a ``prompt`` as
``/v1/completions`` encodes it (``add_special_tokens``, default true: BOS where the model adds one),
``messages`` (and ``tools``) as ``/v1/chat/completions`` renders them
(:func:`verispec.models.conversation.conversation_ids`). ``/detokenize`` gives the text of ids,
special tokens included, so ``/detokenize`` of ``/tokenize`` (``add_special_tokens: false``) is
the text itself. Knows nothing about decoding.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from verispec.models.conversation import ConversationError, conversation_ids
from verispec.server.faults import APIError
from verispec.server.schemas import ChatMessage, Integer, Tool


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TokenizeRequest(_Strict):
    """One of ``prompt`` (vLLM; llama.cpp's ``content``) or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = Field(None, description="llama.cpp's name of prompt")
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, max_length=64)
    add_special_tokens: bool | None = Field(None, description="prompt: add BOS where the model does (default true)")
    add_special: bool | None = Field(None, description="llama.cpp's name of add_special_tokens")
    add_generation_prompt: bool = Field(True, description="messages: end ready for the assistant's turn")
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int = Field(description="the context window: prompt plus output tokens")
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Integer]


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str = Field(description="the same text, under llama.cpp's name")


def install(app: FastAPI, pipeline, check_model: Callable[[str], None], dependencies: list) -> None:
    """Add ``/tokenize`` and ``/detokenize`` to ``app`` over ``pipeline``'s tokenizer; ``check_model``
    raises the 404 of a ``model`` this server does not serve; ``dependencies``: the routes' (the API key)."""
    tokenizer = pipeline.tokenizer
    errors = {status: {"model": dict} for status in (400, 401, 404)}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors, dependencies=dependencies)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt or a conversation, exactly as the generation routes make them."""
        if body.model is not None:
            check_model(body.model)
        ids = _token_ids(pipeline, body)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=pipeline.context_window, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors, dependencies=dependencies)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids, special tokens included, spaces as they are."""
        if body.model is not None:
            check_model(body.model)
        size = len(tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the tokenizer's vocabulary [0, {size})", param="tokens")
        text = tokenizer.decode(body.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return DetokenizeResponse(prompt=text, content=text)


def _token_ids(pipeline, body: TokenizeRequest) -> list[int]:
    """Raises APIError 400: not exactly one of prompt, content and messages; both names of one flag;
    ``add_special_tokens`` with messages; a conversation that cannot render."""
    given = [name for name in ("prompt", "content", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise APIError(400, "give exactly one of prompt (or content) and messages", param="prompt")
    if body.add_special_tokens is not None and body.add_special is not None:
        raise APIError(400, "give add_special_tokens or add_special (llama.cpp's name), not both", param="add_special")
    add_special = body.add_special_tokens if body.add_special_tokens is not None else body.add_special
    if body.messages is None:
        text = body.prompt if body.prompt is not None else body.content
        return list(pipeline.tokenizer.encode(text, add_special_tokens=add_special is not False))
    if add_special:
        raise APIError(
            400,
            "add_special_tokens does not apply to messages: their ids are the chat prompt's, with the BOS the "
            "model adds, as /v1/chat/completions uses them",
            param="add_special_tokens",
        )
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    try:
        return conversation_ids(
            pipeline.tokenizer,
            pipeline.target.name,
            messages,
            tools,
            add_generation_prompt=body.add_generation_prompt,
        )
    except ConversationError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
