"""``verispec advise``: measure the acceptance rate and the costs on a workload sample, then say per
category whether speculation pays (``--export``: the advised setup for another serving stack).
The advice is :mod:`verispec.bench.advise`'s; this module parses, validates and prints: the report on
stdout (stderr when ``--json`` or ``--export`` without a file take stdout), progress on stderr."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from verispec.cli.common import (
    K_ADVISE,
    Categories,
    ChatTemplate,
    Dtype,
    EagleHead,
    HeadQuantization,
    NumSpeculativeTokens,
    Prompts,
    Workload,
    draft_option,
    err,
    json_option,
    runner_option,
    target_option,
    user_errors,
)
from verispec.cli.options import PipelineOptions
from verispec.engine.loader import DEFAULT_TARGET
from verispec.errors import InvalidParameterError

# advise's own options, each declared once (the shared ones are verispec.cli.common's)
Limit = Annotated[int, typer.Option(help="Prompts per category measured.")]
Methods = Annotated[str, typer.Option(help="Comma-separated drafters to assess.")]
MaxK = Annotated[int, typer.Option(min=1, max=64, help="Largest draft length in the predictions.")]
MaxTokens = Annotated[int, typer.Option(help="New tokens per measured prompt.")]
ContextLength = Annotated[int, typer.Option(min=1, help="Context length for the KV-cache memory estimate (tokens).")]
MemoryBudget = Annotated[float | None, typer.Option(help="Memory available for weights + KV caches, GiB.")]
GpuCostPerMonth = Annotated[
    float | None, typer.Option(help="Monthly cost of the machine, for the cost per million tokens.")
]
CachedPromptFraction = Annotated[
    float,
    typer.Option(
        help="Share of each prompt the prefix cache serves in production (a chat's earlier turns, a shared system "
        "prompt), 0 to <1: the cost estimate prefills only the rest.",
    ),
]
Threads = Annotated[int | None, typer.Option(help="CPU threads (default: torch's).")]
Target = Annotated[str, target_option("Target model reference.")]
Draft = Annotated[str | None, draft_option()]
Runner = Annotated[str, runner_option("The runner advised on (as generate's --runner): the one you would run.")]
AsJson = Annotated[bool, json_option("Also print the advice as one JSON object on stdout.")]
Export = Annotated[str | None, typer.Option(help="Write the advised setup for vllm, sglang or transformers (JSON).")]
ExportFile = Annotated[Path | None, typer.Option(help="File for --export's JSON (default: stdout).")]
ExportHeadDir = Annotated[
    Path | None,
    typer.Option(
        help="Where --export writes the EAGLE head's EAGLE-3 checkpoint when the advice is eagle (default: beside "
        "the head, NAME-eagle3).",
    ),
]


def advise(
    workload: Workload = None,
    prompts: Prompts = None,
    categories: Categories = None,
    limit: Limit = 1,
    methods: Methods = "draft,ngram",
    num_speculative_tokens: NumSpeculativeTokens = K_ADVISE,
    max_k: MaxK = 10,
    max_tokens: MaxTokens = 64,
    context_length: ContextLength = 4096,
    memory_budget: MemoryBudget = None,
    gpu_cost_per_month: GpuCostPerMonth = None,
    cached_prompt_fraction: CachedPromptFraction = 0.0,
    threads: Threads = None,
    chat: ChatTemplate = None,
    target: Target = DEFAULT_TARGET,
    draft: Draft = None,
    dtype: Dtype = "float32",
    runner: Runner = "auto",
    eagle_head: EagleHead = None,
    head_quantization: HeadQuantization = "auto",
    as_json: AsJson = False,
    export: Export = None,
    export_file: ExportFile = None,
    export_head_dir: ExportHeadDir = None,
) -> None:
    """Measure α and costs on a workload sample and say whether speculation pays, per category."""
    params = dict(locals())
    from verispec.bench.advise_render import render

    with user_errors():
        check_advise_options(cached_prompt_fraction, export, as_json, export_file)
        items = load_items(params)
        pipeline = PipelineOptions.from_cli(params).check_before_loading()
        advice, pipe = measure(pipeline, items, params)
    # the report is stdout's unless --json or --export (without a file) claim it; progress is stderr's
    render(advice, err if as_json or (export is not None and export_file is None) else Console())
    if as_json:
        print(json.dumps(advice.to_dict()))
    if export is not None:
        with user_errors(OSError):
            write_export(advice, pipe, pipeline, export, export_file, export_head_dir)


def check_advise_options(cached_prompt_fraction: float, export: str | None, as_json: bool, export_file) -> None:
    """advise's own refusals, before minutes of loading and measuring. Raises InvalidParameterError."""
    from verispec.bench.export import EXPORT_TOOLS

    if not 0.0 <= cached_prompt_fraction < 1.0:
        raise InvalidParameterError(f"--cached-prompt-fraction must be in [0, 1), got {cached_prompt_fraction}")
    if export is not None and export not in EXPORT_TOOLS:
        raise InvalidParameterError(f"--export must be one of {', '.join(EXPORT_TOOLS)}, got {export!r}")
    if export is not None and as_json and export_file is None:
        raise InvalidParameterError("--json and --export both write to stdout: give --export-file")


