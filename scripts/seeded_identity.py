"""Seeds x methods on a real pair: does a seed fix the sampled text under every method? (issue 47)

For each temperature, each of ``--seeds`` seeds and each method, one sampled generation of one
prompt (prompt i of the workload for seed i, cycling) is compared token for token with plain
decoding (method ``none``) under the same seed. Prints one row per temperature x method: how many
seeds gave plain's tokens, the acceptance rate and the mean acceptance length over the run. Not a
timing: it may run beside other work.

    python scripts/seeded_identity.py --seeds 20 --temperatures 0.7,1.0 --max-tokens 32
"""

from __future__ import annotations

import argparse

from verispec import SamplingParams, SpeculativeConfig, SpeculativePipeline
from verispec.bench.workload import load_workload
from verispec.metrics import acceptance_rate, mean_acceptance_length
from verispec.runners.select import RunnerOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--workload", default="humaneval")
    parser.add_argument("--methods", default="ngram,suffix,draft,tree,auto")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sampling", default="coupled", choices=["coupled", "rejection"])
    parser.add_argument("--schedule", default="cost", choices=["cost", "constant", "heuristic"])
    args = parser.parse_args()

    pipe = SpeculativePipeline.load(args.target, args.draft, runners=RunnerOptions(kind="gguf"))
    items = load_workload(args.workload, limit=None)
    prompts = [pipe.encode(item.text, chat=item.chat) for item in items[: args.seeds]]
    methods = args.methods.split(",")
    print(f"target {args.target}, draft {args.draft}, {args.workload}, {args.seeds} seeds, {args.sampling} sampling")
    print("| T | method | seeds identical to plain | acceptance rate | mean acceptance length |")
    print("|---|---|---|---|---|")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        plain = {}
        for seed in range(args.seeds):
            params = SamplingParams(
                max_tokens=args.max_tokens,
                temperature=temperature,
                top_p=args.top_p,
                seed=seed,
                sampling=args.sampling,
            )
            prompt = prompts[seed % len(prompts)]
            plain[seed] = (prompt, params, pipe.engine.generate(prompt, params, SpeculativeConfig(method="none")))
        for method in methods:
            same = accepted = drafted = drafts = 0
            spec = SpeculativeConfig(method=method, num_speculative_tokens=5, schedule=args.schedule)
            for prompt, params, reference in plain.values():
                out = pipe.engine.generate(prompt, params, spec)
                same += out.token_ids == reference.token_ids
                accepted += out.metrics.spec.num_accepted_tokens
                drafted += out.metrics.spec.num_draft_tokens
                drafts += out.metrics.spec.num_drafts
            rate, length = acceptance_rate(accepted, drafted), mean_acceptance_length(accepted, drafts)
            print(
                f"| {temperature} | {method} | {same}/{args.seeds} | "
                f"{'-' if rate is None else f'{rate:.2f}'} | {'-' if length is None else f'{length:.2f}'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
