"""Suffix drafting vs n-gram lookup on returning users: HumanEval dev prompts, each asked twice.

For each method (plain ``none``, ``ngram``, ``suffix``) the suffix cache starts empty, then every
prompt is asked twice in a row (pass 1, then pass 2: the same request again, as a returning
user); with ``--datastore DIR``, ``suffix`` once more reading that corpus too. Greedy,
``--max-tokens`` new tokens, one engine, alone on the machine. Prints tokens/s of
each pass, the speedup over plain decoding's same pass, acceptance and whether every output
equals plain decoding's. Run: ``../shared/tools/alone python scripts/suffix_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import SpeculativePipeline
from verispec.proposers.datastore import Datastore
from verispec.proposers.suffix import SuffixCache
from verispec.runners.select import RunnerOptions

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "humaneval_dev.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", default="gguf")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default="none,ngram,suffix")
    parser.add_argument(
        "--datastore", default=None, help="also run suffix with this datastore (verispec datastore build)"
    )
    parser.add_argument("--out", default="suffix_bench.json")
    args = parser.parse_args()
    pipe = SpeculativePipeline.load(runners=RunnerOptions(kind=args.runner))
    prompts = [json.loads(line)["prompt"] for line in DATA.open()][: args.num_prompts]
    params = SamplingParams(max_tokens=args.max_tokens)
    pipe.engine.generate(pipe.encode(prompts[-1]), SamplingParams(max_tokens=8))  # warm-up
    suffix = pipe.engine.proposers["suffix"]
    rows, plain = [], {}
    runs = [(m, None) for m in args.methods.split(",")] + ([("suffix", args.datastore)] if args.datastore else [])
    for method, datastore in runs:
        suffix.cache = SuffixCache(suffix.cache.max_tokens, suffix.cache.min_ngram, suffix.cache.max_ngram)
        suffix.datastore = Datastore(datastore) if datastore else None
        spec = SpeculativeConfig(method=method, schedule="cost", num_speculative_tokens=8)
        passes = {1: [], 2: []}
        seconds = {1: 0.0, 2: 0.0}
        for prompt in prompts:
            ids = pipe.encode(prompt)
            for p in (1, 2):
                start = time.perf_counter()
                passes[p].append(pipe.engine.generate(ids, params, spec))
                seconds[p] += time.perf_counter() - start
        for p in (1, 2):
            outs = passes[p]
            tokens = sum(len(o.token_ids) for o in outs)
            drafted = sum(o.metrics.spec.num_draft_tokens for o in outs)
            accepted = sum(o.metrics.spec.num_accepted_tokens for o in outs)
            if method == "none":
                plain[p] = (tokens / seconds[p], [o.token_ids for o in outs])
            row = {
                "method": method + ("+datastore" if datastore else ""),
                "pass": p,
                "tokens": tokens,
                "seconds": round(seconds[p], 2),
                "tokens_per_s": round(tokens / seconds[p], 2),
                "speedup_vs_plain": round(tokens / seconds[p] / plain[p][0], 3) if p in plain else None,
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                "identical_to_plain": sum(o.token_ids == t for o, t in zip(outs, plain[p][1])) if p in plain else None,
            }
            rows.append(row)
    print(
        "| method | pass | output tokens | seconds | tokens/s | speedup vs plain (same pass) | acceptance rate "
        "| identical to plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['pass']} | {r['tokens']} | {r['seconds']} | {r['tokens_per_s']} "
            f"| {r['speedup_vs_plain']} | {r['acceptance_rate']} | {r['identical_to_plain']}/{len(prompts)} |"
        )
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
