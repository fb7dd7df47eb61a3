"""The ``verispec models`` sub-commands: list the built-in models and fetch one into the cache.

Only parses arguments and formats output; the store does the work. Mounted by
:mod:`verispec.cli` as ``verispec models``.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import typer
from rich.console import Console
from rich.table import Table

from verispec.cli.common import user_errors
from verispec.models.store import ModelStore
from verispec.progress import announce_slow

models_app = typer.Typer(
    help="List and fetch the built-in models.", no_args_is_help=True, add_completion=False
)

_CACHE_LABELS = {"cached": "yes", "unverified": "changed (re-checked on use)", "missing": "no"}


@models_app.command("list")
def list_models() -> None:
    """Show the built-in models, their roles and whether they are in the cache."""
    store = ModelStore()
    cache_root = store.home / "models"
    table = Table(title=f"Built-in models (paths relative to {cache_root})")
    table.add_column("name", no_wrap=True)
    for column in ("role", "arch", "size", "cached"):
        table.add_column(column)
    table.add_column("path", overflow="fold")
    with user_errors():
        for name, entry in store.registry.items():
            table.add_row(
                name,
                entry.role or "—",
                f"{entry.arch} {entry.quantization}",
                _format_bytes(entry.size_bytes),
                _CACHE_LABELS[store.cache_state(name)],
                str(store.model_path(name).relative_to(cache_root)),
            )
    Console().print(table)


@models_app.command("fetch")
def fetch_model(
    name: str = typer.Argument(..., help="Built-in model name (see `verispec models list`)."),
    force: bool = typer.Option(False, "--force", help="Delete any cached copy and download again."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Download and verify a built-in model, then print the path of its file."""
    # a terminal gets the store's byte bar; a log or pipe (where a bar shows nothing) a line every 8 s
    lines = announce_slow(f"fetching {name}", "download and sha256 check") if not quiet and not sys.stderr.isatty() else nullcontext()
    with user_errors(), lines:
        path = ModelStore(progress=not quiet).fetch(name, force=force)
    typer.echo(str(path))


def _format_bytes(size: int) -> str:
    if size >= 1e9:
        return f"{size / 1e9:.2f} GB"
    if size >= 1e6:
        return f"{size / 1e6:.1f} MB"
    return f"{size / 1e3:.1f} KB"
