"""Free drafts under a grammar (issue 55): what the tokens a grammar forces save, measured.

The default pair through the library (gguf runner), greedy, each request twice in a row: with the
engine's forced drafts (:func:`verispec.engine.commit.forced_draft`) and with them switched off in
this process (``MIN_FORCED_TOKENS`` set past any draft: the policy drafts every step, the code of
before). Two workloads written here: JSON extraction under a ``json_schema`` (four texts, one
schema) and tool calls under the grammar the server builds for ``tool_choice: required`` (four
requests, two tools). Per workload: output tokens/s end to end off and on, the ratio, the share of
output tokens the grammar forced, and whether every output is the same token ids both ways.

Run it alone: ``../shared/tools/alone .venv/bin/python scripts/grammar_drafts.py [METHOD ...]``
(default methods: auto, ngram).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from types import SimpleNamespace

import verispec.engine.commit as commit
from verispec import SamplingParams, SpeculativeConfig, SpeculativePipeline
from verispec.engine.constraints import StructuredOutput
from verispec.models.gguf_tokenizer import chat_token_ids
from verispec.server.tools import forced_call_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "email": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "email", "languages"],
    "additionalProperties": False,
}
TEXTS = (
    "Maria Keller, 34, lives in Zurich; she writes Rust and Go and answers at maria.keller@example.ch.",
    "Our new hire is Tom Okafor (29) from Lagos. Email tom.o@example.com. He codes in Python, SQL and Kotlin.",
    "Contact: Lena Ivanova, Berlin, age 41, lena@ivanova.example, languages: C++, Python.",
    "Jae-won Park is 23, based in Busan, programs TypeScript; reach him at jw.park@example.kr.",
)
TOOLS = [
    SimpleNamespace(
        function=SimpleNamespace(
            name="lookup_order",
            parameters={
                "type": "object",
                "properties": {
                    "order_id": {"type": "string"},
                    "fields": {"type": "array", "items": {"enum": ["status", "address", "items", "total"]}},
                },
                "required": ["order_id", "fields"],
                "additionalProperties": False,
            },
        )
    ),
    SimpleNamespace(
        function=SimpleNamespace(
            name="get_weather",
            parameters={
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        )
    ),
]
TOOL_QUESTIONS = (
    "Where is my order NW-20418837 and what is in it?",
    "Is it going to be cold in Trondheim tomorrow? I use Fahrenheit.",
    "What did I pay for order NW-7781, and where is it going?",
    "Weather in Porto please, in Celsius.",
)


def requests(pipe) -> dict[str, list[tuple[list[int], StructuredOutput]]]:
    schema = StructuredOutput.json_schema(PERSON)
    json_items = [
        (chat_token_ids(pipe.tokenizer, [{"role": "user", "content": f"Extract the person as JSON: {text}"}]), schema)
        for text in TEXTS
    ]
    tool_schemas = [
        {"type": "function", "function": {"name": t.function.name, "parameters": t.function.parameters}} for t in TOOLS
    ]
    grammar = forced_call_grammar(TOOLS, None, pipe.tokenizer)
    tool_items = [
        (chat_token_ids(pipe.tokenizer, [{"role": "user", "content": q}], tools=tool_schemas), grammar)
        for q in TOOL_QUESTIONS
    ]
    return {"json_schema": json_items, "tool_call": tool_items}


def run(pipe, prompt, grammar, method: str, forced: bool):
    commit.MIN_FORCED_TOKENS = 2 if forced else 10**9
    params = SamplingParams(max_tokens=128, structured_output=grammar)
    start = time.perf_counter()
    out = pipe.engine.generate(prompt, params, SpeculativeConfig(method=method), learn=False)
    return out, time.perf_counter() - start


def main() -> None:
    methods = sys.argv[1:] or ["auto", "ngram"]
    pipe = SpeculativePipeline.load()
    workloads = requests(pipe)
    run(pipe, *workloads["json_schema"][0], methods[0], True)  # warm-up: kernels, grammar compiler
    print("| workload | method | tokens | off tok/s | on tok/s | on/off | forced tokens | identical |")
    print("|---|---|---|---|---|---|---|---|")
    report = []
    for name, items in workloads.items():
        for method in methods:
            tokens, off_s, on_s, forced, same = 0, 0.0, 0.0, 0, 0
            for prompt, grammar in items:
                off, off_t = run(pipe, prompt, grammar, method, False)
                on, on_t = run(pipe, prompt, grammar, method, True)
                tokens += len(on.token_ids)
                off_s, on_s = off_s + off_t, on_s + on_t
                forced += on.token_sources.count(commit.GRAMMAR_DRAFTER)
                same += off.token_ids == on.token_ids
            row = {
                "workload": name,
                "method": method,
                "tokens": tokens,
                "off_tokens_per_s": round(tokens / off_s, 2),
                "on_tokens_per_s": round(tokens / on_s, 2),
                "ratio": round(off_s / on_s, 3),
                "forced_accepted_tokens": forced,
                "identical": f"{same}/{len(items)}",
            }
            report.append(row)
            print(
                f"| {name} | {method} | {tokens} | {row['off_tokens_per_s']} | {row['on_tokens_per_s']} | "
                f"{row['ratio']:.2f}x | {forced} ({forced / tokens:.0%}) | {row['identical']} |",
                flush=True,
            )
    print(json.dumps({"runner": pipe.runner_choice.label, "rows": report}))
    print("geometric mean on/off:", round(statistics.geometric_mean([r["ratio"] for r in report]), 3))


if __name__ == "__main__":
    main()
