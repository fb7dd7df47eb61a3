"""Issue-3 measurement: plain decoding vs every drafter on the real pair, in one run.

Usage (one real-model process at a time on a shared machine):

    flock /tmp/verispec-real-model.lock .venv/bin/python scripts/measure_drafters.py \
        --dtype bfloat16 --prompts 10 --max-tokens 64

HumanEval dev prompts are raw code prompts; SpecBench ``summarization`` prompts (first turn) go
through the chat template. Methods run interleaved prompt by prompt, greedy, so every method's
token ids should equal plain decoding's (checked; where they differ, the row gives the first
differing position and the target's top-2 logit margin there). The int8 draft runs in a second
phase, after the draft's weights are quantized in place, with plain decoding measured again. Layer skip is also swept over several depths
by teacher forcing: the early-exit argmax after each prefix of plain decoding's output, compared
with the target's token, is exactly greedy per-token acceptance. Prints one JSON line per run and
markdown tables at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from verispec.control import expected_tokens
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.pipeline import DrafterOptions, SpeculativePipeline, peak_rss_bytes
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners.quantize import quantize_linear_layers
from verispec.runners.torch_runner import TransformersRunner
from verispec.sampling import SamplingParams

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def load_prompts(num: int) -> dict[str, list[str]]:
    humaneval = [json.loads(line)["prompt"] for line in (DATA / "humaneval_dev.jsonl").read_text().splitlines()]
    questions = [json.loads(line) for line in (DATA / "specbench_questions.jsonl").read_text().splitlines()]
    summaries = [q["turns"][0] for q in questions if q["category"] == "summarization"]
    return {"humaneval": humaneval[:num], "summarization": summaries[:num]}


def run_methods(args) -> list[tuple[str, SpeculativeConfig]]:
    """(label, config) of each configuration measured with the unquantized draft."""
    k = args.k
    constant = []
    if args.constant_k:
        constant = [(f"draft k={args.constant_k} const", SpeculativeConfig(method="draft", num_speculative_tokens=args.constant_k))]
    return [
        ("plain", SpeculativeConfig(method="none")),
        *constant,
        (f"draft cost K={k}", SpeculativeConfig(method="draft", num_speculative_tokens=k, schedule="cost")),
        (f"ngram cost K={k}", SpeculativeConfig(method="ngram", num_speculative_tokens=k, schedule="cost")),
        (f"layer-skip L={args.layer_skip_layers} cost K={k}", SpeculativeConfig(method="layer-skip", num_speculative_tokens=k, schedule="cost")),
        (f"auto cost K={k}", SpeculativeConfig(method="auto", num_speculative_tokens=k, schedule="cost")),
    ]


def int8_methods(args) -> list[tuple[str, SpeculativeConfig]]:
    """Phase 2, after the draft's weights were quantized in place: plain again, then int8 drafting."""
    return [
        ("plain (int8 phase)", SpeculativeConfig(method="none")),
        (f"draft-int8 cost K={args.k}", SpeculativeConfig(method="draft", num_speculative_tokens=args.k, schedule="cost")),
    ]


@torch.inference_mode()
def divergence(model, prompt_ids: list[int], plain_ids: list[int], other_ids: list[int]) -> dict:
    """Where ``other_ids`` first leaves plain decoding's output, and the target's margin there.

    The margin (top-1 minus top-2 logit of the target after the common prefix, from one
    prefill) tells a numerical near-tie (bf16 rounding differs between a 1-token decode pass
    and a k-token verify pass) from a real error.
    """
    first = next((i for i, (a, b) in enumerate(zip(plain_ids, other_ids)) if a != b), min(len(plain_ids), len(other_ids)))
    logits = TransformersRunner(model).forward(prompt_ids + plain_ids[:first], num_logits=1)[0]
    top = torch.topk(logits.float(), 2).values
    return {"first_diff": first, "target_margin_at_diff": round(float(top[0] - top[1]), 4)}


