"""Suffix drafting on a repeated request: tokens per target pass of asks 1, 2 and 3 of one prompt.

Issue 44, item 13 (customer service's fixed phrasing, asked again): one held-out prompt (a
HumanEval dev prompt) through ``pipe.generate(prompt, method="suffix", k=8)`` three times in a row,
the suffix cache starting empty, once under the ``cost`` schedule (the default) and once under
``constant``. Prints per ask the drafts, drafted and accepted tokens, the mean draft length, the
tokens per pass (mean acceptance length: 1 + accepted / drafts) and whether the output equals
plain decoding's. Counts only, no timing: safe to run beside other work. Run:
``.venv/bin/python scripts/suffix_repeat.py [--prompt-index 0] [--max-tokens 128]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verispec.engine import SpeculativeConfig
from verispec.engine.loader import SpeculativePipeline
from verispec.proposers.suffix import SuffixCache
from verispec.runners.select import RunnerOptions
from verispec.spec.sampling import SamplingParams

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "humaneval_dev.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", default="gguf")
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--asks", type=int, default=3)
    parser.add_argument("--schedules", default="cost,constant")
    parser.add_argument("--verbose", action="store_true", help="also the draft length chosen at each step")
    args = parser.parse_args()
    pipe = SpeculativePipeline.load(draft=None, runners=RunnerOptions(kind=args.runner))
    prompt = [json.loads(line)["prompt"] for line in DATA.open()][args.prompt_index]
    params = SamplingParams(max_tokens=args.max_tokens)
    plain = pipe.generate(prompt, params, SpeculativeConfig(method="none"), learn=False).token_ids
    suffix = pipe.engine.proposers["suffix"]
    print(f"prompt {args.prompt_index}, {len(plain)} tokens of plain decoding, k = {args.k}")
    print("schedule | ask | drafter(s) | drafts | drafted | accepted | mean draft length | tokens per pass | = plain")
    for schedule in args.schedules.split(","):
        old = suffix.cache
        suffix.cache = SuffixCache(old.max_tokens, old.min_ngram, old.max_ngram, old.max_occurrences)
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=args.k, schedule=schedule)
        for ask in range(1, args.asks + 1):
            out = pipe.generate(prompt, params, spec)
            s = out.metrics.spec
            drafters = ",".join(sorted(s.per_drafter)) or "-"
            length = s.num_draft_tokens / s.num_drafts if s.num_drafts else 0.0
            per_pass = 1.0 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else 1.0
            print(f"{schedule} | {ask} | {drafters} | {s.num_drafts} | {s.num_draft_tokens} | {s.num_accepted_tokens} | "
                  f"{length:.2f} | {per_pass:.2f} | {out.token_ids == plain}")
            if args.verbose:
                print("   chosen k per step:", s.chosen_k)


if __name__ == "__main__":
    main()
