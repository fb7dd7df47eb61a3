"""The ``verispec models`` sub-commands: list the built-in models, fetch one into the cache, and
export a model's tokenizer as a Hugging Face tokenizer folder.

Only parses arguments and formats output; the store does the work. Mounted by
:mod:`verispec.cli` as ``verispec models``.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from verispec.cli.common import json_option, user_errors
from verispec.models.store import ModelStore
from verispec.progress import announce_slow

models_app = typer.Typer(
    help="List and fetch the built-in models; export a model's tokenizer.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)

_CACHE_LABELS = {"cached": "yes", "unverified": "changed", "missing": "no"}


@models_app.command("list")
def list_models(
    paths: bool = typer.Option(
        False, "--paths", help="Print NAME<tab>PATH per model (the full path of its file), no table."
    ),
    as_json: Annotated[
        bool, json_option("Print one JSON object a line, one per model, with the full path of its file.")
    ] = False,
) -> None:
    """Show the built-in models, their roles, sizes, licences and whether they are in the cache.

    The table keeps one line per model at 80 columns; the files' paths follow it in one line
    (``--paths`` or ``--json``: each model's full path)."""
    store = ModelStore()
    cache_root = store.home / "models"
    with user_errors():
        rows = [
            {
                "name": name,
                "role": entry.role,
                "arch": entry.arch,
                "quantization": entry.quantization,
                "size_bytes": entry.size_bytes,
                "license": entry.license,
                "cached": store.cache_state(name),
                "path": str(store.model_path(name)),
            }
            for name, entry in store.registry.items()
        ]
    if as_json or paths:
        for row in rows:
            typer.echo(json.dumps(row) if as_json else f"{row['name']}\t{row['path']}")
        return
    table = Table(
        title="Built-in models",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for column in ("name", "role", "arch", "size", "cached"):
        table.add_column(column, no_wrap=True)
    for row in rows:
        table.add_row(
            row["name"],
            row["role"] or "—",
            f"{row['arch']} {row['quantization']}",
            _format_bytes(row["size_bytes"]),
            _CACHE_LABELS[row["cached"]],
        )
    console = Console()
    console.print(table)
    console.print(_licence_line(store.registry.values()), highlight=False, soft_wrap=True)
    console.print("files (full paths: verispec models list --paths):", highlight=False)
    console.print(f"  {cache_root}/NAME/FILE", highlight=False, soft_wrap=True)  # a path is never folded
    if any(row["cached"] == "unverified" for row in rows):
        console.print(
            "changed: the file differs from when it was verified; it is re-hashed on its next use", highlight=False
        )


@models_app.command("fetch")
def fetch_model(
    name: str = typer.Argument(..., help="Built-in model name (see `verispec models list`)."),
    force: bool = typer.Option(False, "--force", help="Delete any cached copy and download again."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Download and verify a built-in model, then print the path of its file."""
    # a terminal gets the store's byte bar; a log or pipe (where a bar shows nothing) a line every 8 s
    lines = (
        announce_slow(f"fetching {name}", "download and sha256 check")
        if not quiet and not sys.stderr.isatty()
        else nullcontext()
    )
    with user_errors(), lines:
        path = ModelStore(progress=not quiet).fetch(name, force=force)
    typer.echo(str(path))


@models_app.command("export-tokenizer")
def export_tokenizer(
    name: str = typer.Argument(..., help="Model: built-in name, .gguf file or checkpoint folder."),
    directory: Path = typer.Argument(..., help="Folder to write the tokenizer into (created)."),
) -> None:
    """Write the model's tokenizer as a folder transformers.AutoTokenizer loads (tokenizer.json,
    tokenizer_config.json, the chat template), tokenizing exactly as verispec and its server's
    /tokenize do: for tools that need a Hugging Face tokenizer beside the server, such as
    lm-evaluation-harness's loglikelihood tasks. Prints the folder."""
    from verispec.models.tokenizer_export import export_tokenizer as export

    with user_errors(), announce_slow(f"writing the tokenizer of {name}", "built from the model file once, cached"):
        folder = export(name, directory)
    typer.echo(str(folder))


def _licence_line(entries) -> str:
    """``licences: Apache-2.0`` and, for each model under other terms, a line with its name and
    licence and one with the terms' URL (every line within 80 columns)."""
    others = [entry for entry in entries if entry.license != "Apache-2.0"]
    if not others:
        return "licences: Apache-2.0"
    lines = ["licences: Apache-2.0, except"]
    for e in others:
        lines.append(f"  {e.name}: {e.license}")
        if e.license_url:
            lines.append(f"    {e.license_url}")
    return "\n".join(lines)


def _format_bytes(size: int) -> str:
    if size >= 1e9:
        return f"{size / 1e9:.2f} GB"
    if size >= 1e6:
        return f"{size / 1e6:.1f} MB"
    return f"{size / 1e3:.1f} KB"
