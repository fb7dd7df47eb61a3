"""The progress display of ``bench`` and ``advise``: prompt i of n, the participant running and
its decode tokens/s so far, on stderr.

Owns the translation of :class:`~verispec.bench.run.BenchStep` events into
:func:`verispec.progress.steps` (a ``rich`` bar on a terminal, else a line every few seconds).
Knows nothing about decoding beyond an output's metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from verispec.bench.run import BenchStep
from verispec.progress import steps

if TYPE_CHECKING:
    from rich.console import Console


class DecodeRates:
    """Decode tokens/s so far per participant: its tokens after the first over its time after the
    first token, summed over the prompts it ran (:class:`verispec.metrics.RequestMetrics`)."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def add(self, step: BenchStep) -> float | None:
        """Count one ended run; returns its participant's rate so far (None: nothing decoded yet)."""
        m = step.output.metrics
        self.tokens[step.runner] = self.tokens.get(step.runner, 0) + max(m.output_tokens - 1, 0)
        self.seconds[step.runner] = self.seconds.get(step.runner, 0.0) + max(m.e2e_ms - m.ttft_ms, 0.0) / 1e3
        seconds = self.seconds[step.runner]
        return self.tokens[step.runner] / seconds if seconds > 0 and self.tokens[step.runner] else None


def describe(step: BenchStep) -> str:
    """``prompt 2/6 (coding 17) gguf:draft``; a warm-up: ``warm-up (untimed) gguf:draft``."""
    if step.item is None:
        return f"warm-up (untimed) {step.runner}"
    return f"prompt {step.prompt}/{step.num_prompts} ({step.item.category} {step.item.id}) {step.runner}"


@contextmanager
def bench_progress(
    total: int,
    *,
    title: str = "bench run",
    console: Console | None = None,
    enabled: bool = True,
    after: str | None = None,
    every_s: float | None = None,
) -> Iterator[Callable[[BenchStep], None]]:
    """An ``on_run`` for :func:`verispec.bench.run.run_bench` over ``total`` timed runs, showing
    each run as it starts and, when it ends, its participant's decode tokens/s so far: e.g.
    ``verispec: bench run 5/12 · prompt 2/4 (coding 17) gguf:draft · gguf:draft 41.2 decode tok/s so far (9 s)``.
    ``after``: what the block does once the runs are done (shown, with a heartbeat, until it
    ends). ``enabled=False`` (``--quiet``) shows nothing; the rest as :func:`verispec.progress.steps`."""
    rates = DecodeRates()
    with steps(title, total, enabled=enabled, console=console, every_s=every_s) as shown:
        shown.after = after

        def on_run(step: BenchStep) -> None:
            if step.output is None:
                shown.running(describe(step))
                return
            rate = rates.add(step)
            figure = f"{rate:.1f}" if rate is not None else "no"
            shown.finished(describe(step), f"{step.runner} {figure} decode tok/s so far")

        yield on_run
