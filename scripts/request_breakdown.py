"""Where a speculative request's time goes on the gguf runner: target passes, draft passes, the rest.

Generates each of the first N HumanEval prompts (greedy, 128 tokens at most) with plain decoding
and with METHOD, timing every runner pass (``runner.run_segments``, which every gguf forward goes
through) by role (target or draft) and by row count (k = 9 stands for 9 or more: the prefills).
Prints one line per request: wall ms, tokens, ms / passes per role and row count, and the time
outside the passes (Python: scheduling, sampling, drafters' own work). Usage (from the repo root):
``../shared/tools/alone .venv/bin/python scripts/request_breakdown.py [METHOD] [N]`` (draft, 3).
"""

import collections
import sys
import time

from verispec.algorithms.sampling import SamplingParams
from verispec.bench.workload import load_workload
from verispec.engine.loader import SpeculativePipeline
from verispec.engine.request import SpeculativeConfig
from verispec.runners.cpu import runner
from verispec.runners.select import RunnerOptions

TIMES: dict[str, float] = collections.defaultdict(float)
PASSES: collections.Counter = collections.Counter()


def main(method: str = "draft", count: int = 3) -> None:
    pipe = SpeculativePipeline.load(
        "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", runners=RunnerOptions(kind="gguf")
    )
    target_weights, run_segments = pipe.target_runner.weights, runner.run_segments

    def timed(ops, segments):
        role = "target" if ops.weights is target_weights else "draft"
        rows = min(sum(len(seg.token_ids) for seg in segments), 9)
        start = time.perf_counter()
        out = run_segments(ops, segments)
        elapsed = time.perf_counter() - start
        for key in (role, f"{role} k={rows}"):
            TIMES[key] += elapsed
            PASSES[key] += 1
        return out

    runner.run_segments = timed
    for item in load_workload("humaneval", None, None, count)[:count]:
        for name in dict.fromkeys(["none", method]):
            TIMES.clear()
            PASSES.clear()
            start = time.perf_counter()
            out = pipe.generate(
                item.text,
                SamplingParams(max_tokens=128, temperature=0.0),
                SpeculativeConfig(method=name),
                chat=item.chat,
            )
            wall = time.perf_counter() - start
            passes = sum(v for k, v in TIMES.items() if " " not in k)
            parts = ", ".join(f"{k} {TIMES[k] * 1e3:.0f} ms/{PASSES[k]}" for k in sorted(TIMES))
            print(
                f"{item.id} {name:6s} wall {wall * 1e3:7.0f} ms, {len(out.token_ids)} tokens, {parts}, "
                f"outside passes {(wall - passes) * 1e3:.0f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "draft", int(sys.argv[2]) if len(sys.argv) > 2 else 3)
