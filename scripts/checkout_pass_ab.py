"""One checkout's gguf passes, for comparing two checkouts of verispec (before and after a change).

Loads the default pair on the gguf runner, prefills 64 tokens, then times 60 passes of k = 1 and
k = 5 new rows on the target and on the draft (each pass rolled back), and prints the median of
the last 50 in ms. Run it alternately on two checkouts, one process each, through the benchmark lock,
and compare pair by pair (the host drifts between runs):
``for i in 1 2 3; do for tree in OLD NEW; do ../shared/tools/alone env PYTHONPATH=$tree/src
.venv/bin/python scripts/checkout_pass_ab.py; done; done``.
"""

import statistics
import time

from verispec.engine.loader import SpeculativePipeline
from verispec.runners.select import RunnerOptions

PREFILL = 64
PASSES, COUNTED = 60, 50


def main() -> None:
    pipe = SpeculativePipeline.load(
        "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", runners=RunnerOptions(kind="gguf")
    )
    out = []
    for role, runner in (("target", pipe.target_runner), ("draft", pipe.draft_runner)):
        runner.truncate(0)
        runner.forward(list(range(100, 100 + PREFILL)), num_logits=1)
        for rows in (1, 5):
            times = []
            for _ in range(PASSES):
                start = time.perf_counter()
                runner.forward(list(range(200, 200 + rows)))
                times.append(time.perf_counter() - start)
                runner.truncate(PREFILL)
            out.append(f"{role} k={rows} {statistics.median(times[-COUNTED:]) * 1e3:.2f} ms")
    print(" | ".join(out))


if __name__ == "__main__":
    main()
