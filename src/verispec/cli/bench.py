"""``verispec bench``: plain decoding, every speculative method and the peers on a workload, on
one or several runners in one run; optionally each runner's cost curve, prefill speed and
agreement with the float32 model. The measuring is :mod:`verispec.bench`'s; this module
parses, validates and prints. The report (tables, files written) goes to stdout, progress to stderr;
with ``--json`` stdout carries the JSON only and the report goes to stderr."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer
from rich.console import Console

from verispec.cli.common import (
    K_BENCH,
    categories_option,
    chat_template_option,
    draft_option,
    draft_quantization_option,
    draft_vocab_corpus_option,
    draft_vocab_option,
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


def bench(
    workload: str | None = workload_option(),
    prompts: Path | None = prompts_option(),
    categories: str | None = categories_option(),
    limit: int | None = typer.Option(None, help="Prompts per category at most."),
    methods: str | None = typer.Option(
        None, help="Comma-separated verispec methods (default: all loaded); none always runs."
    ),
    peers: str = typer.Option(
        "transformers,llama.cpp", help="Peers in the same loop: transformers, llama.cpp, or none."
    ),
    num_speculative_tokens: int = num_speculative_tokens_option(K_BENCH),
    schedule: str = typer.Option(
        "cost",
        help="Draft length: cost (the default, as generate and serve: the cost model, seeded with the machine's cost "
        "curve; drafts only where it expects a gain), heuristic or constant (every method at -k, even where "
        "slower than plain).",
    ),
    max_tokens: int | None = typer.Option(
        None, help="New tokens at most per prompt (default 128; multiturn 64, completion 32 per request)."
    ),
    temperature: float = typer.Option(0.0, help="0 = greedy (checks exactness); > 0 samples."),
    seed: int = typer.Option(0, help="Seed of sampling runs (prompt i uses seed + i) and of the audit draws."),
    sampling: str = typer.Option(
        "coupled",
        help="Sampled runs: coupled (a seed fixes the text under every method) "
        "or rejection (modified rejection sampling).",
    ),
    threads: int | None = typer.Option(None, help="CPU threads for every runner (default: torch's)."),
    chat: bool | None = chat_template_option(),
    audit_rate: float = typer.Option(0.0, help="Fraction of speculative runs audited against plain decoding."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="One short untimed run per runner first."),
    target: str = target_option("Target model reference."),
    draft: str | None = draft_option(),
    dtype: str = dtype_option(),
    runner: str = runner_option(
        "Comma-separated runners compared in one run (as generate's --runner), e.g. gguf,int8,torch; transformers "
        "peers need torch."
    ),
    draft_quantization: str = draft_quantization_option(),
    eagle_head: Path | None = eagle_head_option(),
    head_quantization: str = head_quantization_option(),
    draft_vocab: int | None = draft_vocab_option(),
    draft_vocab_corpus: list[str] | None = draft_vocab_corpus_option(),
    curves: bool = typer.Option(
        False,
        "--curves/--no-curves",
        help="Also time one target pass of k = 1..16 tokens and one draft pass per runner.",
    ),
    prefill_tokens: str = typer.Option(
        "",
        help="Also time one prefill of each of these prompt lengths per runner, e.g. 512,2048 (llama.cpp's beside "
        "when it is a peer).",
    ),
    quality_prompts: int = typer.Option(
        0,
        min=0,
        help="Also score each runner against the float32 model (teacher-forced, 32 tokens) on the first N prompts.",
    ),
    out: Path | None = typer.Option(None, help="Write results.json, report.md and PNG plots into this folder."),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No progress display (prompt i of n, method, decode tok/s so far) on stderr."
    ),
    as_json: bool = json_option("Also print the results (as results.json) as one JSON object on stdout."),
) -> None:
    """Benchmark plain decoding, every speculative method and the peers, interleaved prompt by prompt."""
    from verispec.bench.command import available_methods, load_pipelines, print_summary, run_and_report, split
    from verispec.bench.run import BenchConfig
    from verispec.bench.sessions import SESSION_MAX_TOKENS, SESSION_WORKLOADS
    from verispec.bench.workload import load_workload
    from verispec.engine.loader import DrafterOptions
    from verispec.runners.select import RUNNERS, RunnerOptions

    if workload in SESSION_WORKLOADS and prompts is None:
        bench_sessions(
            workload,
            target,
            draft,
            runner,
            methods,
            peers,
            limit,
            SESSION_MAX_TOKENS[workload] if max_tokens is None else max_tokens,
            num_speculative_tokens,
            schedule,
            out,
            as_json,
        )
        return
    max_tokens = 128 if max_tokens is None else max_tokens
    with user_errors():
        lengths = int_list(prefill_tokens, "--prefill-tokens")
        kinds = split(runner) or ["auto"]
        unknown = [k for k in kinds if k not in RUNNERS]
        if unknown:
            raise InvalidParameterError(f"unknown runner {', '.join(unknown)}; choose from {', '.join(RUNNERS)}")
        items = load_workload(None if prompts else workload or "specbench", prompts, split(categories), limit)
        drafters = DrafterOptions(
            draft_quantization=draft_quantization, eagle_head=eagle_head, head_quantization=head_quantization
        )
        options = RunnerOptions(draft_vocab_size=draft_vocab, draft_vocab_corpus=tuple(draft_vocab_corpus or ()))
        config = BenchConfig(  # checked before minutes of loading; no --methods: what the pipelines loaded
            methods=tuple(split(methods)),
            peers=tuple(p for p in split(peers) if p != "none"),
            num_speculative_tokens=num_speculative_tokens,
            schedule=schedule,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            sampling=sampling,
            threads=threads,
            warmup=warmup,
            chat=chat,
            audit_rate=audit_rate,
        )
        draft = resolve_draft(target, draft)
        pipes, rss = load_pipelines(target, draft, dtype, err, kinds, drafters=drafters, options=options)
        if not split(methods):
            config = dataclasses.replace(config, methods=available_methods(pipes))
        results = run_and_report(
            pipes,
            items,
            config,
            out,
            workload=str(prompts or workload or "specbench"),
            dtype=dtype,
            rss=rss,
            console=err,
            curves=curves,
            prefill_tokens=lengths,
            quality_prompts=quality_prompts,
            show_progress=not quiet,
        )
    report = err if as_json else Console()  # stdout is the JSON's with --json
    print_summary(results, report)
    if out is not None:
        report.print(
            f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results.plots)} plots", highlight=False
        )
    if as_json:
        print(json.dumps(results.to_dict(), ensure_ascii=False))


def bench_sessions(
    workload: str,
    target: str,
    draft: str | None,
    runner: str,
    methods: str | None,
    peers: str,
    limit: int | None,
    max_tokens: int,
    num_speculative_tokens: int,
    schedule: str,
    out: Path | None,
    as_json: bool,
) -> None:
    """``--workload multiturn`` / ``completion``: verispec with and without its prefix cache and
    llama-cpp-python reusing its previous prompt, fed the same requests (:mod:`verispec.bench.sessions`)."""
    from rich.table import Table

    from verispec.bench.command import load_pipelines, split
    from verispec.bench.peers import LlamaCppPeer
    from verispec.bench.sessions import (
        check_sessions_limit,
        run_sessions,
        session_markdown,
        session_table,
        warm_up,
    )

    with user_errors():
        check_sessions_limit(limit, workload)
        chosen = split(methods) or ["auto"]
        if len(chosen) > 1:
            raise InvalidParameterError(f"the {workload} workload runs one method (--methods auto, draft, none, ...)")
        kinds = split(runner) or ["auto"]
        if len(kinds) > 1:
            raise InvalidParameterError(f"the {workload} workload runs one runner (--runner gguf or int8)")
        unknown_peers = [p for p in split(peers) if p not in ("llama.cpp", "transformers", "none")]
        if unknown_peers:
            raise InvalidParameterError(f"unknown peer {', '.join(unknown_peers)}; choose llama.cpp or none")
        pipes, _ = load_pipelines(target, resolve_draft(target, draft), "float32", err, kinds, options=None)
        pipe = next(iter(pipes.values()))
        peer = None
        if "llama.cpp" in split(peers) and pipe.target.path is not None and str(pipe.target.path).endswith(".gguf"):
            try:
                peer = LlamaCppPeer(str(pipe.target.path), pipe.tokenizer, pipe.target.eos_token_ids, torch_threads())
            except ImportError:
                err.print("llama.cpp peer: llama-cpp-python is not installed (make install-llamacpp); skipped")
        warm_up(pipe, peer, chosen[0])
        results = run_sessions(
            pipe,
            workload,
            method=chosen[0],
            max_tokens=max_tokens,
            num_speculative_tokens=num_speculative_tokens,
            schedule=schedule,
            peer=peer,
            num_sessions=limit,
            on_request=lambda name, r: err.print(
                f"session {r.session + 1} request {r.turn + 1}: {name} ({len(r.prompt_token_ids)} prompt tokens)",
                highlight=False,
            ),
        )
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
