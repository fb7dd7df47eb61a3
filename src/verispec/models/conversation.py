"""A conversation as prompt token ids: OpenAI-shaped chat messages (and tool definitions) through the
model's chat template, ready for the assistant's turn, with one BOS as llama.cpp puts it.

The server's ``/v1/chat/completions`` and ``/tokenize`` and the library's
:meth:`verispec.engine.loader.SpeculativePipeline.chat` all render through :func:`conversation_ids`,
so one conversation gives the same prompt everywhere. Knows nothing about HTTP, validation of
the wire format or decoding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from verispec.errors import InvalidParameterError
from verispec.models.gguf_tokenizer import chat_token_ids

ROLES = ("system", "developer", "user", "assistant", "tool")


class ConversationError(InvalidParameterError):
    """A conversation that cannot be rendered; ``param``: the field at fault, e.g.
    ``messages[2].content`` (the server's 400 names it)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def conversation_ids(
    tokenizer,
    model_name: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``messages`` (and ``tools``) through ``tokenizer``'s chat template, ready for the
    assistant's turn (``add_generation_prompt=False``: ending with the last message;
    :func:`verispec.models.gguf_tokenizer.chat_token_ids`: one BOS).

    ``messages``: OpenAI chat messages as dicts: ``role`` (system, developer, user, assistant or
    tool; developer is rendered as system), ``content`` (a string or a list of ``{"type": "text",
    "text": ...}`` parts; an assistant's may be None with ``tool_calls``), and optionally
    ``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``),
    ``tool_call_id`` and ``name``. ``tools``: OpenAI tool definitions (``{"type": "function",
    "function": {"name", "description", "parameters"}}``), rendered where the template shows them.

    Raises:
        ConversationError: no chat template, no messages, a message of an unknown role or without
            content, a content part that is not text, or messages the template refuses.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ConversationError(f"{model_name} has no chat template")
    if not messages:
        raise ConversationError("messages is empty: give at least one message")
    conversation = [template_message(message, i) for i, message in enumerate(messages)]
    options = {} if not tools else {"tools": template_tools(tools)}
    try:
        return list(chat_token_ids(tokenizer, conversation, add_generation_prompt=add_generation_prompt, **options))
    except Exception as exc:  # jinja raises TemplateError (or anything) for conversations a template refuses
        raise ConversationError(f"the chat template rejected the messages: {exc}") from None


def template_message(message: Mapping[str, Any], index: int = 0) -> dict[str, Any]:
    """One OpenAI chat message as the template's dict: ``developer`` as ``system`` (OpenAI's name for
    the system instruction since o1; templates such as Qwen2.5's render no other role), text parts
    joined, and each tool call's ``arguments`` parsed from its JSON text (as Hugging Face templates
    expect). ``index``: the message's place, named in errors.

    Raises:
        ConversationError: an unknown role, content missing or not text.
    """
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ConversationError(f"{where} must be an object with role and content, got {message!r}", where)
    role = message.get("role")
    if role not in ROLES:
        raise ConversationError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    tool_calls = message.get("tool_calls") or None
    content = message.get("content")
    if content is None and not (role == "assistant" and tool_calls):
        need = "content or tool_calls" if role == "assistant" else "content"
        article = "an" if role == "assistant" else "a"
        raise ConversationError(
            f"{where}.content is missing: {article} {role} message needs {need}", f"{where}.content"
        )
    entry: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _text(content, where)}
    if tool_calls:
        entry["tool_calls"] = [
            {
                "type": "function",
                "id": call.get("id"),
                "function": {"name": call["function"]["name"], "arguments": _arguments(call["function"]["arguments"])},
            }
            for call in tool_calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            entry[key] = message[key]
    return entry


def template_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool definitions as the template's dicts (``function`` without the fields left None)."""
    return [
        {"type": "function", "function": {k: v for k, v in tool["function"].items() if v is not None}} for tool in tools
    ]


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ConversationError(
                f"{where}.content[{i}] is not a text part: only text content is supported (text models)",
                f"{where}.content",
            )
        parts.append(part["text"])
    return "".join(parts)


def _arguments(text):
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
