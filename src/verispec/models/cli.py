"""The ``verispec models`` sub-commands: list the built-in models and fetch one into the cache.

Only parses arguments and formats output; the store does the work. Mounted by the main CLI with
``app.add_typer(models_app, name="models")``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.table import Table

from verispec.errors import VerispecError
from verispec.models.store import ModelStore

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
    with _user_errors():
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
    with _user_errors():
        path = ModelStore(progress=not quiet).fetch(name, force=force)
    typer.echo(str(path))


@contextmanager
def _user_errors() -> Iterator[None]:
    """Print a VerispecError as ``error: ...`` in red on stderr and exit with code 2."""
    try:
        yield
    except VerispecError as exc:
        Console(stderr=True).print(
            f"error: {exc}", style="red", markup=False, highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None


def _format_bytes(size: int) -> str:
    if size >= 1e9:
        return f"{size / 1e9:.2f} GB"
    if size >= 1e6:
        return f"{size / 1e6:.1f} MB"
    return f"{size / 1e3:.1f} KB"
