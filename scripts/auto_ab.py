"""``auto`` before and after issue 55's policy changes, interleaved over one target runner.

Loads the default pair once and builds, over the same target runner and draft weights, two
``auto`` engines with their own cost models: ``before`` (the draft tree on a draft sequence of its
own, a lookup drafting whenever it beats plain decoding) and ``after`` (the tree over the draft
chain's sequence, a lookup sitting out the steps a model drafter realises more on), plus the
draft chain alone (``draft``, the best single method on these workloads). For each dev prompt
(HumanEval 0-9, Spec-Bench 2 per task; the demo prompt) it runs plain decoding, then the others,
each first in turn, greedy, 128 tokens, so a drift of the host's speed hits all alike. Prints per
workload: tokens/s end to end (total tokens over total time) and over plain's, catch-up rows fed
by the draft model, lookup steps, and whether every output equals plain decoding's.

Run it alone: ``../shared/tools/alone .venv/bin/python scripts/auto_ab.py [LIMIT]`` (LIMIT: prompts
per workload, default all listed above).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections import defaultdict

from verispec import SamplingParams, SpeculativeConfig, SpeculativePipeline
from verispec.bench.run import encode
from verispec.bench.workload import load_workload
from verispec.engine.policy import DraftPolicy
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.proposers.factory import for_new_sequence

VARIANTS = ("draft", "before", "after")
DEMO = "def fibonacci(n):"


def engines(pipe: SpeculativePipeline) -> dict:
    base = pipe.engine
    after = base.with_proposers(for_new_sequence(base.proposers))
    proposers = for_new_sequence(base.proposers)
    tree = proposers["tree"]
    assert isinstance(tree, DraftTreeProposer) and tree.shares_sequence_with(proposers["draft"])
    proposers["tree"] = tree.new_sequence()  # the same drafter over a draft sequence of its own
    before = base.with_proposers(proposers)
    before.controller = dataclasses.replace(base.controller, lookups_against_models=False)
    chain = base.with_proposers(for_new_sequence(base.proposers))
    out = {"draft": chain, "before": before, "after": after}
    for engine in out.values():
        engine.cost_model = copy.deepcopy(base.cost_model)
    return out


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else None
    pipe = SpeculativePipeline.load(prefix_cache_gib=0)
    variants = engines(pipe)
    rows: defaultdict = defaultdict(int)
    original = DraftPolicy.draft

    def counted(self, request, limit, batch_size=1, defer=()):  # catch-up rows the model drafters feed
        step = original(self, request, limit, batch_size, defer)
        rows["catch_up"] += step.catch_up_rows if step.drafter in ("draft", "tree") else 0
        rows["lookup"] += step.drafter in ("suffix", "ngram")
        return step

    DraftPolicy.draft = counted
    workloads = {
        "code": load_workload("humaneval", limit=10 if limit is None else limit),
        "chat": load_workload("specbench", limit=2 if limit is None else max(1, limit // 6)),
    }
    params = SamplingParams(max_tokens=128)
    for name, items in workloads.items():
        prompts = [encode(pipe, item, None) for item in items]
        if name == "code":
            prompts.append(pipe.encode(DEMO, chat=False))
        totals: defaultdict = defaultdict(float)
        for index, ids in enumerate(prompts):
            start = time.perf_counter()
            plain = pipe.engine.generate(ids, params, SpeculativeConfig(method="none"), learn=False)
            totals["plain_s"] += time.perf_counter() - start
            totals["tokens"] += len(plain.token_ids)
            order = VARIANTS[index % 3 :] + VARIANTS[: index % 3]
            for variant in order:
                method = "draft" if variant == "draft" else "auto"
                rows.clear()
                start = time.perf_counter()
                out = variants[variant].generate(ids, params, SpeculativeConfig(method=method), learn=False)
                totals[variant, "s"] += time.perf_counter() - start
                totals[variant, "catch_up"] += rows["catch_up"]
                totals[variant, "lookup"] += rows["lookup"]
                totals[variant, "same"] += out.token_ids == plain.token_ids
        plain_rate = totals["tokens"] / totals["plain_s"]
        print(f"\n{name}: {len(prompts)} prompts, {int(totals['tokens'])} tokens, plain {plain_rate:.2f} tok/s")
        print("| variant | tok/s | vs plain | catch-up rows | lookup steps | identical |")
        print("|---|---|---|---|---|---|")
        for variant in VARIANTS:
            s = totals[variant, "s"]
            print(
                f"| {variant} | {totals['tokens'] / s:.2f} | {totals['plain_s'] / s:.2f}x | "
                f"{int(totals[variant, 'catch_up'])} | {int(totals[variant, 'lookup'])} | "
                f"{int(totals[variant, 'same'])}/{len(prompts)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
