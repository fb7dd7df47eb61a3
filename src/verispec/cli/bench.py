"""``verispec bench`` (plain decoding, every speculative method and the peers on a workload) and
``verispec bench-runners`` (each runner's cost curves and tokens/s beside llama.cpp). The
measuring is :mod:`verispec.ops.bench`'s; this module parses, validates and prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from verispec.cli.common import (
    K_BENCH,
    K_BENCH_RUNNERS,
    categories_option,
    chat_template_option,
    draft_option,
    draft_or_none,
    dtype_option,
    err,
    num_speculative_tokens_option,
    prompts_option,
    runner_option,
    target_option,
    user_errors,
    workload_option,
)
from verispec.errors import InvalidParameterError


def bench(
    workload: Optional[str] = workload_option(),
    prompts: Optional[Path] = prompts_option(),
    categories: Optional[str] = categories_option(),
    limit: Optional[int] = typer.Option(None, help="Prompts per category at most."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated verispec methods (default: all loaded); none always runs."),
    peers: str = typer.Option("transformers,llama.cpp", help="Peers in the same loop: transformers, llama.cpp, or none."),
    num_speculative_tokens: int = num_speculative_tokens_option(K_BENCH),
    max_tokens: int = typer.Option(128, help="New tokens at most per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy (checks exactness); > 0 samples."),
    seed: int = typer.Option(0, help="Seed of sampling runs (prompt i uses seed + i) and of the audit draws."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for every runner (default: torch's)."),
    chat: Optional[bool] = chat_template_option(),
    audit_rate: float = typer.Option(0.0, help="Fraction of speculative runs audited against plain decoding."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="One short untimed run per runner first."),
    target: str = target_option("Target model reference."),
    draft: str = draft_option(),
    dtype: str = dtype_option(),
    runner: str = runner_option("Comma-separated runners compared in one run (as generate's --runner), e.g. gguf,int8,torch; transformers peers need torch."),
    curves: bool = typer.Option(False, "--curves/--no-curves", help="Also time one target pass of k = 1..16 tokens and one draft pass per runner."),
    out: Optional[Path] = typer.Option(None, help="Write results.json, report.md and PNG plots into this folder."),
) -> None:
    """Benchmark plain decoding, every speculative method and the peers, interleaved prompt by prompt."""
    from verispec.ops.bench.command import available_methods, load_pipelines, print_summary, run_and_report, split
    from verispec.ops.bench.run import BenchConfig
    from verispec.ops.bench.workload import load_workload
    from verispec.runners.select import RUNNERS

    with user_errors():
        kinds = split(runner) or ["auto"]
        unknown = [k for k in kinds if k not in RUNNERS]
        if unknown:
            raise InvalidParameterError(f"unknown runner {', '.join(unknown)}; choose from {', '.join(RUNNERS)}")
        items = load_workload(None if prompts else workload or "specbench", prompts, split(categories), limit)
        pipes, rss = load_pipelines(target, draft_or_none(draft), dtype, err, kinds)
        config = BenchConfig(
            methods=tuple(split(methods) or available_methods(pipes)),
            peers=tuple(p for p in split(peers) if p != "none"),
            num_speculative_tokens=num_speculative_tokens,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            threads=threads,
            warmup=warmup,
            chat=chat,
            audit_rate=audit_rate,
        )
        results = run_and_report(pipes, items, config, out, workload=str(prompts or workload or "specbench"), dtype=dtype, rss=rss,
                                 console=err, curves=curves)
    print_summary(results, err)
    if out is not None:
        err.print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results.plots)} plots")


def int_list(text: str, option: str) -> tuple[int, ...]:
    """``"512,2048"`` -> (512, 2048).

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


def bench_runners(
    runners: str = typer.Option("gguf,llamacpp", help="Comma-separated runners: gguf, int8, llamacpp, torch (slow)."),
    methods: str = typer.Option("none,ngram,draft,draft-frspec,tree,auto", help="Comma-separated: none, ngram, draft, draft-frspec, tree, auto."),
    prompts: Optional[Path] = prompts_option("JSONL file with a 'prompt' per line (default: HumanEval dev from the shared data)."),
    num_prompts: int = typer.Option(10, min=1, help="Prompts decoded by every method."),
    max_tokens: int = typer.Option(128, min=1, help="New tokens per prompt at most (greedy, stop at EOS)."),
    num_speculative_tokens: int = num_speculative_tokens_option(K_BENCH_RUNNERS),
    schedule: str = typer.Option("constant", help="constant, heuristic or cost (seeded with the measured curve)."),
    draft_vocab: int = typer.Option(32768, help="Rows of the reduced draft head (draft-frspec)."),
    draft_quantization: str = typer.Option("iq4_nl", help="The gguf runner's drafts: iq4_nl (re-quantized as they load, the default of generate/serve), q4_0, or none (the file's blocks)."),
    draft_vocab_corpus: Optional[List[str]] = typer.Option(None, help="Files/directories counted for draft-frspec (default: Python stdlib)."),
    exactness_prompts: int = typer.Option(0, min=0, help="Also compare plain vs speculative output (32 tokens) on this many prompts."),
    quality_prompts: int = typer.Option(0, min=0, help="Also score each runner against the float32 model (teacher-forced, 32 tokens) on this many prompts."),
    prefill_tokens: str = typer.Option("", help="Also time one prefill of each of these prompt lengths, e.g. 512,2048 (llama.cpp beside)."),
    threads: int = typer.Option(0, min=0, help="CPU threads for every runner and the peer (0: torch's default)."),
    peer: bool = typer.Option(True, "--peer/--no-peer", help="Time llama-cpp-python's own plain decoding of the target GGUF."),
    target: str = target_option("Target model (a GGUF reference)."),
    draft: str = draft_option("Draft model (a GGUF reference)."),
    out: Path = typer.Option(Path("bench-runners.json"), help="Where to write the JSON report."),
) -> None:
    """Cost curves and end-to-end tokens/s of each runner and method, beside llama.cpp's plain decoding."""
    from verispec.ops.bench.runner_compare import RunnersBenchConfig, run_runners_bench
    from verispec.ops.bench.runners_table import format_table

    with user_errors():
        config = RunnersBenchConfig(
            target=target, draft=draft, runners=tuple(r for r in runners.split(",") if r), methods=tuple(m for m in methods.split(",") if m),
            prompts_file=str(prompts or ""), num_prompts=num_prompts, max_tokens=max_tokens, num_speculative_tokens=num_speculative_tokens,
            schedule=schedule, draft_vocab_size=draft_vocab, draft_vocab_corpus=tuple(draft_vocab_corpus or ()),
            exactness_prompts=exactness_prompts, threads=threads, peer=peer, draft_quantization=draft_quantization,
            prefill_tokens=int_list(prefill_tokens, "--prefill-tokens"), quality_prompts=quality_prompts,
        )
        report = run_runners_bench(config, log=lambda line: err.print(line, highlight=False, markup=False))
    out.write_text(json.dumps(report, indent=1))
    for table in format_table(report):
        err.print(table)
    err.print(f"wrote {out}")
