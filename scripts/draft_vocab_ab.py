"""The reduced draft vocabulary (FR-Spec) against the full draft head, interleaved (issue 55).

Loads the default pair once per draft head (``full`` and each HEAD given: ``SIZE`` the lowest SIZE
BPE ranks, ``--draft-vocab``; ``SIZE+ctx`` the same plus each sequence's own tokens' rows, the gguf
default at 32768+ctx), every head's drafters over the first target runner (one
placement of its weights in memory: on this host two loads of the same file decode at different
speeds) with their own cost models, then for each dev prompt (HumanEval 0-9, Spec-Bench 2 per
task) runs plain decoding once and each METHOD on every head size in turn, greedy, 128 tokens, so
a drift of the host's speed hits every size alike. Per workload and size: output tokens/s end to
end over plain's, the draft model's acceptance rate α, the draft's seconds a drafted token, and
whether every output equals plain decoding's.

Run it alone: ``../shared/tools/alone .venv/bin/python scripts/draft_vocab_ab.py [HEAD ...]``
(default 32768 32768+ctx; METHODS: draft and auto).
"""

from __future__ import annotations

import copy
import sys
import time
from collections import defaultdict

from verispec import SamplingParams, SpeculativeConfig, SpeculativePipeline
from verispec.bench.run import encode
from verispec.bench.workload import load_workload
from verispec.runners.select import RunnerOptions

METHODS = ("draft", "auto")


def head_options(head: str | None) -> RunnerOptions:
    """``None``: the full head; ``"N"``: N rows; ``"N+ctx"``: N rows and each sequence's tokens' rows."""
    if head is None:
        return RunnerOptions(kind="gguf", draft_vocab_size=0)
    size, _, context = head.partition("+")
    return RunnerOptions(kind="gguf", draft_vocab_size=int(size), draft_context_rows=context == "ctx")


def main() -> None:
    sizes = [None] + (sys.argv[1:] or ["32768", "32768+ctx"])
    pipes = {size: SpeculativePipeline.load(runners=head_options(size), prefix_cache_gib=0) for size in sizes}
    base = pipes[None].engine
    engines = {None: base}
    for size in sizes[1:]:  # one target runner for all (its weights' placement in memory alike), own drafters and costs
        engines[size] = base.with_proposers(pipes[size].engine.proposers)
        engines[size].cost_model = copy.deepcopy(pipes[size].engine.cost_model)
    workloads = {"code": load_workload("humaneval", limit=10), "chat": load_workload("specbench", limit=2)}
    params = SamplingParams(max_tokens=128)
    for name, items in workloads.items():
        totals = defaultdict(float)  # (size, method, key) -> sum
        for index, item in enumerate(items):
            ids = encode(pipes[None], item, None)
            start = time.perf_counter()
            plain = base.generate(ids, params, SpeculativeConfig(method="none"), learn=False)
            totals["plain_s"] += time.perf_counter() - start
            totals["tokens"] += len(plain.token_ids)
            for method in METHODS:
                for size in sizes[index % len(sizes) :] + sizes[: index % len(sizes)]:  # each size first in turn
                    start = time.perf_counter()
                    out = engines[size].generate(ids, params, SpeculativeConfig(method=method), learn=False)
                    seconds = time.perf_counter() - start
                    stats = out.metrics.spec.per_drafter.get("draft")
                    totals[size, method, "s"] += seconds
                    totals[size, method, "draft_ms"] += out.metrics.draft_ms
                    totals[size, method, "drafted"] += stats.num_draft_tokens if stats else 0
                    totals[size, method, "accepted"] += stats.num_accepted_tokens if stats else 0
                    totals[size, method, "same"] += out.token_ids == plain.token_ids
        plain_rate = totals["tokens"] / totals["plain_s"]
        print(f"\n{name}: {len(items)} prompts, {int(totals['tokens'])} tokens, plain {plain_rate:.2f} tok/s")
        print("| draft head | method | tok/s | vs plain | draft α | draft ms a drafted token | identical |")
        print("|---|---|---|---|---|---|---|")
        for method in METHODS:
            for size in sizes:
                s, drafted = totals[size, method, "s"], totals[size, method, "drafted"]
                alpha = totals[size, method, "accepted"] / drafted if drafted else float("nan")
                per_token = totals[size, method, "draft_ms"] / drafted if drafted else float("nan")
                print(
                    f"| {size or 'full'} | {method} | {totals['tokens'] / s:.2f} | {totals['plain_s'] / s:.2f}x | "
                    f"{alpha:.3f} | {per_token:.2f} | {int(totals[size, method, 'same'])}/{len(items)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
