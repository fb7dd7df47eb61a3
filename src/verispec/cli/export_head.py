"""``verispec export-head``: a verispec EAGLE head file as the Hugging Face EAGLE-3 checkpoint vLLM
and SGLang serve (:mod:`verispec.bench.export_head`); this module parses, validates and prints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from verispec.cli.common import err, runner_option, target_option, user_errors
from verispec.cli.options import PipelineOptions
from verispec.engine.loader import DEFAULT_TARGET


def export_head(
    head: Path = typer.Argument(..., help="The head file (verispec train-head)."),
    out: Path | None = typer.Option(
        None, help="Folder to write (config.json, model.safetensors); default: beside the head, NAME-eagle3."
    ),
    target: Annotated[
        str,
        target_option("The target the head drafts for (it lends the embedding and, for a shared LM head, its rows)."),
    ] = DEFAULT_TARGET,
    dtype: str = typer.Option("bfloat16", help="Weights of the checkpoint: bfloat16, float16 or float32."),
    runner: Annotated[str, runner_option("Runner that holds the target while converting (default auto).")] = "auto",
) -> None:
    """Write HEAD as an EAGLE-3 checkpoint folder for vLLM (--speculative-config method eagle3) and SGLang (EAGLE3)."""
    from verispec.bench.export_head import export_head as run_export

    with user_errors(OSError):
        pipe = PipelineOptions(target, method="none", one_method=True, runner=runner).check_before_loading().load()
        folder = run_export(head, pipe.target_runner, target, out, dtype=dtype)
    err.print(
        f"wrote {folder} (config.json, model.safetensors): vLLM --speculative-config "
        f'\'{{"method": "eagle3", "model": "{folder}", "num_speculative_tokens": 4}}\'; '
        f"SGLang --speculative-algorithm EAGLE3 --speculative-draft-model-path {folder}",
        highlight=False,
        markup=False,
    )
