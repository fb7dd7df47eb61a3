"""Suffix drafting on all of Spec-Bench, in file order: per-category speedup over plain decoding.

Every question (the first turn, chat template, greedy, ``--max-tokens`` new tokens) is asked of
each configuration in turn before the next question, so that a slow or fast minute of the
machine falls on all of them alike (on these shared hosts plain decoding alone drifts by 20 %
over an hour); the order rotates from one question to the next. Configurations:

- ``none``: plain decoding, the reference of every speedup and of every output;
- ``ngram`` and ``suffix``: those drafters alone (cost schedule, up to 8 tokens);
- ``auto-ngram``: ``auto`` with n-gram lookup as its lookup drafter (the library's ``auto``
  before suffix drafting replaced it);
- ``auto-suffix``: ``auto`` as the library has it, the suffix drafter its lookup drafter;
- ``auto-unpriced``: the same without pricing the draft model's catch-up
  (``ControllerConfig(price_catch_up=False)``: ``auto`` before that rule).

Each configuration has its own engine over the same loaded models, so its suffix cache learns
only from its own earlier answers (all configurations' answers are equal to plain decoding's, so
the caches hold the same tokens; none sees a question's answer before answering it), and the
shared draft models' caches are emptied before every run (no configuration finds the prompt
already prefilled by the one before it). Results go
to ``--out`` (JSON lines, one per question and configuration) as they come; a run that stops
resumes where it stopped, its caches rebuilt from the recorded answers. Run alone:
``../shared/tools/alone .venv/bin/python scripts/specbench_suffix.py`` (about 2 hours on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from pathlib import Path

from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeEngine
from verispec.engine.loader import SpeculativePipeline
from verispec.engine.request import SpeculativeConfig
from verispec.proposers.suffix import SuffixCache, SuffixProposer
from verispec.runners.select import RunnerOptions

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench_questions.jsonl"
CONFIGS = ("none", "ngram", "suffix", "auto-ngram", "auto-suffix", "auto-unpriced")
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def task(category: str) -> str:
    """Spec-Bench's task of a question: its 8 MT-bench categories form ``mt_bench``."""
    return "mt_bench" if category in MT_BENCH else category


def engines(pipe: SpeculativePipeline, names) -> dict[str, tuple[SpeculativeEngine, SuffixCache, SpeculativeConfig]]:
    """One engine per configuration over ``pipe``'s models, each with an empty suffix cache."""
    base = pipe.engine
    models = {k: v for k, v in base.proposers.items() if k not in ("ngram-tree", "suffix", "suffix-tree")}
    out = {}
    for name in names:
        cache = SuffixCache()
        suffix = SuffixProposer(cache)
        proposers = {**models, "suffix": suffix}
        if name == "auto-ngram":  # auto's lookup drafter is whatever is loaded as "suffix"
            proposers["suffix"] = models["ngram"]
        controller = dataclasses.replace(base.controller, price_catch_up=name != "auto-unpriced")
        engine = SpeculativeEngine(
            base.target, base.tokenizer, eos_token_ids=base.eos_token_ids, proposers=proposers, controller=controller
        )
        method = {"auto-ngram": "auto", "auto-suffix": "auto", "auto-unpriced": "auto"}.get(name, name)
        out[name] = (engine, cache, SpeculativeConfig(method=method, schedule="cost", num_speculative_tokens=8))
    return out


def forget_drafts(engine: SpeculativeEngine) -> None:
    """Empty every draft model's KV cache: the configurations share the draft models, and one
    must not find the prompt already prefilled by the one before it (a head start of the draft's
    catch-up prefill, the cost ``draft_context_window`` trades against)."""
    for proposer in engine.proposers.values():
        if hasattr(proposer, "cached_token_ids") and hasattr(proposer, "runner"):
            proposer.runner.truncate(0)
            proposer.cached_token_ids = []


