"""Where one target pass of the gguf runner spends its time: each kernel call, and each product by shape.

Loads the default target on the gguf runner, caches a 64-token context, then times passes of K new
tokens (median of REPS plain passes), then the same passes with every kernel call wrapped in a
timer: milliseconds per pass by kernel (``linear``, ``attention``, ``add_rms_norm``, ...) and, for the
products, by block type and shape with the bytes each reads and the GB/s that makes. The wrapping
adds ~1 us a call. What the numbers say on a 2-core AMD Zen 4 (2026-12-05): the products are the
pass, at 42-45 GB/s over both cores; see docs/kernel-measurements.md. Usage (from the repo root):
``../shared/tools/alone .venv/bin/python scripts/pass_breakdown.py [ISA] [K] [REPS] [MODEL] [REQUANTIZE]``
(ISA default: the best this CPU runs; K default 1; REPS default 15; MODEL default the target,
qwen2.5-coder-1.5b-instruct; REQUANTIZE: e.g. iq4_nl, as the pipeline re-quantizes the default draft).
"""

import collections
import statistics
import sys
import time

from verispec.models.store import ModelStore
from verispec.runners.cpu import gguf_blocks, gguf_runner
from verispec.runners.cpu.gguf_blocks import SUPPORTED_TYPES
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.kernels import kernel_isa, set_kernel_isa

CONTEXT = list(range(1000, 1064))


class Timed:
    """The kernels module with every call timed: ``seconds[name]``, ``calls[name]``, and for
    ``linear`` per ``(block type, out, in)``: ``shape_seconds``, ``shape_calls``, ``shape_bytes``."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels
        self.seconds, self.calls = collections.defaultdict(float), collections.Counter()
        self.shape_seconds, self.shape_calls, self.shape_bytes = (
            collections.defaultdict(float),
            collections.Counter(),
            {},
        )

    def __getattr__(self, name):
        function = getattr(self.kernels, name)
        if not callable(function):
            return function

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = function(*args, **kwargs)
            elapsed = time.perf_counter() - start
            self.seconds[name] += elapsed
            self.calls[name] += 1
            if name == "linear":
                x, packed, qtype, rows = args[:4]
                shape = (SUPPORTED_TYPES.get(qtype, str(qtype)), rows, x.shape[1])
                self.shape_seconds[shape] += elapsed
                self.shape_calls[shape] += 1
                self.shape_bytes[shape] = packed.numel()
            return out

        return timed


def passes(runner, k: int, reps: int) -> list[float]:
    """ms of ``reps`` passes of ``k`` new tokens after CONTEXT."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        runner.forward(list(range(2000, 2000 + k)))
        times.append((time.perf_counter() - start) * 1e3)
        runner.truncate(len(CONTEXT))
    return times


def main() -> None:
    isa = sys.argv[1] if len(sys.argv) > 1 else None
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    model = sys.argv[4] if len(sys.argv) > 4 else "qwen2.5-coder-1.5b-instruct"
    requantize = sys.argv[5] if len(sys.argv) > 5 else None
    set_kernel_isa(None if isa in (None, "auto") else isa)
    runner = GGUFRunner.from_file(ModelStore().fetch(model), max_context_length=4096, requantize=requantize)
    runner.forward(CONTEXT)
    plain = statistics.median(passes(runner, k, reps))
    timed = Timed(gguf_blocks.loaded_kernels())
    gguf_blocks.loaded_kernels = gguf_runner.loaded_kernels = lambda: timed
    wrapped = statistics.median(passes(runner, k, reps))
    print(
        f"{model} ({requantize or 'as stored'}), kernel path {kernel_isa()}; k = {k}: {plain:.2f} ms a pass "
        f"(median of {reps}); wrapped {wrapped:.2f} ms"
    )
    for name, seconds in sorted(timed.seconds.items(), key=lambda item: -item[1]):
        print(f"  {name:16s} {seconds / reps * 1e3:8.2f} ms a pass, {timed.calls[name] / reps:.0f} calls")
    total_ms = total_bytes = 0.0
    for shape, seconds in sorted(timed.shape_seconds.items(), key=lambda item: -item[1]):
        calls = timed.shape_calls[shape] / reps
        ms, megabytes = seconds / reps * 1e3, timed.shape_bytes[shape] * calls / 1e6
        total_ms, total_bytes = total_ms + ms, total_bytes + megabytes
        print(
            f"  {shape[0]:6s} out {shape[1]:6d} in {shape[2]:5d}: {ms:7.2f} ms, {calls:.0f} calls, "
            f"{megabytes:7.1f} MB, {megabytes / ms:5.1f} GB/s"
        )
    print(f"  products: {total_ms:.2f} ms, {total_bytes:.1f} MB, {total_bytes / total_ms:.1f} GB/s")


if __name__ == "__main__":
    main()
