"""``verispec datastore build``: a corpus (files, directories) tokenized with the target's
tokenizer into a suffix-array datastore for the ``suffix`` drafter (``--datastore DIR``). Progress
(file i of n, tokens so far, then the sort) on stderr (:func:`verispec.progress.steps`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from verispec.cli.common import err, target_option, user_errors
from verispec.engine.loader import DEFAULT_TARGET
from verispec.errors import InvalidParameterError
from verispec.progress import steps
from verispec.training.corpus import corpus_files

datastore_app = typer.Typer(
    help="Static corpora for suffix drafting (REST-style retrieval).", no_args_is_help=True, rich_markup_mode=None
)


@datastore_app.command("build")
def build(
    corpus: list[Path] = typer.Argument(..., help="Files and directories (their text files, recursively)."),
    out: Path = typer.Option(..., help="Directory to write the datastore to."),
    target: Annotated[
        str, target_option("The model whose tokenizer tokenizes the corpus (the target you serve).")
    ] = DEFAULT_TARGET,
    depth: int = typer.Option(8, min=1, max=32, help="Longest n-gram the datastore can match."),
    exclude: list[str] = typer.Option([], help="Directory names to skip inside the corpus directories (repeatable)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display on stderr."),
) -> None:
    """Tokenize CORPUS with the target's tokenizer and write its suffix array to --out."""
    from verispec.models.loading import load_gguf_info
    from verispec.proposers.datastore import build_datastore

    with user_errors(OSError):
        if (
            not str(out)
            or out.is_file()
            or (out.is_dir() and any(out.iterdir()) and not (out / "datastore.json").exists())
        ):
            raise InvalidParameterError(f"--out {str(out)!r} must be a new or empty directory, or an earlier datastore")
        files = corpus_files(corpus, exclude)
        if not files:
            raise typer.BadParameter("no text files in the corpus")
        tokenizer = load_gguf_info(target, runner="gguf").tokenizer
        start = time.perf_counter()

        with steps("datastore file", len(files), enabled=not quiet, console=err) as shown:

            def documents():
                num_tokens = 0
                for path in files:
                    shown.running(f"tokenizing {path}")
                    text = path.read_text(encoding="utf-8", errors="replace")
                    ids = tokenizer.encode(text, add_special_tokens=False) if text.strip() else []
                    num_tokens += len(ids)
                    shown.after = f"sorting the suffixes of {num_tokens} tokens and writing {out}"
                    shown.finished(f"tokenized {path}", f"{num_tokens} tokens so far")
                    if ids:
                        yield ids

            summary = build_datastore(documents(), out, depth=depth)
    err.print(
        f"{summary['num_documents']} documents, {summary['num_tokens']} tokens -> {out} in "
        f"{time.perf_counter() - start:.1f} s"
    )
