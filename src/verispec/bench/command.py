"""``verispec bench`` end to end: load (or take) a pipeline, run, summarise, write, print.

Owns the glue between the pieces (workload -> run -> figures -> report/plots) and the progress
bar; the CLI only parses options. Knows nothing about decoding.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from verispec.bench.plots import write_plots
from verispec.bench.report import (
    BenchResults,
    build_results,
    category_matrix,
    overall_rows,
    report_markdown,
    rich_table,
    write_results,
)
from verispec.bench.run import BenchConfig, load_measured, memory_facts, run_bench
from verispec.bench.workload import WorkloadItem
from verispec.pipeline import SpeculativePipeline

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"


def available_methods(pipe: SpeculativePipeline) -> tuple[str, ...]:
    """Every engine method the pipeline can run: ``none``, each loaded drafter, ``auto``."""
    from verispec.engine import METHODS

    loaded = set(pipe.engine.proposers)
    return tuple(m for m in METHODS if m in ("none", "auto") or m in loaded)


def run_and_report(
    pipe: SpeculativePipeline,
    items: Sequence[WorkloadItem],
    config: BenchConfig,
    out_dir: Path | None,
    *,
    workload: str,
    dtype: str,
    rss: dict | None = None,
    console: Console | None = None,
) -> BenchResults:
    """Run the benchmark on ``pipe``; with ``out_dir`` write results.json, report.md and the PNGs.

    ``rss``: RSS snapshots from :func:`load_measured` (None for an injected pipeline).
    """
    console = console or Console(stderr=True)
    with progress(console, len(items) * runs_per_prompt(config)) as on_run:
        records, runners, auditor = run_bench(pipe, items, config, on_run=on_run)
    settings = asdict(config) | {
        "workload": workload,
        "num_prompts": len(items),
        "categories": list(dict.fromkeys(i.category for i in items)),
        "dtype": dtype,
        "runner": pipe.runner_kind,
        "target": pipe.target.name,
        "draft": pipe.draft.name if pipe.draft is not None else None,
    }
    models = [vars(m) for m in pipe.model_summaries()]
    results = build_results(settings, models, memory_facts(pipe, rss), runners, records, auditor.counts.to_dict())
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        results.plots = write_plots(results.summary, out_dir)
        write_results(results, out_dir / RESULTS_FILE)
        (out_dir / REPORT_FILE).write_text(report_markdown(results), encoding="utf-8")
    return results


def runs_per_prompt(config: BenchConfig) -> int:
    """Timed runs per prompt: verispec methods, transformers peers, llama.cpp (when asked for)."""
    return len(config.methods) + (3 if "transformers" in config.peers else 0) + (1 if "llama.cpp" in config.peers else 0)


@contextmanager
def progress(console: Console, total: int) -> Iterator[Callable[[str], None]]:
    """A callback to call after each run: a progress bar on a terminal, else one line per run
    (a log file shows how far a long run got)."""
    if console.is_terminal:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("bench", total=total)
            yield lambda what: bar.update(task, advance=1, description=what[:48])
        return
    start, done = time.perf_counter(), [0]

    def line(what: str) -> None:
        done[0] += 1
        console.print(f"[{done[0]}/{total}] {what} ({time.perf_counter() - start:.0f} s)", highlight=False)

    yield line


def print_summary(results: BenchResults, console: Console) -> None:
    """The per-category and per-runner tables, then exactness in one line."""
    if not console.is_terminal:
        console.width = max(console.width, 160)  # a log file: do not squeeze the tables
    console.print(rich_table("speedup α τ per category (vs plain decoding of the same runner)", *category_matrix(results.summary)))
    console.print(rich_table("all prompts", *overall_rows(results.summary)))
    for runner in results.runners:
        if runner.status != "ok":
            console.print(f"{runner.name}: {runner.status}")
    ex = results.exactness
    if ex["greedy"]:
        if ex["all_equal"]:
            console.print("[green]exact:[/green] every method's greedy tokens equal plain decoding of the same runner")
        else:
            listed = ", ".join(f"{m['runner']} on {m['prompt_id']}" for m in ex["mismatches"])
            console.print(f"[red]not exact:[/red] {listed}")


def load_pipeline(target: str, draft: str | None, dtype: str, console: Console, runner: str = "torch") -> tuple[SpeculativePipeline, dict]:
    """Load the pair with RSS snapshots (see :func:`load_measured`), showing a status line."""
    with console.status(f"loading {target}" + (f" + {draft}" if draft else "")):
        return load_measured(target, draft, dtype, runner)


def split(text: str | None) -> list[str]:
    """Items of a comma-separated option, stripped; [] for None or blank."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]
