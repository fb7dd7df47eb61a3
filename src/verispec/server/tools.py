"""Tool calling in chat completions: what the template sees, the grammar of a forced call, parsing.

Owns: the ``tools`` the chat template renders (OpenAI's function definitions as the Hugging Face
template convention wants them), the Lark grammar that forces a call when ``tool_choice`` is
``required`` or names a function (the arguments follow the function's JSON schema: llguidance's
``%json``), and parsing the model's ``<tool_call>`` blocks (the Hermes / Qwen2.5 convention the
template asks the model to use) into OpenAI ``tool_calls``. Knows nothing about decoding.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Sequence

from verispec.engine.constraints import JSON_OPTIONS, StructuredOutput

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_tools(tools: Sequence) -> list[dict[str, Any]]:
    """OpenAI ``tools`` (pydantic :class:`~verispec.server.schemas.Tool`) as the template's dicts."""
    return [{"type": "function", "function": tool.function.model_dump(exclude_none=True)} for tool in tools]


def forced_call_grammar(tools: Sequence, name: str | None) -> StructuredOutput:
    """A grammar for exactly one ``<tool_call>`` of function ``name`` (None: any of ``tools``),
    its ``arguments`` following the function's ``parameters`` schema."""
    chosen = [t for t in tools if name is None or t.function.name == name]
    alternatives = []
    for tool in chosen:
        parameters = dict(tool.function.parameters)
        definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": JSON_OPTIONS,
            **definitions,  # "#/$defs/..." references resolve at the root, as in the tool's own schema
        }
        alternatives.append(f"%json {json.dumps(schema)}")
    rules = "\n".join(f"call{i}: {alt}" for i, alt in enumerate(alternatives))
    start = " | ".join(f"call{i}" for i in range(len(alternatives)))
    lark = f'start: "<tool_call>\\n" ({start}) "\\n</tool_call>"\n{rules}\n'
    return StructuredOutput("grammar", lark)


def parse_tool_calls(text: str, tools: Sequence) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a model's answer: each ``<tool_call>{"name", "arguments"}</tool_call>``
    block naming a known function becomes an OpenAI tool call (``arguments`` as JSON text); the
    rest of the text is the content (None when empty). Blocks that do not parse stay in the content.
    """
    names = {t.function.name for t in tools}
    calls, kept, last = [], [], 0
    for match in TOOL_CALL.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(payload, dict) or payload.get("name") not in names:
            continue
        arguments = payload.get("arguments", {})
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append({
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": payload["name"], "arguments": _json_text(arguments)},
        })
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def template_message(message) -> dict[str, Any]:
    """One chat message as the template's dict (assistant ``tool_calls`` with parsed arguments)."""
    entry: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        entry["tool_calls"] = [
            {"type": "function", "id": call.id, "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        entry["name"] = message.name
    return entry


def _json_text(arguments) -> str:
    """``arguments`` as JSON text: an object stays one; a string holding a JSON object (some
    models quote it) is kept as it is; any other value is encoded."""
    if isinstance(arguments, str):
        try:
            if isinstance(json.loads(arguments), dict):
                return arguments
        except json.JSONDecodeError:
            pass
    return json.dumps(arguments)


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
