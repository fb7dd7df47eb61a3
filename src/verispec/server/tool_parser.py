"""Tool calls in a chat model's text: the forms models write, parsed into OpenAI ``tool_calls``, and
the split of a streamed answer into content sent at once and a tail held back while it may be a call.

Forms parsed (a call counts only when ``name`` is one of the request's ``tools`` and its
``arguments`` validate against that function's ``parameters`` schema; anything else stays content):

1. ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere in the answer (the Hermes /
   Qwen2.5 convention the chat template asks for); the last block may lack its closing tag;
2. a fenced block ```` ```json {"name": ..., "arguments": {...}} ``` ```` (the language is optional),
   anywhere in the answer: Qwen2.5-Coder's usual answer to ``tool_choice: "auto"``;
3. an answer that is nothing but such an object, also in doubled braces ``{{...}}`` (Qwen2.5's
   template writes its instruction that way and the model copies it).

``"parameters"`` is read as ``"arguments"``, and ``arguments`` given as JSON text are read too.
Knows nothing about decoding or the wire format.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

OPEN_TAG = "<tool_call>"
FENCE = "```"
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
_FENCED = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)
_CALL_KEYS = frozenset({"name", "arguments", "parameters"})


def parse_tool_calls(text: str, tools: Sequence) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a whole answer: what :class:`ToolCallStream` sends for it.

    ``tools``: the request's :class:`~verispec.server.schemas.Tool` list. Each call is OpenAI's
    ``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``; ``content`` is the
    text outside the calls (None when empty); without calls it is ``text`` unchanged.
    """
    stream = ToolCallStream(tools)
    sent = stream.feed(text)
    tail, calls = stream.finish()
    return (sent + tail) or None, calls


class ToolCallStream:
    """One answer's text, chunk by chunk: :meth:`feed` returns the content that can be sent now,
    :meth:`finish` the rest of the content and the calls.

    Held back: the whole answer while it starts with ``{`` (or is only whitespace), and from the
    first place that is or may still become an opening ``<tool_call>`` or ```` ```json { ````
    (whitespace before it included) to the end; trailing whitespace waits for what follows. What
    is sent depends only on the text so far, never on how it was chunked, so the streamed content
    adds up to the non-streamed one.
    """

    def __init__(self, tools: Sequence) -> None:
        self.tools = {tool.function.name: tool for tool in tools}
        self.text = ""
        self.sent = 0

    def feed(self, chunk: str) -> str:
        """Append ``chunk``; returns the content that became safe to send (may be empty)."""
        self.text += chunk
        end = max(self.sent, _hold_start(self.text, self.sent))
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """``(rest of the content, calls)`` once the answer ended."""
        region = self.text[self.sent :]
        spans = _spans(region, self.tools, whole=self.sent == 0)
        if not spans:
            return region, []
        kept, last = [], 0
        for start, end, _ in spans:
            kept.append(region[last:start].strip())
            last = end
        kept.append(region[last:].strip())
        rest = "\n".join(piece for piece in kept if piece)
        separator = "\n" if self.sent and rest else ""
        return separator + rest, [call for _, _, call in spans]


def _hold_start(text: str, start: int) -> int:
    """Where held-back text begins in ``text`` (``start``: where the search begins; all before it was sent)."""
    body = text.lstrip()
    if not body or body.startswith("{"):
        return 0
    for i in range(start, len(text)):
        if text[i] in "<`" and _may_open(text[i:]):
            return len(text[:i].rstrip())
    return len(text.rstrip())


def _may_open(text: str) -> bool:
    """Whether ``text`` starts with, or is the start of, ``<tool_call>`` or a fenced JSON object."""
    if text[0] == "<":
        return text.startswith(OPEN_TAG) or OPEN_TAG.startswith(text)
    if len(text) < len(FENCE):
        return FENCE.startswith(text)
    if not text.startswith(FENCE):
        return False
    rest = text[len(FENCE) :]
    if rest.startswith("json"):
        rest = rest[4:]
    elif "json".startswith(rest):
        return True
    rest = rest.lstrip()
    return not rest or rest.startswith("{")


def _spans(region: str, tools: dict, whole: bool) -> list[tuple[int, int, dict[str, Any]]]:
    """``(start, end, call)`` of each call in ``region``, in order (``whole``: the region is the answer)."""
    spans = []
    for pattern in (_TAGGED, _FENCED):
        for match in pattern.finditer(region):
            if any(start < match.end() and match.start() < end for start, end, _ in spans):
                continue
            call = _call(match.group(1), tools)
            if call is not None:
                spans.append((match.start(), match.end(), call))
    if not spans and whole:
        call = _call(region.strip(), tools)
        if call is not None:
            spans.append((0, len(region), call))
    return sorted(spans, key=lambda span: span[0])


def _call(text: str, tools: dict) -> dict[str, Any] | None:
    """The OpenAI tool call ``text`` (one JSON object) writes, or None if it is not a valid one."""
    payload = _object(text)
    if payload is None and text.startswith("{{") and text.endswith("}}"):
        payload = _object(text[1:-1])
    if payload is None or not set(payload) <= _CALL_KEYS or payload.get("name") not in tools:
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _object(arguments)
    if not isinstance(arguments, dict):
        return None
    encoded = json.dumps(arguments, ensure_ascii=False)
    if not schema_accepts(json.dumps(tools[payload["name"]].function.parameters), encoded):
        return None
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": payload["name"], "arguments": encoded},
    }


def _object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def schema_accepts(schema: str, value: str) -> bool:
    """Whether the JSON text ``value`` validates against the JSON schema ``schema`` (JSON text), by
    llguidance, the engine that forces a call's grammar; False for a schema it cannot compile."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, RecursionError):
        return False
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    return matcher.consume_tokens(list(value.encode("utf-8"))) and matcher.is_accepting()


class _Bytes:
    """A tokenizer of one token per byte (and an end token, 256): what llguidance needs to check text."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids: ClassVar[list[int]] = [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


@functools.cache
def _byte_tokenizer():
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
