"""``verispec advise``: measure the acceptance rate and the costs on a workload sample, then say per
category whether speculation pays (``--export``: the advised setup for another serving stack).
The advice is :mod:`verispec.bench.advise`'s; this module parses, validates and prints: the report on
stdout (stderr when ``--json`` or ``--export`` without a file take stdout), progress on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from verispec.cli.common import (
    K_ADVISE,
    categories_option,
    chat_template_option,
    draft_option,
    dtype_option,
    eagle_head_option,
    err,
    head_quantization_option,
    json_option,
    num_speculative_tokens_option,
    prompts_option,
    resolve_draft,
    runner_option,
    target_option,
    user_errors,
    workload_option,
)
from verispec.errors import InvalidParameterError


def advise(
    workload: str | None = workload_option(),
    prompts: Path | None = prompts_option(),
    categories: str | None = categories_option(),
    limit: int = typer.Option(1, help="Prompts per category measured."),
    methods: str = typer.Option("draft,ngram", help="Comma-separated drafters to assess."),
    num_speculative_tokens: int = num_speculative_tokens_option(K_ADVISE),
    max_k: int = typer.Option(10, min=1, max=64, help="Largest draft length in the predictions."),
    max_tokens: int = typer.Option(64, help="New tokens per measured prompt."),
    context_length: int = typer.Option(4096, min=1, help="Context length for the KV-cache memory estimate (tokens)."),
    memory_budget: float | None = typer.Option(None, help="Memory available for weights + KV caches, GiB."),
    gpu_cost_per_month: float | None = typer.Option(
        None, help="Monthly cost of the machine, for the cost per million tokens."
    ),
    cached_prompt_fraction: float = typer.Option(
        0.0,
        help="Share of each prompt the prefix cache serves in production (a chat's earlier turns, a shared system "
        "prompt), 0 to <1: the cost estimate prefills only the rest.",
    ),
    threads: int | None = typer.Option(None, help="CPU threads (default: torch's)."),
    chat: bool | None = chat_template_option(),
    target: str = target_option("Target model reference."),
    draft: str | None = draft_option(),
    dtype: str = dtype_option(),
    runner: str = runner_option("The runner advised on (as generate's --runner): the one you would run."),
    eagle_head: Path | None = eagle_head_option(),
    head_quantization: str = head_quantization_option(),
    as_json: bool = json_option("Also print the advice as one JSON object on stdout."),
    export: str | None = typer.Option(None, help="Write the advised setup for vllm, sglang or transformers (JSON)."),
    export_file: Path | None = typer.Option(None, help="File for --export's JSON (default: stdout)."),
    export_head_dir: Path | None = typer.Option(
        None,
        help="Where --export writes the EAGLE head's EAGLE-3 checkpoint when the advice is eagle (default: beside "
        "the head, NAME-eagle3).",
    ),
) -> None:
    """Measure α and costs on a workload sample and say whether speculation pays, per category."""
    from verispec.bench.advise import advise as run_advice
    from verispec.bench.advise_render import export_advice, render
    from verispec.bench.command import load_pipelines, runs_per_prompt, split
    from verispec.bench.export import EAGLE_METHODS, EAGLE_TOOLS, EXPORT_TOOLS
    from verispec.bench.live import bench_progress
    from verispec.bench.run import BenchConfig
    from verispec.bench.workload import load_workload
    from verispec.engine.loader import DrafterOptions

    with user_errors():
        if not 0.0 <= cached_prompt_fraction < 1.0:  # before minutes of loading and measuring
            raise InvalidParameterError(f"--cached-prompt-fraction must be in [0, 1), got {cached_prompt_fraction}")
        if export is not None and export not in EXPORT_TOOLS:
            raise InvalidParameterError(f"--export must be one of {', '.join(EXPORT_TOOLS)}, got {export!r}")
        if export is not None and as_json and export_file is None:
            raise InvalidParameterError("--json and --export both write to stdout: give --export-file")
        items = load_workload(None if prompts else workload or "specbench", prompts, split(categories), limit)
        config = BenchConfig(  # measured at a fixed draft length: α per drafted token is what the predictions assume
            methods=tuple(split(methods)),
            peers=(),
            num_speculative_tokens=num_speculative_tokens,
            schedule="constant",
            max_tokens=max_tokens,
            threads=threads,
            chat=chat,
        )
        drafters = DrafterOptions(eagle_head=eagle_head, head_quantization=head_quantization)
        draft = resolve_draft(target, draft)
        pipes, _ = load_pipelines(target, draft, dtype, err, [runner], drafters=drafters)
        pipe = next(iter(pipes.values()))
        then = "timing the target's verify passes for the predictions"
        with bench_progress(
            len(items) * runs_per_prompt(config), title="advise run", console=err, after=then
        ) as on_run:
            advice = run_advice(
                pipe,
                items,
                config,
                max_k=max_k,
                context_length=context_length,
                memory_budget_bytes=int(memory_budget * 2**30) if memory_budget is not None else None,
                gpu_cost_per_month=gpu_cost_per_month,
                cached_prompt_fraction=cached_prompt_fraction,
                on_run=on_run,
            )
    # the report is stdout's unless --json or --export (without a file) claim it; progress is stderr's
    render(advice, err if as_json or (export is not None and export_file is None) else Console())
    if as_json:
        print(json.dumps(advice.to_dict()))
    if export is not None:
        with user_errors(OSError):
            eagle_dir = None
            if advice.verdicts[-1].method in EAGLE_METHODS and export in EAGLE_TOOLS:
                from verispec.bench.export_head import export_head

                eagle_dir = export_head(eagle_head, pipe.target_runner, target, export_head_dir)
                err.print(f"the EAGLE head as an EAGLE-3 checkpoint: {eagle_dir}", highlight=False, markup=False)
            export_advice(
                advice,
                export,
                export_file,
                target,
                draft,
                pipe.drafters,
                err,
                eagle_dir=None if eagle_dir is None else str(eagle_dir),
            )