@torch.inference_mode()
def teacher_forced_acceptance(model, depths: list[int], prompt_ids: list[int], output_ids: list[int]) -> dict[int, int]:
    """Matches per depth L: argmax of norm + LM head after layer L vs the target's next token.

    One target forward with all hidden states gives every depth at once; that is what
    ``early_exit_model(model, L)`` computes (checked on a tiny model: identical logits).
    """
    context = torch.tensor([prompt_ids + output_ids[:-1]])
    hidden = model(context, output_hidden_states=True).hidden_states
    target = torch.tensor(output_ids)
    matches = {}
    for L in depths:
        logits = model.lm_head(model.model.norm(hidden[L][0, -len(output_ids) :]))
        matches[L] = int((logits.argmax(-1) == target).sum())
    return matches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=8, help="upper bound of the cost schedule")
    parser.add_argument("--constant-k", type=int, default=0, help="also run the draft model with this constant k")
    parser.add_argument("--layer-skip-layers", type=int, default=14)
    parser.add_argument("--sweep", default="4,7,14,21,24,26", help="layer-skip depths for teacher-forced acceptance")
    args = parser.parse_args()
    torch.set_num_threads(2)
    start_all = time.perf_counter()
    prompts = load_prompts(args.prompts)
    drafters = DrafterOptions(layer_skip_layers=args.layer_skip_layers)
    pipe = SpeculativePipeline.load(dtype=args.dtype, drafters=drafters)
    print(json.dumps({"models": [vars(m) for m in pipe.model_summaries()], "load_s": round(time.perf_counter() - start_all, 1)}))
    params = SamplingParams(max_tokens=args.max_tokens)
    sweep = [int(x) for x in args.sweep.split(",") if x]
    rows: list[dict] = []
    tf = {L: Counter() for L in sweep}
    methods = run_methods(args)
    run_phase(pipe, pipe.engine, methods, prompts, params, rows, tf)
    # Phase 2: the same draft weights, quantized in place (a second draft would not fit in memory
    # next to the other engineers' processes), with plain decoding measured again alongside.
    quantize_linear_layers(pipe.draft.model, "int8")
    int8_engine = SpeculativeEngine(
        pipe.engine.target, pipe.tokenizer, eos_token_ids=pipe.target.eos_token_ids,
        proposers={"draft": DraftModelProposer(TransformersRunner(pipe.draft.model, max_context_length=pipe.draft.context_length))},
    )
    phase2 = int8_methods(args)
    run_phase(pipe, int8_engine, phase2, prompts, params, rows, None)
    print_tables(rows, tf, [m[0] for m in methods], [m[0] for m in phase2], args)
    print(json.dumps({"wall_s": round(time.perf_counter() - start_all, 1), "peak_rss_mib": round(peak_rss_bytes() / 2**20)}))


def run_phase(pipe, engine, methods, prompts, params, rows: list[dict], tf: dict | None) -> None:
    """Every method on every prompt, interleaved prompt by prompt; appends one row per run."""
    warm = pipe.encode("def warmup():")
    for _, spec in methods:
        engine.generate(warm, SamplingParams(max_tokens=8), spec)
    for set_name, texts in prompts.items():
        for i, text in enumerate(texts):
            ids = pipe.encode(text, chat=set_name == "summarization")
            plain_ids = None
            for label, spec in methods:
                out = engine.generate(ids, params, spec)
                m, s = out.metrics, out.metrics.spec
                plain_ids = out.token_ids if spec.method == "none" else plain_ids
                row = {
                    "set": set_name, "prompt": i, "method": label, "prompt_tokens": m.prompt_tokens,
                    "output_tokens": m.output_tokens, "decode_s": (m.tpot_ms or 0) * max(m.output_tokens - 1, 0) / 1e3,
                    "decode_tokens_per_s": m.decode_tokens_per_s, "drafts": s.num_drafts, "drafted": s.num_draft_tokens,
                    "accepted": s.num_accepted_tokens, "chosen_k": s.chosen_k,
                    "per_drafter": {n: d.to_dict() for n, d in s.per_drafter.items()},
                    "predicted": [s.predicted_tokens, s.predicted_cost], "realised": [s.realised_tokens, s.realised_cost],
                    "identical": out.token_ids == plain_ids,
                }
                if not row["identical"]:
                    row.update(divergence(pipe.target.model, ids, plain_ids, out.token_ids))
                rows.append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            if tf is not None:
                for L, matches in teacher_forced_acceptance(pipe.target.model, list(tf), ids, plain_ids).items():
                    tf[L][set_name + "/matches"] += matches
                    tf[L][set_name + "/positions"] += len(plain_ids)


