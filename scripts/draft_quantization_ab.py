"""A/B of the gguf runner's draft re-quantizations, alone, in one run (run from the repo root).

Loads the default pair on the gguf runner, the draft as stored and re-quantized (``q4_0``,
``iq4_nl``, ``iq4_nl`` with the 32k-token FR-Spec head), measures every model's cost curve
(ms per forward of k tokens after 64, median of 7), then decodes HumanEval dev prompts greedily
with plain decoding and ``--method draft -k 4 --schedule constant`` for each draft, taking turns
prompt by prompt, and prints tokens/s, the speedup over plain measured in the same run,
acceptance rate, mean acceptance length, draft ms per drafted token and how many outputs equal
plain's. Usage: ``../shared/tools/alone .venv/bin/python scripts/draft_quantization_ab.py [N] [TOKENS]``.
"""

import sys
import time

from verispec.ops.bench.runner_compare import RunnersBenchConfig, _frspec_rows, load_prompts
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners.costs import measure_cost_curve, seed_cost_model
from verispec.runners.gguf_runner import GGUFRunner, GGUFWeights
from verispec.runners.llamacpp import load_gguf_info
from verispec.runners.weight_cache import default_cache_dir
from verispec.spec.sampling import SamplingParams


def main(num_prompts: int, max_tokens: int) -> None:
    target_info, draft_info = load_gguf_info("qwen2.5-coder-1.5b-instruct"), load_gguf_info("qwen2.5-coder-0.5b-instruct")

    def load(info, label, **options):
        start = time.perf_counter()
        runner = GGUFRunner(GGUFWeights.from_file(info.path, 4096, cache_dir=default_cache_dir(), **options), max_context_length=1024)
        print(f"{label}: loaded in {time.perf_counter() - start:.2f} s, {runner.weights.nbytes() / 1e6:.0f} MB", flush=True)
        return runner

    target = load(target_info, "target")
    rows = _frspec_rows(RunnersBenchConfig(), draft_info, print, "gguf")
    drafts = {
        "as stored": load(draft_info, "as stored"),
        "q4_0": load(draft_info, "q4_0", requantize="q4_0"),
        "iq4_nl": load(draft_info, "iq4_nl", requantize="iq4_nl"),
        "iq4_nl + FR-Spec 32k": load(draft_info, "iq4_nl + FR-Spec 32k", head_token_ids=rows, requantize="iq4_nl"),
    }
    curve = measure_cost_curve(target, runner_name="gguf", model="target", repeats=7)
    print("target cost ms", curve.ms)
    for name, draft in drafts.items():
        c = measure_cost_curve(draft, runner_name="gguf", model=name, repeats=7)
        print(f"draft {name} cost ms {c.ms}, k=1 ratio to the target {c.ms[1] / curve.ms[1]:.3f}", flush=True)
    tokenizer, eos = target_info.tokenizer, tuple(target_info.eos_token_ids)
    prompts = [list(tokenizer.encode(p, add_special_tokens=False)) for p in load_prompts("", num_prompts)]
    engines = {"plain": SpeculativeEngine(target, tokenizer, eos_token_ids=eos)}
    engines.update({n: SpeculativeEngine(target, tokenizer, eos_token_ids=eos, proposers={"draft": DraftModelProposer(d)})
                    for n, d in drafts.items()})
    for engine in engines.values():
        seed_cost_model(engine.cost_model, curve)
    params = SamplingParams(max_tokens=max_tokens)
    totals = {n: dict(tokens=0, seconds=0.0, drafted=0, accepted=0, drafts=0, draft_ms=0.0, same=0) for n in engines}
    names = list(engines)
    for index, prompt in enumerate(prompts):
        outputs = {}
        for name in names[index % len(names):] + names[: index % len(names)]:
            spec = SpeculativeConfig(method="none") if name == "plain" else SpeculativeConfig(
                method="draft", num_speculative_tokens=4, schedule="constant")
            start = time.perf_counter()
            out = engines[name].generate(prompt, params, spec)
            t = totals[name]
            t["seconds"] += time.perf_counter() - start
            t["tokens"] += len(out.token_ids)
            t["drafted"] += out.metrics.spec.num_draft_tokens
            t["accepted"] += out.metrics.spec.num_accepted_tokens
            t["drafts"] += out.metrics.spec.num_drafts
            t["draft_ms"] += out.metrics.draft_ms
            outputs[name] = out.token_ids
        for name in drafts:
            totals[name]["same"] += outputs[name] == outputs["plain"]
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        line = f"{name}: {rate:.2f} tokens/s, {rate / plain_rate:.3f}x plain"
        if name != "plain":
            line += (f", acceptance rate {t['accepted'] / max(t['drafted'], 1):.3f}, mean acceptance length "
                     f"{1 + t['accepted'] / max(t['drafts'], 1):.2f}, draft {t['draft_ms'] / max(t['drafted'], 1):.2f} ms per "
                     f"drafted token, identical to plain {t['same']}/{len(prompts)}")
        print(line)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10, int(sys.argv[2]) if len(sys.argv) > 2 else 128)