def summarize(records: list[dict], names) -> list[dict]:
    """Per task (and overall) speedups over ``none``: decode tokens/s and end-to-end."""
    agg = collections.defaultdict(lambda: collections.Counter())
    for r in records:
        for key in (task(r["category"]), "all"):
            a = agg[(key, r["config"])]
            a["n"] += 1
            a["tokens"] += r["tokens"]
            a["decode_s"] += r["decode_s"]
            a["e2e_s"] += r["e2e_s"]
            a["drafted"] += r["drafted"]
            a["accepted"] += r["accepted"]
            a["identical"] += r["identical"]
    rows = []
    for (key, name), a in agg.items():
        plain = agg[(key, "none")]
        rows.append(
            {
                "category": key,
                "config": name,
                "questions": a["n"],
                "tokens": a["tokens"],
                "decode_tokens_per_s": round(a["tokens"] / a["decode_s"], 2),
                "decode_speedup": round((a["tokens"] / a["decode_s"]) / (plain["tokens"] / plain["decode_s"]), 3),
                "e2e_speedup": round((a["tokens"] / a["e2e_s"]) / (plain["tokens"] / plain["e2e_s"]), 3),
                "acceptance_rate": round(a["accepted"] / a["drafted"], 3) if a["drafted"] else None,
                "identical": f"{a['identical']}/{a['n']}",
            }
        )
    order = {n: i for i, n in enumerate(names)}
    cats = list(dict.fromkeys(task(r["category"]) for r in records)) + ["all"]
    return sorted(rows, key=lambda r: (cats.index(r["category"]), order[r["config"]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", default="gguf")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions (a smoke run)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument(
        "--tasks", default=None, help="only these tasks, comma-separated (e.g. translation,qa: a quick check)"
    )
    parser.add_argument("--out", default="specbench_suffix.jsonl")
    args = parser.parse_args()
    names = args.configs.split(",")
    if names[0] != "none" or not set(names) <= set(CONFIGS):
        parser.error(f"--configs: 'none' first, then any of {', '.join(CONFIGS[1:])}")
    questions = [json.loads(line) for line in DATA.open()][: args.limit]
    if args.tasks:  # the others become empty slots: indices (and so resumed records) stay those of the file
        wanted = set(args.tasks.split(","))
        questions = [q if task(q["category"]) in wanted else None for q in questions]
    out = Path(args.out)
    done = [json.loads(line) for line in out.open()] if out.exists() else []
    complete = {
        q for q in {r["question"] for r in done} if {r["config"] for r in done if r["question"] == q} >= set(names)
    }
    done = [r for r in done if r["question"] in complete]  # a question cut short is asked again, whole
    if out.exists():
        out.write_text("".join(json.dumps(r) + "\n" for r in done))
    done = [r for r in done if r["config"] in names]  # other configurations' records stay in the file
    pipe = SpeculativePipeline.load(runners=RunnerOptions(kind=args.runner))
    runs = engines(pipe, names)
    answered = collections.defaultdict(dict)
    for r in done:
        answered[r["question"]][r["config"]] = r
    params = SamplingParams(max_tokens=args.max_tokens)
    pipe.engine.generate(pipe.encode("def f(x):"), SamplingParams(max_tokens=8))  # warm-up
    with out.open("a") as sink:
        for index, q in enumerate(questions):
            if q is None:
                continue
            previous = answered.get(index, {})
            if set(previous) >= set(names):
                for _, cache, _ in runs.values():
                    cache.add(previous["none"]["output_token_ids"])
                continue
            ids = pipe.encode(q["turns"][0], chat=True)
            shift = index % len(names)  # the order rotates: no configuration always runs first or last
            results = {}
            for name in names[shift:] + names[:shift]:
                engine, cache, spec = runs[name]
                forget_drafts(engine)  # every configuration starts each question with a cold draft
                start = time.perf_counter()
                results[name] = (engine.generate(ids, params, spec), time.perf_counter() - start)
            plain_ids = results["none"][0].token_ids
            for name in names:
                result, e2e = results[name]
                m = result.metrics
                record = {
                    "question": index,
                    "category": q["category"],
                    "config": name,
                    "prompt_tokens": len(ids),
                    "tokens": len(result.token_ids),
                    "e2e_s": e2e,
                    "decode_s": (m.e2e_ms - m.ttft_ms) / 1e3,
                    "drafted": m.spec.num_draft_tokens,
                    "accepted": m.spec.num_accepted_tokens,
                    "identical": result.token_ids == plain_ids,
                }
                if name == "none":
                    record["output_token_ids"] = result.token_ids
                sink.write(json.dumps(record) + "\n")
                done.append(record)
            sink.flush()
            print(f"{index + 1}/{len(questions)} {q['category']}", flush=True)
    rows = summarize(done, names)
    print(
        "| category | config | questions | output tokens | decode tokens/s | decode speedup | e2e speedup "
        "| acceptance rate | identical to plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['category']} | {r['config']} | {r['questions']} | {r['tokens']} | {r['decode_tokens_per_s']} | "
            f"{r['decode_speedup']} | {r['e2e_speedup']} | {r['acceptance_rate']} | {r['identical']} |"
        )
    out.with_suffix(".summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
