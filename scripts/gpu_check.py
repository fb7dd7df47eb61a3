"""GPU check (run on a CUDA machine from the repo root): exactness on CUDA and cost curves.

1. Tiny random Qwen2 models on CUDA: speculative greedy == plain greedy for K = 1..8 with the
   target itself, a random model and a perturbed copy as drafts (and == the CPU result).
2. Qwen2.5-Coder-1.5B/0.5B-shaped models with random bf16 weights (no download needed):
   TransformersRunner cost of one forward of k = 1, 2, 4, 8, 16 tokens after a 64-token context
   (median of 7, ms), and the engine's per-step overhead outside the forwards.
Prints JSON lines.
"""

import json
import statistics
import sys
import time

import torch

sys.path[:0] = ["src", "tests"]
from helpers import make_engine, perturbed_copy, tiny_qwen2  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from verispec.engine import SpeculativeConfig, SpeculativeEngine  # noqa: E402
from verispec.proposers.draft_model import DraftModelProposer  # noqa: E402
from verispec.runners import prefill  # noqa: E402
from verispec.runners.torch_runner import TransformersRunner  # noqa: E402
from verispec.spec.sampling import SamplingParams  # noqa: E402

dev = torch.device("cuda")
print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__}))

# 1. exactness on CUDA
target = tiny_qwen2(0)
drafts = {"target": target, "random": tiny_qwen2(1), "partial": perturbed_copy(target, 0.3, 2)}
prompts = [[5, 17, 33, 2, 9], [70, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
params = SamplingParams(max_tokens=40)
cpu_plain = [make_engine(target).generate(p, params, SpeculativeConfig(method="none")).token_ids for p in prompts]
gpu_target = tiny_qwen2(0).to(dev)
gpu_plain = [make_engine(gpu_target).generate(p, params, SpeculativeConfig(method="none")).token_ids for p in prompts]
mismatches = []
for name, draft in drafts.items():
    engine = make_engine(gpu_target, draft.to(dev) if name != "target" else gpu_target)
    for k in range(1, 9):
        for p, expected in zip(prompts, gpu_plain):
            got = engine.generate(p, params, SpeculativeConfig(num_speculative_tokens=k)).token_ids
            if got != expected:
                mismatches.append((name, k, p))
print(json.dumps({"check": "cuda exactness", "cases": 3 * 8 * 3, "mismatches": mismatches, "gpu_plain_equals_cpu_plain": gpu_plain == cpu_plain}))


# 2. cost curves of real-sized shapes
def shaped(hidden, inter, layers, heads, kv):
    config = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768, tie_word_embeddings=False)
    with torch.device(dev):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    return model


for name, shape in {"1.5b-shaped": (1536, 8960, 28, 12, 2), "0.5b-shaped": (896, 4864, 24, 14, 2)}.items():
    model = shaped(*shape)
    runner = TransformersRunner(model)
    context = list(range(100, 164))
    curve = {}
    for k in (1, 2, 4, 8, 16):
        times = []
        for rep in range(9):
            prefill(runner, context)
            torch.cuda.synchronize()
            start = time.perf_counter()
            runner.forward(list(range(200, 200 + k)))
            times.append((time.perf_counter() - start) * 1e3)
        curve[k] = round(statistics.median(times[2:]), 2)
    print(json.dumps({"cost_curve_ms": name, "bf16": curve}))
    if name == "1.5b-shaped":
        big = model
    del runner

# 3. engine overhead per step: 1.5B-shaped target drafting for itself (all accepted) and plain
tok = type("T", (), {"decode": lambda self, ids, skip_special_tokens=True: " ".join(map(str, ids))})()
for method, k in (("none", 1), ("draft", 4), ("draft", 8)):
    engine = SpeculativeEngine(TransformersRunner(big), tok, eos_token_ids=[], proposers={"draft": DraftModelProposer(TransformersRunner(big))})
    engine.generate(list(range(100, 164)), SamplingParams(max_tokens=8, ignore_eos=True), SpeculativeConfig(method=method, num_speculative_tokens=k))
    out = engine.generate(list(range(100, 164)), SamplingParams(max_tokens=128, ignore_eos=True), SpeculativeConfig(method=method, num_speculative_tokens=k))
    m = out.metrics
    overhead = m.e2e_ms - m.target_ms - m.draft_ms
    print(json.dumps({"engine": method, "k": k, "tokens": m.output_tokens, "total_tokens_per_s": round(m.total_tokens_per_s, 1),
                      "target_forwards": m.num_target_forwards, "target_ms": round(m.target_ms, 1), "draft_ms": round(m.draft_ms, 1),
                      "overhead_ms_per_step": round(overhead / m.num_target_forwards, 3), "mean_acceptance_length": m.spec.mean_acceptance_length}))