def pooled(rows: list[dict]) -> dict:
    decode_tokens = sum(r["output_tokens"] - 1 for r in rows)
    decode_s = sum(r["decode_s"] for r in rows)
    drafts, drafted, accepted = (sum(r[k] for r in rows) for k in ("drafts", "drafted", "accepted"))
    predicted = [sum(r["predicted"][j] for r in rows) for j in (0, 1)]
    realised = [sum(r["realised"][j] for r in rows) for j in (0, 1)]
    ks = Counter(k for r in rows for k in r["chosen_k"])
    per_drafter: dict[str, Counter] = {}
    for r in rows:
        for name, d in r["per_drafter"].items():
            per_drafter.setdefault(name, Counter()).update(
                {"drafts": d["num_drafts"], "drafted": d["num_draft_tokens"], "accepted": d["num_accepted_tokens"]}
            )
    return {
        "tokens_per_s": decode_tokens / decode_s if decode_s else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "chosen_k": dict(sorted(ks.items())),
        "predicted_speedup": predicted[0] / predicted[1] if predicted[1] else None,
        "realised_speedup": realised[0] / realised[1] if realised[1] else None,
        "per_drafter": per_drafter,
        "identical": all(r["identical"] for r in rows),
    }


def fmt(value, pattern="{:.2f}") -> str:
    return "—" if value is None else pattern.format(value)


def print_tables(rows: list[dict], tf: dict, labels: list[str], int8_labels: list[str], args) -> None:
    """Speedups are against the plain decoding row of the same phase (``int8_labels[0]`` for int8)."""
    print(f"\n## Real pair, {args.dtype}, greedy, max_tokens {args.max_tokens}, {args.prompts} prompts per set\n")
    for set_name in ("humaneval", "summarization", "all"):
        selected = [r for r in rows if set_name == "all" or r["set"] == set_name]
        bases = {
            label: pooled([r for r in selected if r["method"] == phase[0]])["tokens_per_s"]
            for phase in (labels, int8_labels)
            for label in phase
        }
        print(f"### {set_name}\n")
        print("| method | tokens/s | speedup | acceptance rate | mean acceptance length | chosen k (k: steps) | predicted / realised speedup | per drafter (drafts/drafted/accepted) | == plain |")
        print("|---|---|---|---|---|---|---|---|---|")
        for label in labels + int8_labels:
            p = pooled([r for r in selected if r["method"] == label])
            base = bases[label]
            per = "; ".join(f"{n} {c['drafts']}/{c['drafted']}/{c['accepted']}" for n, c in sorted(p["per_drafter"].items()))
            ks = " ".join(f"{k}:{v}" for k, v in p["chosen_k"].items()) or "—"
            speedup = p["tokens_per_s"] / base if p["tokens_per_s"] and base else None
            print(
                f"| {label} | {fmt(p['tokens_per_s'])} | {fmt(speedup)} | {fmt(p['acceptance_rate'], '{:.3f}')} | "
                f"{fmt(p['mean_acceptance_length'])} | {ks} | {fmt(p['predicted_speedup'])} / {fmt(p['realised_speedup'])} | "
                f"{per or '—'} | {p['identical']} |"
            )
        print()
    print("### layer skip, teacher-forced greedy acceptance per depth L (of 28)\n")
    print("| L | humaneval α | summarization α | E[tokens/pass] at k=4 (all) |")
    print("|---|---|---|---|")
    for L, c in tf.items():
        rates = [c[f"{s}/matches"] / c[f"{s}/positions"] if c[f"{s}/positions"] else None for s in ("humaneval", "summarization")]
        total = (c["humaneval/matches"] + c["summarization/matches"]) / max(1, c["humaneval/positions"] + c["summarization/positions"])
        print(f"| {L} | {fmt(rates[0], '{:.3f}')} | {fmt(rates[1], '{:.3f}')} | {expected_tokens(total, 4):.2f} |")


if __name__ == "__main__":
    main()
