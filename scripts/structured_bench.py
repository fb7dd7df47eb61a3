"""Structured outputs on the real pair: Spec-Bench prompts answered as JSON, with and without the grammar.

20 Spec-Bench questions (4 each of translation, summarization, qa, math_reasoning, rag), each
asked to answer as JSON following its category's schema (the schema is in the prompt in both
runs). Four configurations over the same prompts, greedy, in one process: plain decoding and
``--method`` (default ``auto``, cost schedule), each without and with ``response_format``
json_schema (the grammar). Prints, per configuration, output tokens, wall seconds, tokens/s,
acceptance rate and mean acceptance length, how many outputs parse and validate against the
schema, and (for the speculative runs) how many are token- and logprob-identical to plain
decoding with the same grammar setting. Decode tokens/s leaves out the prompts' prefill (the
time to the first token), which the long RAG and summarization prompts make large. Run alone:
``../shared/tools/alone python scripts/structured_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema

from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.constraints import StructuredOutput
from verispec.engine.loader import SpeculativePipeline
from verispec.runners.select import RunnerOptions

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench_questions.jsonl"
TEXT = {"type": "string", "maxLength": 600}
SCHEMAS = {
    "translation": {
        "type": "object",
        "properties": {"source_language": TEXT, "target_language": TEXT, "translation": TEXT},
        "required": ["source_language", "target_language", "translation"],
        "additionalProperties": False,
    },
    "summarization": {
        "type": "object",
        "properties": {"summary": TEXT, "key_points": {"type": "array", "items": TEXT, "maxItems": 5}},
        "required": ["summary", "key_points"],
        "additionalProperties": False,
    },
    "qa": {
        "type": "object",
        "properties": {"answer": TEXT, "confidence": {"enum": ["low", "medium", "high"]}},
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
    "math_reasoning": {
        "type": "object",
        "properties": {"steps": {"type": "array", "items": TEXT, "maxItems": 8}, "answer": {"type": "number"}},
        "required": ["steps", "answer"],
        "additionalProperties": False,
    },
    "rag": {
        "type": "object",
        "properties": {"answer": TEXT, "uses_the_context": {"type": "boolean"}},
        "required": ["answer", "uses_the_context"],
        "additionalProperties": False,
    },
}


def prompts(per_category: int) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in DATA.open()]
    chosen = []
    for category in SCHEMAS:
        for row in [r for r in rows if r["category"] == category][:per_category]:
            question = row["turns"][0]
            instruction = (
                "Answer with one JSON object that follows this JSON schema, and nothing else:\n"
                f"{json.dumps(SCHEMAS[category])}"
            )
            chosen.append((category, f"{question}\n\n{instruction}"))
    return chosen


def run(pipe, items, method: str, grammar: bool, max_tokens: int) -> dict:
    outputs, start = [], time.perf_counter()
    for category, prompt in items:
        structured = StructuredOutput.json_schema(SCHEMAS[category]) if grammar else None
        params = SamplingParams(max_tokens=max_tokens, logprobs=0, structured_output=structured)
        spec = SpeculativeConfig(method=method, schedule="cost")
        outputs.append(pipe.engine.generate(pipe.encode(prompt, chat=True), params, spec))
    wall = time.perf_counter() - start
    valid = 0
    for (category, _), out in zip(items, outputs):
        try:
            jsonschema.validate(json.loads(out.text), SCHEMAS[category])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    tokens = sum(len(o.token_ids) for o in outputs)
    decode_s = sum(o.metrics.e2e_ms - o.metrics.ttft_ms for o in outputs) / 1e3
    decode_tokens = sum(max(0, len(o.token_ids) - 1) for o in outputs)
    drafted = sum(o.metrics.spec.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.spec.num_accepted_tokens for o in outputs)
    drafts = sum(o.metrics.spec.num_drafts for o in outputs)
    return {
        "method": method,
        "grammar": grammar,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2),
        "decode_tokens_per_s": round(decode_tokens / decode_s, 2),
        "valid": valid,
        "n": len(items),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "_outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="auto")
    parser.add_argument("--runner", default="gguf")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--out", default="structured_bench.json")
    args = parser.parse_args()
    pipe = SpeculativePipeline.load(runners=RunnerOptions(kind=args.runner))
    items = prompts(args.per_category)
    warm = StructuredOutput.json_schema(SCHEMAS[items[0][0]])  # warm-up; builds the grammar tokenizer (~1 s)
    pipe.engine.generate(pipe.encode(items[0][1], chat=True), SamplingParams(max_tokens=8, structured_output=warm))
    rows = []
    for grammar in (False, True):
        plain = run(pipe, items, "none", grammar, args.max_tokens)
        spec = run(pipe, items, args.method, grammar, args.max_tokens)
        spec["identical_to_plain"] = sum(
            a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(plain["_outputs"], spec["_outputs"])
        )
        spec["speedup_vs_plain"] = round(spec["tokens_per_s"] / plain["tokens_per_s"], 3)
        spec["decode_speedup_vs_plain"] = round(spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"], 3)
        rows += [plain, spec]
    print(
        "| method | grammar | outputs valid | output tokens | wall s | tokens/s (prefill included) "
        "| speedup vs plain | decode tokens/s | decode speedup | acceptance rate | mean acceptance length "
        "| identical to plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {'json_schema' if r['grammar'] else 'none'} | {r['valid']}/{r['n']} "
            f"| {r['tokens']} | {r['wall_s']} | {r['tokens_per_s']} | {r.get('speedup_vs_plain', '')} "
            f"| {r['decode_tokens_per_s']} | {r.get('decode_speedup_vs_plain', '')} | "
            f"{r['acceptance_rate']} | {r['mean_acceptance_length']} | "
            f"{str(r['identical_to_plain']) + '/' + str(r['n']) if 'identical_to_plain' in r else ''} |"
        )
    Path(args.out).write_text(json.dumps([{k: v for k, v in r.items() if k != "_outputs"} for r in rows], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
