"""``verispec bench`` end to end: load (or take) a pipeline, run, summarise, write, print.

Owns the glue between the pieces (workload -> run -> figures -> report/plots, the progress display
of :mod:`~verispec.bench.live` around the runs); the CLI only parses options. Knows nothing
about decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from verispec.bench.extras import measure_prefill, measure_quality_of
from verispec.bench.live import bench_progress
from verispec.bench.memory import load_measured, memory_facts
from verispec.bench.plots import plot_caption, write_plots
from verispec.bench.report import (
    category_matrix,
    curve_rows,
    kernel_line,
    overall_rows,
    prefill_rows,
    quality_rows,
    report_markdown,
    rich_table,
)
from verispec.bench.results import BenchResults, build_results, write_results
from verispec.bench.run import BenchConfig, as_pipelines, encode, run_bench
from verispec.bench.workload import WorkloadItem
from verispec.engine.loader import DrafterOptions, SpeculativePipeline
from verispec.errors import InvalidParameterError
from verispec.progress import announce_slow
from verispec.runners.choice import kernel_facts
from verispec.runners.select import RunnerOptions

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"


def available_methods(pipes: SpeculativePipeline | Mapping[str, SpeculativePipeline]) -> tuple[str, ...]:
    """Every engine method all the pipelines can run: ``none``, each drafter they all loaded, ``auto``."""
    from verispec.engine import METHODS

    loaded = set.intersection(*(set(p.engine.proposers) for p in as_pipelines(pipes).values()))
    return tuple(m for m in METHODS if m in ("none", "auto") or m in loaded)


def run_and_report(
    pipes: SpeculativePipeline | Mapping[str, SpeculativePipeline],
    items: Sequence[WorkloadItem],
    config: BenchConfig,
    out_dir: Path | None,
    *,
    workload: str,
    dtype: str,
    rss: dict | None = None,
    console: Console | None = None,
    curves: bool = False,
    prefill_tokens: Sequence[int] = (),
    quality_prompts: int = 0,
    show_progress: bool = True,
) -> BenchResults:
    """Run the benchmark on ``pipes`` (one pipeline or ``{runner kind: pipeline}``, compared in
    one run); with ``out_dir`` write results.json, report.md and the PNGs.

    ``rss``: ``{runner kind: RSS snapshots}`` from :func:`load_measured` (None for injected
    pipelines). ``curves``: also time one target pass of k = 1, 2, 4, 8, 16 tokens and one draft
    pass per runner (:func:`verispec.runners.costs.measure_cost_curve`), before the decoding runs.
    ``prefill_tokens``: also time one prefill of each length per runner (llama.cpp's beside when
    it is a peer); ``quality_prompts``: also score each target runner against the float32 model
    on the first N prompts (:mod:`verispec.bench.extras`); both after the decoding runs.
    ``show_progress``: the progress display on stderr (:func:`~verispec.bench.live.bench_progress`:
    prompt i of n, the participant, its decode tokens/s so far) and the cost-curve notices;
    False (``--quiet``) hides both. Nothing of it goes to stdout.
    """
    console = console or Console(stderr=True)
    pipes = as_pipelines(pipes)
    cost_curves = measure_curves(pipes, console, announce=show_progress) if curves else {}
    with bench_progress(
        len(items) * runs_per_prompt(config, len(pipes)), console=console, enabled=show_progress
    ) as on_run:
        records, runners, auditor = run_bench(pipes, items, config, on_run=on_run)
    first = next(iter(pipes.values()))
    settings = asdict(config) | {
        "workload": workload,
        "num_prompts": len(items),
        "categories": list(dict.fromkeys(i.category for i in items)),
        "dtype": dtype,
        "runner": ",".join(pipes),
        "target": first.target.name,
        "draft": first.draft.name if first.draft is not None else None,
    }
    models = [vars(m) | {"runner": kind} for kind, pipe in pipes.items() for m in pipe.model_summaries()]
    rss = rss or {}
    by_runner = {kind: memory_facts(pipe, rss.get(kind)) for kind, pipe in pipes.items()}
    memory = by_runner[next(iter(pipes))] | {"by_runner": by_runner}
    results = build_results(settings, models, memory, runners, records, auditor.counts.to_dict())
    for kind in pipes:  # which kernels ran: the gguf runner's ISA path and the CPU's features, int8's product
        results.environment.update(kernel_facts(kind))
    results.curves = cost_curves
    log = lambda line: console.print(line, highlight=False, markup=False)  # noqa: E731
    if prefill_tokens:
        results.prefill = measure_prefill(
            pipes, prefill_tokens, llama_cpp="llama.cpp" in config.peers, threads=config.threads, log=log
        )
    if quality_prompts:
        prompts = [encode(first, item, config.chat) for item in items[:quality_prompts]]
        results.quality = measure_quality_of(pipes, prompts, first.target.name, log)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        caption = plot_caption(results.config, results.environment, results.created_at)
        results.plots = write_plots(results.summary, out_dir, caption)
        write_results(results, out_dir / RESULTS_FILE)
        (out_dir / REPORT_FILE).write_text(report_markdown(results), encoding="utf-8")
    return results


def measure_curves(pipes: Mapping[str, SpeculativePipeline], console: Console, announce: bool = True) -> dict:
    """``{kind: {"target": {k: ms}, "draft": {1: ms}}}``: median ms of one pass over a 64-token
    context, each runner in turn (runners that cannot be timed this way are left out, said why).
    ``announce``: a step over ~2 s is said on stderr (:func:`verispec.progress.announce_slow`)."""
    from verispec.runners.costs import measure_cost_curve

    curves = {}
    for kind, pipe in pipes.items():
        roles = [("target", pipe.target_runner, (1, 2, 4, 8, 16))]
        if pipe.draft_runner is not None:
            roles.append(("draft", pipe.draft_runner, (1,)))
        entry = {}
        for role, runner, ks in roles:
            try:
                with announce_slow(
                    f"timing the {kind} runner's {role} passes",
                    "--curves: 2 warm-up and 7 timed passes of each k",
                    enabled=announce,
                ):
                    curve = measure_cost_curve(runner, runner_name=kind, model=role, ks=ks)
            except ValueError as exc:  # the context does not fit the runner
                console.print(f"{kind} {role}: no cost curve ({exc})", highlight=False)
                continue
            entry[role] = curve.ms
            console.print(
                f"{kind} {role} ms per pass: " + " ".join(f"k={k}: {v:.1f}" for k, v in curve.ms.items()),
                highlight=False,
            )
        curves[kind] = entry
    return curves


def runs_per_prompt(config: BenchConfig, num_runners: int = 1) -> int:
    """Timed runs per prompt: verispec methods per runner, transformers peers, llama.cpp (when asked for)."""
    return (
        num_runners * len(config.methods)
        + (3 if "transformers" in config.peers else 0)
        + (1 if "llama.cpp" in config.peers else 0)
    )


def print_summary(results: BenchResults, console: Console) -> None:
    """The kernels that ran, the per-category and per-runner tables, then exactness in one line."""
    if not console.is_terminal:
        console.width = max(console.width, 160)  # a log file: do not squeeze the tables
    kernels = kernel_line(results.environment)
    if kernels:
        console.print(kernels, highlight=False)
    console.print(
        rich_table(
            "per category: plain rows tok/s; others speedup over their runner's plain, α, τ",
            *category_matrix(results.summary),
        )
    )
    console.print(rich_table("all prompts", *overall_rows(results.summary)))
    if results.curves:
        console.print(rich_table("ms per target pass of k tokens (median)", *curve_rows(results.curves)))
    if results.prefill:
        console.print(rich_table("one prefill from an empty cache", *prefill_rows(results.prefill)))
    if results.quality:
        console.print(rich_table("agreement with the float32 model", *quality_rows(results.quality)))
    for runner in results.runners:
        if runner.status != "ok":
            console.print(f"{runner.name}: {runner.status}")
    ex = results.exactness
    if ex.get("compared", ex["greedy"]):
        kind = "greedy tokens" if ex["greedy"] else "sampled tokens (coupled, same seed)"
        if ex["all_equal"]:
            console.print(f"[green]exact:[/green] every method's {kind} equal plain decoding of the same runner")
        else:
            listed = ", ".join(f"{m['runner']} on {m['prompt_id']}" for m in ex["mismatches"])
            console.print(f"[red]not exact:[/red] {listed}")


def load_pipelines(
    target: str,
    draft: str | None,
    dtype: str,
    console: Console,
    runners: Sequence[str],
    *,
    drafters: DrafterOptions | None = None,
    options: RunnerOptions | None = None,
) -> tuple[dict[str, SpeculativePipeline], dict]:
    """Load the pair once per runner kind in ``runners`` (``auto`` resolved; the same kind twice is
    an error), with RSS snapshots per kind (see :func:`load_measured`), showing a status line.
    ``drafters``, ``options``: how every pipeline builds its drafters and runners (e.g. a reduced
    draft head, the draft's re-quantization).

    Returns ``({kind: pipeline}, {kind: rss})``. Raises as :meth:`SpeculativePipeline.load` does.
    """
    pipes, rss = {}, {}
    for runner in runners:
        with console.status(f"loading {target}" + (f" + {draft}" if draft else "") + f" ({runner} runner)"):
            pipe, snapshots = load_measured(target, draft, dtype, runner, drafters=drafters, runners=options)
        if pipe.runner_kind in pipes:
            raise InvalidParameterError(f"--runner lists the {pipe.runner_kind} runner twice ({', '.join(runners)})")
        pipes[pipe.runner_kind], rss[pipe.runner_kind] = pipe, snapshots
        console.print(
            f"loaded the {pipe.runner_kind} runner: "
            + ", ".join(f"{m.role} {m.load_time_s:.1f} s" for m in pipe.model_summaries()),
            highlight=False,
        )
    return pipes, rss


def split(text: str | None) -> list[str]:
    """Items of a comma-separated option, stripped; [] for None or blank."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]
