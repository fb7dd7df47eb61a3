"""Issue-4 measurement: chain vs tree drafting at equal target-pass size, one run.

Usage (one real-model process at a time on a shared machine):

    flock /tmp/verispec-real-model.lock .venv/bin/python scripts/measure_tree.py \
        --runner int8 --prompts 10 --max-tokens 64 --nodes 4,8

For each budget N a chain drafts N tokens and the tree verifies N nodes: both send N + 1 tokens
through each target pass. Prompts from HumanEval dev; every configuration runs on a prompt
before the next prompt starts (interleaved), greedy, and its tokens are compared with plain
decoding's. ``auto`` at the largest budget runs too: its "drafts by drafter" column shows how
often it chose the draft model's chain (``draft``), its tree (``tree``) or n-gram lookup. Prints
one JSON line per run, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from verispec.engine import SpeculativeConfig
from verispec.pipeline import SpeculativePipeline
from verispec.runners.select import RunnerOptions
from verispec.sampling import SamplingParams

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "humaneval_dev.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runner", default="int8", help="torch, int8 or llamacpp")
    parser.add_argument("--dtype", default="float32", help="torch runner only")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--nodes", default="4,8", help="comma-separated node budgets N")
    args = parser.parse_args()
    budgets = [int(n) for n in args.nodes.split(",")]
    prompts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[: args.prompts]]
    start = time.perf_counter()
    pipe = SpeculativePipeline.load(dtype=args.dtype, runners=RunnerOptions(kind=args.runner))
    print(json.dumps({"runner": pipe.runner_kind, "load_s": round(time.perf_counter() - start, 1)}), flush=True)
    params = SamplingParams(max_tokens=args.max_tokens)
    configs = [("plain", SpeculativeConfig(method="none"))]
    for n in budgets:
        configs += [(f"chain N={n}", SpeculativeConfig(method="draft", num_speculative_tokens=n)),
                    (f"tree N={n}", SpeculativeConfig(method="tree", num_speculative_tokens=n))]
    configs.append((f"auto K={max(budgets)}", SpeculativeConfig(method="auto", num_speculative_tokens=max(budgets))))
    for _, spec in configs:
        pipe.generate("def warmup():", SamplingParams(max_tokens=4), spec)
    rows: dict[str, list] = {label: [] for label, _ in configs}
    for i, prompt in enumerate(prompts):
        plain_ids = None
        for label, spec in configs:
            out = pipe.generate(prompt, params, spec)
            m = out.metrics
            plain_ids = out.token_ids if spec.method == "none" else plain_ids
            row = {"prompt": i, "config": label, "tokens": m.output_tokens, "decode_s": (m.tpot_ms or 0) * max(m.output_tokens - 1, 0) / 1e3,
                   "drafts": m.spec.num_drafts, "accepted": m.spec.num_accepted_tokens, "target_forwards": m.num_target_forwards,
                   "target_ms": round(m.target_ms, 1), "draft_ms": round(m.draft_ms, 1), "identical": out.token_ids == plain_ids,
                   "drafts_by_drafter": {n: d.num_drafts for n, d in m.spec.per_drafter.items() if d.num_drafts}}
            rows[label].append(row)
            print(json.dumps(row), flush=True)
    print(f"\n## chain vs tree, runner {pipe.runner_kind}, {len(prompts)} HumanEval dev prompts, greedy, max_tokens {args.max_tokens}\n")
    print("| config | tokens/pass (target) | decode tokens/s | speedup | mean acceptance length | target ms/pass | draft ms per output token | drafts by drafter | == plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for label, spec in configs:
        r = rows[label]
        tokens = sum(x["tokens"] - 1 for x in r)
        seconds = sum(x["decode_s"] for x in r)
        rate = tokens / seconds if seconds else 0.0
        base = rate if base is None else base
        drafts = sum(x["drafts"] for x in r)
        mal = f"{1 + sum(x['accepted'] for x in r) / drafts:.2f}" if drafts else "—"
        width = 1 if spec.method == "none" else spec.num_speculative_tokens + 1
        forwards = sum(x["target_forwards"] for x in r)
        print(f"| {label} | {width} | {rate:.2f} | {rate / base:.2f}x | {mal} | {sum(x['target_ms'] for x in r) / forwards:.1f} | "
              f"{sum(x['draft_ms'] for x in r) / max(1, sum(x['tokens'] for x in r)):.1f} | {by_drafter(r)} | {sum(x['identical'] for x in r)}/{len(r)} |")
    print(json.dumps({"wall_s": round(time.perf_counter() - start, 1)}))


def by_drafter(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        for name, n in row["drafts_by_drafter"].items():
            counts[name] = counts.get(name, 0) + n
    return " ".join(f"{name}:{n}" for name, n in sorted(counts.items())) or "—"


if __name__ == "__main__":
    main()
