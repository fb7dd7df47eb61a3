"""The prefix cache stays under its budget: many distinct long prompts through the library, RSS measured.

Loads the default pair (gguf runner) with ``--prefix-cache-gib`` (default 0.25), then runs
``--prompts`` distinct prompts of about ``--words`` words each (the support policy's sections in
a different order behind a different ticket number, so no two share their first block), one
output token each, plain decoding. After every request it records the process's RSS and the
cache's bytes; it prints the RSS before the first request and at most, the RSS when the cache first
reaches 90 % of its budget and its growth after that (evicting from then on), the cache's largest
size against its budget, and the blocks evicted.

Run it alone: ``../shared/tools/alone .venv/bin/python scripts/prefix_cache_memory.py``.
"""

from __future__ import annotations

import argparse
import json
import random

from verispec.algorithms.sampling import SamplingParams
from verispec.bench.sessions import support_policy
from verispec.engine.loader import SpeculativePipeline
from verispec.engine.request import SpeculativeConfig
from verispec.metrics import current_rss_bytes


def prompts(count: int, words: int, seed: int = 0) -> list[str]:
    sections = [s for s in support_policy().split("\n\n") if s.strip()]
    rng = random.Random(seed)
    out = []
    for i in range(count):
        order = sections[:]
        rng.shuffle(order)
        text = f"Ticket {i:04d}-{rng.randrange(10**6):06d}. " + " ".join(" ".join(order).split()[:words])
        out.append(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--words", type=int, default=260)
    parser.add_argument("--gib", type=float, default=0.25)
    parser.add_argument("--out", default="prefix_cache_memory.json")
    args = parser.parse_args()
    pipe = SpeculativePipeline.load(prefix_cache_gib=args.gib)
    print(pipe.prefix_cache_summary(), flush=True)
    cache = pipe.prefix_cache  # None with --gib 0: the baseline, what the requests take without a cache
    pipe.generate("def warm_up():", SamplingParams(max_tokens=4), SpeculativeConfig(method="none"))
    if cache is not None:
        cache.clear()
    start_rss = current_rss_bytes()
    rows = []
    for i, text in enumerate(prompts(args.prompts, args.words)):
        out = pipe.generate(text, SamplingParams(max_tokens=1), SpeculativeConfig(method="none"))
        rows.append(
            {
                "request": i,
                "prompt_tokens": out.metrics.prompt_tokens,
                "cached_tokens": out.metrics.cached_tokens,
                "rss_bytes": current_rss_bytes(),
                "cache_bytes": 0 if cache is None else cache.num_bytes,
                "blocks": 0 if cache is None else len(cache),
            }
        )
        if i % 20 == 0:
            print(json.dumps(rows[-1]), flush=True)
    budget = 0 if cache is None else cache.budget_bytes
    full = next((i for i, r in enumerate(rows) if r["cache_bytes"] >= 0.9 * budget), len(rows) - 1)
    settled = rows[full]["rss_bytes"]
    later = max(r["rss_bytes"] for r in rows[full:])
    summary = {
        "rss_before_mib": round(start_rss / 2**20),
        "rss_max_mib": round(max(r["rss_bytes"] for r in rows) / 2**20),
        "rss_growth_max_mib": round((max(r["rss_bytes"] for r in rows) - start_rss) / 2**20),
        "cache_full_at_request": full,
        "prompts": len(rows),
        "prompt_tokens_mean": round(sum(r["prompt_tokens"] for r in rows) / len(rows)),
        "budget_mib": round(budget / 2**20, 1),
        "cache_max_mib": round(max(r["cache_bytes"] for r in rows) / 2**20, 1),
        "evicted_blocks": 0 if cache is None else cache.stats.evicted_blocks,
        "rss_when_full_mib": round(settled / 2**20),
        "rss_growth_after_full_mib": round((later - settled) / 2**20),
        "rss_last_mib": round(rows[-1]["rss_bytes"] / 2**20),
    }
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
