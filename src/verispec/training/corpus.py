"""Text corpora on disk: which files of the directories a user names are read as text.

Shared by ``datastore build`` (a suffix-array datastore) and ``train-head`` (code windows the
target reads teacher-forced). Knows nothing about tokenizers or models.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from verispec.errors import InvalidParameterError

TEXT_SUFFIXES = (
    ".py",
    ".txt",
    ".md",
    ".rst",
    ".json",
    ".jsonl",
    ".c",
    ".h",
    ".cpp",
    ".js",
    ".ts",
    ".java",
    ".go",
    ".rs",
    ".html",
    ".yaml",
    ".yml",
    ".toml",
    ".cfg",
    ".sh",
)


def corpus_files(paths: Sequence[Path], exclude: Sequence[str] = ()) -> list[Path]:
    """The files named, and the text files (by suffix) under the directories named, sorted,
    without those below a directory named in ``exclude`` (e.g. ``site-packages``).

    Raises:
        InvalidParameterError: a path that does not exist.
    """
    files = []
    skip = set(exclude)
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES and not skip & set(p.relative_to(path).parts[:-1])
            )
        elif path.is_file():
            files.append(path)
        else:
            raise InvalidParameterError(f"{path} does not exist")
    return files
