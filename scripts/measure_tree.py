"""Issue-4 measurement: chain vs tree drafting at equal target-pass size, one run.

Usage: python scripts/measure_tree.py --dtype bfloat16 --prompts 10 --max-tokens 48 --nodes 5
Chain drafts `nodes` tokens, the tree verifies `nodes` nodes: both run `nodes + 1` tokens per
target pass. Prompts from HumanEval dev, interleaved method by method. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from verispec.engine import SpeculativeConfig
from verispec.pipeline import SpeculativePipeline
from verispec.sampling import SamplingParams

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "humaneval_dev.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--nodes", type=int, default=5)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[: args.prompts]]
    pipe = SpeculativePipeline.load(dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens)
    methods = ("none", "draft", "tree")
    pipe.generate("def warmup():", SamplingParams(max_tokens=4), SpeculativeConfig(method="tree", num_speculative_tokens=args.nodes))
    rows: dict[str, list] = {m: [] for m in methods}
    for i, prompt in enumerate(prompts):
        for method in methods:
            out = pipe.generate(prompt, params, SpeculativeConfig(method=method, num_speculative_tokens=args.nodes))
            m = out.metrics
            rows[method].append(m)
            print(json.dumps({"prompt": i, "method": method, "tokens": m.output_tokens, "decode_tokens_per_s": round(m.decode_tokens_per_s or 0, 3),
                              "mean_acceptance_length": m.spec.mean_acceptance_length, "target_forwards": m.num_target_forwards,
                              "target_ms": round(m.target_ms), "draft_ms": round(m.draft_ms)}), flush=True)
    for method in methods:
        ms = rows[method]
        accepted = sum(m.spec.num_accepted_tokens for m in ms)
        drafts = sum(m.spec.num_drafts for m in ms)
        print(json.dumps({
            "summary": method, "nodes_per_pass": args.nodes + 1 if method != "none" else 1,
            "mean_decode_tokens_per_s": round(statistics.mean(m.decode_tokens_per_s or 0 for m in ms), 3),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "target_ms_per_pass": round(sum(m.target_ms for m in ms) / sum(m.num_target_forwards for m in ms), 1),
            "draft_ms_total": round(sum(m.draft_ms for m in ms)),
        }))


if __name__ == "__main__":
    main()
