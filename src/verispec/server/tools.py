"""Tool calling in chat completions: the grammar of a forced call, and parsing the calls.

Owns: the Lark grammar that forces a call when ``tool_choice`` is ``required`` or names a
function (the arguments follow the function's JSON schema: llguidance's ``%json``), and parsing
the model's ``<tool_call>`` blocks (the Hermes / Qwen2.5 convention the template asks the model
to use) into OpenAI ``tool_calls``. What the template sees (messages and tool definitions) is
:mod:`verispec.models.conversation`'s. Knows nothing about decoding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from verispec.engine.constraints import JSON_OPTIONS, StructuredOutput
from verispec.server.tool_parser import ToolCallStream, parse_tool_calls

__all__ = ["ToolCallStream", "forced_call_grammar", "parse_tool_calls"]


def forced_call_grammar(tools: Sequence, name: str | None, tokenizer=None) -> StructuredOutput:
    """A grammar for exactly one ``<tool_call>`` of function ``name`` (None: any of ``tools``),
    its ``arguments`` following the function's ``parameters`` schema: the model's own format,
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    ``tokenizer`` (the target's): where it makes ``<tool_call>`` or ``</tool_call>`` one token (Qwen2.5's
    added tokens 151657 and 151658), the grammar names that token by id (``<[id]>``); a literal
    string there would let the model emit the token but never advance past it (llguidance
    matches text literals against ordinary tokens only). Without a tokenizer: literal text.
    """
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
    lark = f'start: {_tag(tokenizer, "<tool_call>")} "\\n" ({start}) "\\n" {_tag(tokenizer, "</tool_call>")}\n{rules}\n'
    return StructuredOutput("grammar", lark)


def _tag(tokenizer, text: str) -> str:
    """``text`` in a Lark rule: its token by id where ``tokenizer`` makes it one token, else the literal."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)
