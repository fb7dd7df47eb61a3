"""``verispec bench``: plain decoding, every speculative method and the peers on a workload, on
one or several runners in one run; optionally each runner's cost curve, prefill speed and
agreement with the float32 model. The measuring is :mod:`verispec.bench`'s; this module
parses, validates and prints. The report (tables, files written) goes to stdout, progress to stderr;
with ``--json`` stdout carries the JSON only and the report goes to stderr."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from verispec.cli.common import (
    K_BENCH,
    Categories,
    ChatTemplate,
    DraftQuantization,
    DraftVocab,
    DraftVocabCorpus,
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
from verispec.cli.options import PipelineOptions, from_params
from verispec.engine.loader import DEFAULT_TARGET
from verispec.errors import InvalidParameterError

# bench's own options, each declared once (the shared ones are verispec.cli.common's)
Limit = Annotated[int | None, typer.Option(help="Prompts per category at most.")]
Methods = Annotated[
    str | None, typer.Option(help="Comma-separated verispec methods (default: all loaded); none always runs.")
]
Peers = Annotated[str, typer.Option(help="Peers in the same loop: transformers, llama.cpp, or none.")]
Schedule = Annotated[
    str,
    typer.Option(
        help="Draft length: cost (the default, as generate and serve: the cost model, seeded with the machine's cost "
        "curve; drafts only where it expects a gain), heuristic or constant (every method at -k, even where "
        "slower than plain).",
    ),
]
MaxTokens = Annotated[
    int | None,
    typer.Option(help="New tokens at most per prompt (default 128; multiturn 64, completion 32 per request)."),
]
Temperature = Annotated[float, typer.Option(help="0 = greedy (checks exactness); > 0 samples.")]
Seed = Annotated[int, typer.Option(help="Seed of sampling runs (prompt i uses seed + i) and of the audit draws.")]
Sampling = Annotated[
    str,
    typer.Option(
        help="Sampled runs: coupled (a seed fixes the text under every method) "
        "or rejection (modified rejection sampling).",
    ),
]
Threads = Annotated[int | None, typer.Option(help="CPU threads for every runner (default: torch's).")]
AuditRate = Annotated[float, typer.Option(help="Fraction of speculative runs audited against plain decoding.")]
Warmup = Annotated[bool, typer.Option("--warmup/--no-warmup", help="One short untimed run per runner first.")]
Target = Annotated[str, target_option("Target model reference.")]
Draft = Annotated[str | None, draft_option()]
Runner = Annotated[
    str,
    runner_option(
        "Comma-separated runners compared in one run (as generate's --runner), e.g. gguf,int8,torch; transformers "
        "peers need torch."
    ),
]
Curves = Annotated[
    bool,
    typer.Option(
        "--curves/--no-curves", help="Also time one target pass of k = 1..16 tokens and one draft pass per runner."
    ),
]
PrefillTokens = Annotated[
    str,
    typer.Option(
        help="Also time one prefill of each of these prompt lengths per runner, e.g. 512,2048 (llama.cpp's beside "
        "when it is a peer).",
    ),
]
QualityPrompts = Annotated[
    int,
    typer.Option(
        min=0,
        help="Also score each runner against the float32 model (teacher-forced, 32 tokens) on the first N prompts.",
    ),
]
Out = Annotated[Path | None, typer.Option(help="Write results.json, report.md and PNG plots into this folder.")]
Quiet = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="No progress display (prompt i of n, method, decode tok/s so far) on stderr."),
]
AsJson = Annotated[bool, json_option("Also print the results (as results.json) as one JSON object on stdout.")]


def bench(
    workload: Workload = None,
    prompts: Prompts = None,
    categories: Categories = None,
    limit: Limit = None,
    methods: Methods = None,
    peers: Peers = "transformers,llama.cpp",
    num_speculative_tokens: NumSpeculativeTokens = K_BENCH,
    schedule: Schedule = "cost",
    max_tokens: MaxTokens = None,
    temperature: Temperature = 0.0,
    seed: Seed = 0,
    sampling: Sampling = "coupled",
    threads: Threads = None,
    chat: ChatTemplate = None,
    audit_rate: AuditRate = 0.0,
    warmup: Warmup = True,
    target: Target = DEFAULT_TARGET,
    draft: Draft = None,
    dtype: Dtype = "float32",
    runner: Runner = "auto",
    draft_quantization: DraftQuantization = "auto",
    eagle_head: EagleHead = None,
    head_quantization: HeadQuantization = "auto",
    draft_vocab: DraftVocab = None,
    draft_vocab_corpus: DraftVocabCorpus = None,
    curves: Curves = False,
    prefill_tokens: PrefillTokens = "",
    quality_prompts: QualityPrompts = 0,
    out: Out = None,
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Benchmark plain decoding, every speculative method and the peers, interleaved prompt by prompt."""
    params = dict(locals())
    from verispec.bench.sessions import SESSION_WORKLOADS

    if workload in SESSION_WORKLOADS and prompts is None:
        bench_sessions(params)
        return
    with user_errors():
        lengths = int_list(prefill_tokens, "--prefill-tokens")
        pipeline = PipelineOptions.from_cli(params, runners_listed=True).check_before_loading()
        items, config = bench_plan(params)
        results = run_bench(pipeline, items, config, params, lengths)
    report = err if as_json else Console()  # stdout is the JSON's with --json
    from verispec.bench.command import print_summary

    print_summary(results, report)
    if out is not None:
        report.print(
            f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results.plots)} plots", highlight=False
        )
    if as_json:
        print(json.dumps(results.to_dict(), ensure_ascii=False))


