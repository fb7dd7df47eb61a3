"""Issue-2 measurement: plain vs draft-model speculation on HumanEval dev prompts, one run.

Usage: python scripts/measure_core.py --dtype float32 --prompts 3 --max-tokens 64
Prints one JSON line per (prompt, method) and a summary; greedy, so token ids must match.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from verispec.engine import SpeculativeConfig
from verispec.pipeline import SpeculativePipeline, peak_rss_bytes
from verispec.sampling import SamplingParams

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "humaneval_dev.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=5)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[: args.prompts]]
    pipe = SpeculativePipeline.load(dtype=args.dtype)
    for summary in pipe.model_summaries():
        print(json.dumps({"model": vars(summary)}))
    params = SamplingParams(max_tokens=args.max_tokens)
    pipe.generate("def warmup():", SamplingParams(max_tokens=4), SpeculativeConfig(num_speculative_tokens=args.k))
    rates: dict[str, list[float]] = {"none": [], "draft": []}
    for i, prompt in enumerate(prompts):
        outs = {}
        for method in ("none", "draft"):  # interleaved prompt by prompt
            out = pipe.generate(prompt, params, SpeculativeConfig(method=method, num_speculative_tokens=args.k))
            outs[method] = out
            m = out.metrics
            rates[method].append(m.decode_tokens_per_s)
            print(json.dumps({
                "prompt": i, "method": method, "dtype": args.dtype, "output_tokens": m.output_tokens,
                "decode_tokens_per_s": round(m.decode_tokens_per_s, 3), "total_tokens_per_s": round(m.total_tokens_per_s, 3),
                "ttft_ms": round(m.ttft_ms, 1), "acceptance_rate": m.spec.acceptance_rate,
                "mean_acceptance_length": m.spec.mean_acceptance_length,
                "target_ms": round(m.target_ms), "draft_ms": round(m.draft_ms),
            }))
        print(json.dumps({"prompt": i, "identical_token_ids": outs["none"].token_ids == outs["draft"].token_ids}))
    print(json.dumps({
        "dtype": args.dtype,
        "mean_decode_tokens_per_s": {k: round(statistics.mean(v), 3) for k, v in rates.items()},
        "speedup_per_prompt": [round(d / n, 3) for n, d in zip(rates["none"], rates["draft"])],
        "peak_rss_mib": round(peak_rss_bytes() / 2**20),
    }))


if __name__ == "__main__":
    main()
