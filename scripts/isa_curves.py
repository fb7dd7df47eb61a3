"""Cost curves of every kernel path this CPU runs, beside llama.cpp's, alone, in one run.

Loads the default target once on the gguf runner (and once on llama.cpp when llama-cpp-python is
installed; ``PYTHONPATH`` may point at another build of it, e.g. an AVX2-only one) and times a
forward of k = 1, 2, 4, 8, 16 new tokens after a 64-token context for each instruction-set path the
CPU has (``portable`` only when asked: it is tens of times slower) and for llama.cpp. The passes are
interleaved: round after round, each path then llama.cpp runs one pass of the same k, so the host's
drift (hosts of this kind drift by 10-40% within minutes, as their neighbours load the memory bus)
falls on every path alike. Prints one row per path (median ms per pass over REPS rounds and
cost(8)/cost(1)), then each path's k = 1 and k = 2 pass against llama.cpp's as the median of the
per-round ratios. Usage (from the repo root):
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


def one_pass(runner, isa: str | None, k: int) -> float:
    """ms of one forward of k new tokens after CONTEXT (the cache is cut back to CONTEXT after it)."""
    if isa is not None:
        set_kernel_isa(isa)
    start = time.perf_counter()
    runner.forward(list(range(2000, 2000 + k)))
    elapsed = (time.perf_counter() - start) * 1e3
    runner.truncate(len(CONTEXT))
    return elapsed


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
        f"CPU features: {kernels.cpu_features()}; ms per pass of k = {', '.join(map(str, KS))} new tokens after "
        f"{len(CONTEXT)}, median of {reps} interleaved rounds"
    )
    paths: list[tuple[str, object, str | None]] = []
    runner = GGUFRunner.from_file(path, max_context_length=512)
    paths += [(f"gguf {isa}", runner, isa) for isa in isas]
    try:
        import llama_cpp

        from verispec.runners.llamacpp import LlamaCppRunner

        paths.append(("llama.cpp", LlamaCppRunner(path, max_context_length=512), None))
    except ImportError:
        llama_cpp = None
        print("llama.cpp: llama-cpp-python is not installed")
    for _, r, _ in paths:
        r.truncate(0)
        r.forward(CONTEXT)
    times = {label: {k: [] for k in KS} for label, _, _ in paths}
    for k in KS:
        for _ in range(reps):
            for label, r, isa in paths:
                times[label][k].append(one_pass(r, isa, k))
    set_kernel_isa(None)
    for label, _, _ in paths:
        show(label, [statistics.median(times[label][k]) for k in KS])
    if llama_cpp is None:
        return
    theirs = times["llama.cpp"]
    for label, _, _ in paths[:-1]:
        ratios = {k: statistics.median(a / b for a, b in zip(times[label][k], theirs[k])) for k in (1, 2)}
        print(f"{label} / llama.cpp, median of per-round ratios: k=1 {ratios[1]:.3f}, k=2 {ratios[2]:.3f}")
    print(f"(llama.cpp from {llama_cpp.__file__})")


if __name__ == "__main__":
    main()