def bench_plan(params: dict[str, Any]):
    """The prompts and the run's configuration (checked before minutes of loading; no
    ``--methods``: :func:`run_bench` takes what the pipelines loaded); returns ``(items, config)``."""
    from verispec.bench.command import split
    from verispec.bench.run import BenchConfig
    from verispec.bench.workload import load_workload

    p = params
    items = load_workload(
        None if p["prompts"] else p["workload"] or "specbench", p["prompts"], split(p["categories"]), p["limit"]
    )
    config = from_params(
        BenchConfig,
        params,
        methods=tuple(split(p["methods"])),
        peers=tuple(peer for peer in split(p["peers"]) if peer != "none"),
        max_tokens=128 if p["max_tokens"] is None else p["max_tokens"],
    )
    return items, config


def run_bench(pipeline: PipelineOptions, items, config, params: dict[str, Any], lengths: tuple[int, ...]):
    """Load ``pipeline`` (checked) on each of its runners and run the benchmark; returns its results."""
    import dataclasses

    from verispec.bench.command import available_methods, load_pipelines, run_and_report

    p = params
    pipes, rss = load_pipelines(
        pipeline.target,
        pipeline.draft_model,
        pipeline.dtype,
        err,
        pipeline.runner_kinds,
        drafters=pipeline.drafters(),
        options=pipeline.runner_options("auto"),
    )
    if not config.methods:
        config = dataclasses.replace(config, methods=available_methods(pipes))
    return run_and_report(
        pipes,
        items,
        config,
        p["out"],
        workload=str(p["prompts"] or p["workload"] or "specbench"),
        dtype=pipeline.dtype,
        rss=rss,
        console=err,
        curves=p["curves"],
        prefill_tokens=lengths,
        quality_prompts=p["quality_prompts"],
        show_progress=not p["quiet"],
    )


def bench_sessions(params: dict[str, Any]) -> None:
    """``--workload multiturn`` / ``completion``: verispec with and without its prefix cache and
    llama-cpp-python reusing its previous prompt, fed the same requests (:mod:`verispec.bench.sessions`)."""
    from verispec.bench.sessions import SESSION_MAX_TOKENS

    p, workload = params, params["workload"]
    with user_errors():
        method = check_sessions(params)
        pipeline = PipelineOptions.from_cli(params, runners_listed=True).check_before_loading()
        pipe, results = run_sessions(
            pipeline, method, SESSION_MAX_TOKENS[workload] if p["max_tokens"] is None else p["max_tokens"], params
        )
    report_sessions(pipe, results, workload, p["out"], p["as_json"])


