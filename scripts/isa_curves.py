"""Cost curves of every kernel path this CPU runs, beside llama.cpp's, alone, in one run.

Loads the default target once on the gguf runner and, for each instruction-set path the CPU has
(``portable`` only when asked: it is tens of times slower), times a forward of k = 1, 2, 4, 8, 16
new tokens after a 64-token context (median of REPS), then the same with llama.cpp when
llama-cpp-python is installed (``PYTHONPATH`` may point at another build of it, e.g. an AVX2-only
one). Prints one row per path: ms per pass and cost(8)/cost(1). Usage (from the repo root):
``../shared/tools/alone .venv/bin/python scripts/isa_curves.py [ISAS] [REPS]``, ISAS a comma list
(default: every vector path this CPU runs).
"""

import statistics
import sys
import time

from verispec.models.store import ModelStore
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.kernels import gguf_kernels, set_kernel_isa

KS = (1, 2, 4, 8, 16)
CONTEXT = list(range(1000, 1064))


def curve(runner, reps: int) -> list[float]:
    runner.truncate(0)
    runner.forward(CONTEXT)
    row = []
    for k in KS:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            runner.forward(list(range(2000, 2000 + k)))
            times.append((time.perf_counter() - start) * 1e3)
            runner.truncate(len(CONTEXT))
        row.append(statistics.median(times))
    return row


def show(label: str, row: list[float]) -> None:
    print(
        f"{label:24s} " + " ".join(f"{v:7.1f}" for v in row) + f"   cost(8)/cost(1) {row[3] / row[0]:.2f}", flush=True
    )


def main() -> None:
    kernels = gguf_kernels()
    isas = sys.argv[1].split(",") if len(sys.argv) > 1 else [i for i in kernels.supported_isas() if i != "portable"]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    path = ModelStore().fetch("qwen2.5-coder-1.5b-instruct")
    print(
        f"CPU features: {kernels.cpu_features()}; "
        f"ms per pass of k = {', '.join(map(str, KS))} new tokens after {len(CONTEXT)}"
    )
    runner = GGUFRunner.from_file(path, max_context_length=512)
    for isa in isas:
        set_kernel_isa(isa)
        show(f"gguf {isa}", curve(runner, reps))
    set_kernel_isa(None)
    try:
        import llama_cpp

        from verispec.runners.llamacpp import LlamaCppRunner
    except ImportError:
        print("llama.cpp: llama-cpp-python is not installed")
        return
    show("llama.cpp", curve(LlamaCppRunner(path, max_context_length=512), reps))
    print(f"(llama.cpp from {llama_cpp.__file__})")


if __name__ == "__main__":
    main()