def load_items(params: dict[str, Any]) -> list:
    """The workload's prompts (``--workload``, or ``--prompts``), ``--limit`` per category.
    Raises WorkloadError (a VerispecError)."""
    from verispec.bench.command import split
    from verispec.bench.workload import load_workload

    workload, prompts = params["workload"], params["prompts"]
    return load_workload(
        None if prompts else workload or "specbench", prompts, split(params["categories"]), params["limit"]
    )


def measure(pipeline: PipelineOptions, items: list, params: dict[str, Any]):
    """Load ``pipeline`` (checked) and measure the advice on ``items`` under a progress bar;
    returns ``(advice, the pipeline loaded)``."""
    from verispec.bench.advise import advise as run_advice
    from verispec.bench.command import load_pipelines, runs_per_prompt, split
    from verispec.bench.live import bench_progress
    from verispec.bench.run import BenchConfig

    p = params
    config = BenchConfig(  # measured at a fixed draft length: α per drafted token is what the predictions assume
        methods=tuple(split(p["methods"])),
        peers=(),
        num_speculative_tokens=p["num_speculative_tokens"],
        schedule="constant",
        max_tokens=p["max_tokens"],
        threads=p["threads"],
        chat=p["chat"],
    )
    pipes, _ = load_pipelines(
        pipeline.target, pipeline.draft_model, pipeline.dtype, err, [pipeline.runner], drafters=pipeline.drafters()
    )
    pipe = next(iter(pipes.values()))
    then = "timing the target's verify passes for the predictions"
    with bench_progress(len(items) * runs_per_prompt(config), title="advise run", console=err, after=then) as on_run:
        advice = run_advice(
            pipe,
            items,
            config,
            max_k=p["max_k"],
            context_length=p["context_length"],
            memory_budget_bytes=int(p["memory_budget"] * 2**30) if p["memory_budget"] is not None else None,
            gpu_cost_per_month=p["gpu_cost_per_month"],
            cached_prompt_fraction=p["cached_prompt_fraction"],
            on_run=on_run,
        )
    return advice, pipe


def write_export(advice, pipe, pipeline: PipelineOptions, export: str, export_file, export_head_dir) -> None:
    """``--export``: the advised setup for another stack, with the EAGLE head as an EAGLE-3
    checkpoint where the advice is eagle and the stack takes one."""
    from verispec.bench.advise_render import export_advice
    from verispec.bench.export import EAGLE_METHODS, EAGLE_TOOLS

    eagle_dir = None
    if advice.verdicts[-1].method in EAGLE_METHODS and export in EAGLE_TOOLS:
        from verispec.bench.export_head import export_head

        eagle_dir = export_head(pipeline.eagle_head, pipe.target_runner, pipeline.target, export_head_dir)
        err.print(f"the EAGLE head as an EAGLE-3 checkpoint: {eagle_dir}", highlight=False, markup=False)
    export_advice(
        advice,
        export,
        export_file,
        pipeline.target,
        pipeline.draft_model,
        pipe.drafters,
        err,
        eagle_dir=None if eagle_dir is None else str(eagle_dir),
    )
