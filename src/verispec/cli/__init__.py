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

app = typer.Typer(help="verispec: lossless speculative decoding.", no_args_is_help=True, add_completion=False)
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
