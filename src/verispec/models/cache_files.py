"""Cache files verispec writes and reads back: published atomically, checked before trusted.

Owns how a cache file is written (a temporary file in the same folder, flushed and fsynced, then
renamed over the old one, so a crash or a full disk leaves the old file or the new one, never
part of one), the checked file format (a one-line JSON header naming the kind, size and sha256 of
the payload that follows it), and the one stderr line that says a damaged file was found and what
happens instead. Knows nothing about what the files hold: costs, weights, kernels and the suffix
cache each choose their payload.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from verispec.errors import CacheFileError

MAX_HEADER_BYTES = 4096  # a header line longer than this is not one of ours
HEADER_START = b'{"kind": "'  # how every header line begins (json.dumps of a dict whose first key is kind)
_REPORTED: set[tuple[str, str]] = set()


class ForeignFileError(CacheFileError):
    """The file has no header of the kind asked for: another format, or an older verispec's (a
    caller that would overwrite it may refuse instead: it may not be a cache at all)."""


def atomic_write(path: Path | str, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` (bytes, or a function writing into a binary file) to ``path`` atomically.

    The bytes go to a temporary file beside ``path`` (same folder, so same file system), are
    flushed and fsynced, and the file is renamed over ``path``; the folder is fsynced too where
    the platform allows. Raises OSError (or whatever ``data`` raises) and then leaves ``path`` as
    it was and no temporary file behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            if callable(data):
                data(out)
            else:
                out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def checked_bytes(kind: str, payload: bytes) -> bytes:
    """``payload`` behind its header line ``{"kind", "size", "sha256"}`` (what :func:`read_checked` checks)."""
    header = {"kind": kind, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    return json.dumps(header).encode() + b"\n" + payload


def write_checked(path: Path | str, kind: str, payload: bytes) -> None:
    """Write ``payload`` with its header to ``path`` atomically (:func:`atomic_write`). Raises OSError."""
    atomic_write(path, checked_bytes(kind, payload))


def read_checked(path: Path | str, kind: str) -> bytes:
    """The payload of the checked file ``path`` of ``kind``, after its size and sha256 match.

    Raises:
        FileNotFoundError: there is no file (not damage: nothing was cached yet).
        ForeignFileError: no header of ``kind`` (another format, or an older verispec's).
        CacheFileError: cut within its header, shorter or longer than its header says
            (truncated), or its sha256 differs (corrupt); the message says which.
        OSError: other failures to read it.
    """
    with open(path, "rb") as source:
        line = source.readline(MAX_HEADER_BYTES)
        payload = source.read()
    if line.startswith(HEADER_START) and not line.endswith(b"\n"):
        raise CacheFileError("ends within its header (truncated)")
    try:
        header = json.loads(line)
        size, digest = int(header["size"]), str(header["sha256"])
        if header["kind"] != kind:
            raise ForeignFileError(f"holds {header['kind']!r}, not {kind!r}")
    except (ValueError, KeyError, TypeError):
        raise ForeignFileError("has no verispec header (another format or an older verispec's)") from None
    if len(payload) != size:
        raise CacheFileError(f"has {len(payload)} bytes after its header, not {size} (truncated or appended to)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CacheFileError("fails its sha256 check (corrupt)")
    return payload


def report_damaged(path: Path | str, problem: str, action: str) -> None:
    """Say on stderr, once per file and problem in this process, that the cache file ``path``
    ``problem`` and what happens instead (``action``: "measured again", "built again", ...)."""
    key = (str(path), problem)
    if key not in _REPORTED:
        _REPORTED.add(key)
        print(f"verispec: cache file {path} {problem}; {action}", file=sys.stderr, flush=True)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX); a no-op where folders cannot be opened."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
