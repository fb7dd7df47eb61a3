"""Suffix drafting on a repeated request: tokens per target pass of asks 1, 2 and 3 of one prompt.

Issue 44, item 13 (customer service's fixed phrasing, asked again): one held-out prompt (a
HumanEval dev prompt) through ``pipe.generate(prompt, method="suffix", k=8)`` three times in a row,
the suffix cache starting empty, once under the ``cost`` schedule (the default) and once under
``constant``. Prints per ask the drafts, drafted and accepted tokens, the mean draft length, the
tokens per pass (mean acceptance length: 1 + accepted / drafts) and whether the output equals
plain decoding's. Counts only, no timing: safe to run beside other work. But the ``cost``
schedule sizes drafts from the costs it measures, and on a shared host those swing (a pass slowed
by another process makes long drafts look dear), so ``--frozen-costs MS`` fixes the curve instead:
ms per target pass of 1, 2, 4, 8, 16 new tokens, frozen (default: the AVX-512 curve of a Xeon host,
issue 48: 68.9, 52.4, 59.6, 74.4, 115.7). Run:
``.venv/bin/python scripts/suffix_repeat.py [--prompt-index 0] [--max-tokens 128] [--frozen-costs]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verispec.algorithms.control import CostModel, interpolate
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import SpeculativePipeline
from verispec.proposers.suffix import SuffixCache
from verispec.runners.select import RunnerOptions

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "humaneval_dev.jsonl"
XEON_AVX512_MS = "68.9,52.4,59.6,74.4,115.7"  # k = 1, 2, 4, 8, 16 new tokens (issue 48, 2026-12-05)


def frozen_costs(text: str) -> CostModel:
    """A cost model that keeps the given curve (weight 0): ms per pass of 1, 2, 4, 8, 16 new tokens,
    every k in between interpolated (a key it lacks would take the first measurement), and a
    lookup's draft cost per token at 0.0005 of a pass (measured here: 0.00015-0.00046)."""
    ms = [float(v) for v in text.split(",")]
    points = {tokens - 1: v / 1e3 for tokens, v in zip((1, 2, 4, 8, 16), ms)}
    verify_s = {k: interpolate(points, k) for k in range(17)}
    lookups = {name: 0.0005 for name in ("suffix", "suffix-tree")}
    return CostModel(
        weight=0.0,
        verify_s=verify_s,
        draft_ratio=dict(lookups),
        draft_token_s={name: ratio * verify_s[0] for name, ratio in lookups.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", default="gguf")
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--asks", type=int, default=3)
    parser.add_argument("--schedules", default="cost,constant")
    parser.add_argument("--verbose", action="store_true", help="also the draft length chosen at each step")
    parser.add_argument(
        "--frozen-costs",
        nargs="?",
        const=XEON_AVX512_MS,
        default=None,
        help="ms per pass of 1,2,4,8,16 new tokens, kept fixed (bare flag: a Xeon's AVX-512 curve)",
    )
    args = parser.parse_args()
    pipe = SpeculativePipeline.load(draft=None, runners=RunnerOptions(kind=args.runner))
    prompt = [json.loads(line)["prompt"] for line in DATA.open()][args.prompt_index]
    params = SamplingParams(max_tokens=args.max_tokens)
    plain = pipe.generate(prompt, params, SpeculativeConfig(method="none"), learn=False).token_ids
    suffix = pipe.engine.proposers["suffix"]
    costs = f"frozen costs {args.frozen_costs} ms" if args.frozen_costs else "measured costs"
    print(f"prompt {args.prompt_index}, {len(plain)} tokens of plain decoding, k = {args.k}, {costs}")
    print("schedule | ask | drafter(s) | drafts | drafted | accepted | mean draft length | tokens per pass | = plain")
    for schedule in args.schedules.split(","):
        old = suffix.cache
        suffix.cache = SuffixCache(old.max_tokens, old.min_ngram, old.max_ngram, old.max_occurrences)
        if args.frozen_costs:
            pipe.engine.cost_model = frozen_costs(args.frozen_costs)
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=args.k, schedule=schedule)
        for ask in range(1, args.asks + 1):
            out = pipe.generate(prompt, params, spec)
            s = out.metrics.spec
            drafters = ",".join(sorted(s.per_drafter)) or "-"
            length = s.num_draft_tokens / s.num_drafts if s.num_drafts else 0.0
            per_pass = 1.0 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else 1.0
            print(
                f"{schedule} | {ask} | {drafters} | {s.num_drafts} | {s.num_draft_tokens} | {s.num_accepted_tokens} | "
                f"{length:.2f} | {per_pass:.2f} | {out.token_ids == plain}"
            )
            if args.verbose:
                print("   chosen k per step:", s.chosen_k)


if __name__ == "__main__":
    main()
