"""Command-line interface: parse, validate, call the pipeline, format. One module per command.

Generated text goes to stdout as it is accepted; statistics, progress and errors go to stderr so
the text can be piped. A user mistake prints ``error: ...`` and exits with status 2, never a
traceback (:func:`verispec.cli.common.user_errors`). Knows nothing about decoding internals.
"""

from __future__ import annotations

import typer

from verispec.cli.advise import advise
from verispec.cli.bench import bench
from verispec.cli.datastore import datastore_app
from verispec.cli.export_head import export_head
from verispec.cli.generate import generate
from verispec.cli.models import models_app
from verispec.cli.serve import serve
from verispec.cli.train_head import train_head

# help as click writes it, wrapped to the terminal: rich's option panels cut long option names and
# defaults to "…" at 80 columns and fold the help into 20-column cells
PLAIN_HELP = {"rich_markup_mode": None, "no_args_is_help": True}
app = typer.Typer(help="verispec: lossless speculative decoding.", add_completion=False, **PLAIN_HELP)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"verispec {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """verispec: lossless speculative decoding."""


def package_version() -> str:
    """The installed distribution's version (``pip show verispec``), else ``verispec.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verispec")
    except PackageNotFoundError:
        from verispec import __version__

        return __version__


app.command()(generate)
app.command()(serve)
app.command()(bench)
app.command()(advise)
app.command("train-head")(train_head)
app.command("export-head")(export_head)
app.add_typer(models_app, name="models")
app.add_typer(datastore_app, name="datastore")


def main() -> None:  # pragma: no cover - console script entry
    app()


__all__ = ["app", "main"]