def check_sessions(params: dict[str, Any]) -> str:
    """The session workloads' own refusals; returns the one method. Raises InvalidParameterError."""
    from verispec.bench.command import split
    from verispec.bench.sessions import check_sessions_limit

    workload = params["workload"]
    check_sessions_limit(params["limit"], workload)
    chosen = split(params["methods"]) or ["auto"]
    if len(chosen) > 1:
        raise InvalidParameterError(f"the {workload} workload runs one method (--methods auto, draft, none, ...)")
    kinds = split(params["runner"]) or ["auto"]
    if len(kinds) > 1:
        raise InvalidParameterError(f"the {workload} workload runs one runner (--runner gguf or int8)")
    unknown_peers = [p for p in split(params["peers"]) if p not in ("llama.cpp", "transformers", "none")]
    if unknown_peers:
        raise InvalidParameterError(f"unknown peer {', '.join(unknown_peers)}; choose llama.cpp or none")
    return chosen[0]


def run_sessions(pipeline: PipelineOptions, method: str, max_tokens: int, params: dict[str, Any]):
    """Load ``pipeline`` (checked; float32, no drafter options) and feed it the sessions, beside
    llama.cpp where it is a peer and installed; returns ``(pipe, results)``."""
    from verispec.bench.command import load_pipelines, split
    from verispec.bench.peers import LlamaCppPeer
    from verispec.bench.sessions import run_sessions as run
    from verispec.bench.sessions import warm_up

    pipes, _ = load_pipelines(
        pipeline.target, pipeline.draft_model, "float32", err, pipeline.runner_kinds, options=None
    )
    pipe = next(iter(pipes.values()))
    peer = None
    if (
        "llama.cpp" in split(params["peers"])
        and pipe.target.path is not None
        and str(pipe.target.path).endswith(".gguf")
    ):
        try:
            peer = LlamaCppPeer(str(pipe.target.path), pipe.tokenizer, pipe.target.eos_token_ids, torch_threads())
        except ImportError:
            err.print("llama.cpp peer: llama-cpp-python is not installed (make install-llamacpp); skipped")
    warm_up(pipe, peer, method)
    results = run(
        pipe,
        params["workload"],
        method=method,
        max_tokens=max_tokens,
        num_speculative_tokens=params["num_speculative_tokens"],
        schedule=params["schedule"],
        peer=peer,
        num_sessions=params["limit"],
        on_request=lambda name, r: err.print(
            f"session {r.session + 1} request {r.turn + 1}: {name} ({len(r.prompt_token_ids)} prompt tokens)",
            highlight=False,
        ),
    )
    return pipe, results


def report_sessions(pipe, results, workload: str, out: Path | None, as_json: bool) -> None:
    """The sessions' table and notes (stdout, stderr with ``as_json``), and their JSON."""
    from rich.table import Table

    from verispec.bench.sessions import session_markdown, session_table

    rows = session_table(results)
    table = Table(title=f"{workload}: {results.max_tokens} tokens a request, greedy ({pipe.runner_choice.label})")
    for column in rows[0]:
        table.add_column(column)
    for row in rows[1:]:
        table.add_row(*row)
    report = err if as_json else Console()
    report.print(table)
    report.print(session_markdown(results), highlight=False, markup=False, soft_wrap=True)
    for note in results.notes:
        report.print(note, highlight=False)
    data = results.to_dict() | {"runner": pipe.runner_kind, **pipe.runner_choice.facts}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{workload}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False))
        report.print(f"wrote {out / f'{workload}.json'}", highlight=False)
    if as_json:
        print(json.dumps(data, ensure_ascii=False))


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def int_list(text: str, option: str) -> tuple[int, ...]:
    """``"512,2048"`` -> (512, 2048); ``""`` -> ().

    Raises:
        InvalidParameterError: anything but comma-separated positive integers.
    """
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise InvalidParameterError(f"{option} takes comma-separated positive integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise InvalidParameterError(f"{option} takes positive integers, got {text!r}")
    return values
