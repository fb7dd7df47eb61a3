"""The suffix cache's file: the kept token sequences on disk, checked before they are read, and
kept recent by a background snapshot.

Owns the file format of :meth:`verispec.proposers.suffix.SuffixCache.save` and ``load``: a
checked file (:mod:`verispec.models.cache_files`: a header line with the payload's size and
sha256, written to a temporary file, fsynced and renamed over the old one) whose payload is
little-endian int64 ``[number of sequences, their lengths..., their tokens end to end...]``;
files of the first format (``.npz``: ``tokens``, ``lengths``, ``format``) are still read. Owns
:class:`SuffixSnapshots`, the thread that writes the file at most a given interval after the
cache changed, so a crash or ``kill -9`` loses at most that interval of learning. Knows nothing
about the index built from the sequences.
"""

from __future__ import annotations

import logging
import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from verispec.errors import CacheFileError, InvalidParameterError
from verispec.models.cache_files import ForeignFileError, read_checked, write_checked

KIND = "verispec-suffix-cache/2"
MAX_TOKEN_ID = 2**31
SNAPSHOT_INTERVAL_S = 60.0  # the longest a change waits before it is on disk
log = logging.getLogger("verispec.suffix")


class SuffixSnapshots:
    """Keeps ``path`` a recent snapshot of ``cache`` (a :class:`~verispec.proposers.suffix.SuffixCache`).

    A daemon thread wakes every ``interval_s`` seconds and, when the cache changed since the last
    snapshot (its ``num_changes`` moved), copies the sequences (under the cache's lock, briefly)
    and writes them with :func:`write_sequences` (atomic: the previous snapshot stays whole until
    the new one is renamed over it), so a change is on disk at most ``interval_s`` after it
    happened; nothing waits for the write. :meth:`stop` ends the thread and writes a last
    snapshot. ``written``: the ``num_changes`` the file already holds (None: write at the first
    wake-up, e.g. after a damaged file was ignored). A failed write is logged once (an error on
    ``verispec.suffix``) until one succeeds again; it never raises into the server.
    """

    def __init__(
        self, cache, path: Path | str, interval_s: float = SNAPSHOT_INTERVAL_S, written: int | None = None
    ) -> None:
        if interval_s <= 0:
            raise InvalidParameterError(f"the snapshot interval must be > 0 seconds, got {interval_s}")
        self.cache, self.path, self.interval_s = cache, Path(path), interval_s
        self._written = written
        self._failing = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verispec-suffix-snapshots", daemon=True)

    def start(self) -> SuffixSnapshots:
        self._thread.start()
        return self

    def write_now(self) -> bool:
        """Write a snapshot if the cache changed since the last one; whether one was written."""
        with self._lock:
            changes, sequences = self.cache.snapshot()
            if changes == self._written:
                return False
            try:
                write_sequences(self.path, sequences)
            except OSError as exc:
                if not self._failing:
                    log.error(
                        "suffix cache: could not write a snapshot to %s (%s); the previous one is kept", self.path, exc
                    )
                self._failing = True
                return False
            self._written, self._failing = changes, False
            return True

    def stop(self) -> None:
        """End the thread and write the last snapshot (when anything changed)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.write_now():
            log.info("suffix cache: %d past requests written to %s", self.cache.num_sequences, self.path)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.write_now()


def write_sequences(path: Path | str, sequences: Sequence[Sequence[int]]) -> None:
    """Write ``sequences`` (token ids, oldest first) to ``path`` atomically. Raises OSError (and
    then ``path`` is as it was)."""
    lengths = [len(tokens) for tokens in sequences]
    values = np.array([len(lengths), *lengths, *(t for tokens in sequences for t in tokens)], dtype="<i8")
    write_checked(path, KIND, values.tobytes())


def read_sequences(path: Path | str) -> list[list[int]]:
    """The sequences saved in ``path`` by :func:`write_sequences` (or the first ``.npz`` format).

    Raises:
        InvalidParameterError: no file, or one that is not a suffix cache (no header of ours and
            not the first format): it may be someone's data, so it is refused, not overwritten.
        CacheFileError: a suffix cache of ours that is truncated or corrupt (failed its size or
            sha256 check, or its lengths do not add up): its sequences are not read.
    """
    try:
        with open(path, "rb") as source:
            legacy = source.read(4) == b"PK\x03\x04"
        if legacy:
            return _read_npz(path)
        payload = read_checked(path, KIND)
    except FileNotFoundError:
        raise InvalidParameterError(f"no suffix cache at {path}") from None
    except ForeignFileError as exc:
        raise InvalidParameterError(f"{path} is not a verispec suffix cache (it {exc})") from None
    except IsADirectoryError:
        raise InvalidParameterError(f"{path} is not a verispec suffix cache (a directory)") from None
    if len(payload) % 8:
        raise CacheFileError(f"holds {len(payload)} bytes, not whole int64 values")
    values = np.frombuffer(payload, dtype="<i8")
    count = int(values[0]) if len(values) else -1
    lengths = values[1 : 1 + count] if 0 <= count < len(values) else np.array([-1])
    tokens = values[1 + count :]
    if (lengths < 0).any() or sum(lengths.tolist()) != len(tokens) or ((tokens < 0) | (tokens >= MAX_TOKEN_ID)).any():
        raise CacheFileError("holds lengths that do not match its tokens, or token ids outside [0, 2**31)")
    ends = np.cumsum(lengths).tolist()
    return [tokens[end - n : end].tolist() for n, end in zip(lengths.tolist(), ends)]


def _read_npz(path: Path | str) -> list[list[int]]:
    """The first format (``np.savez``: ``tokens``, ``lengths``); InvalidParameterError when it is not one."""
    try:
        with np.load(path, allow_pickle=False) as data:
            tokens, lengths = data["tokens"], data["lengths"]
    except (OSError, ValueError, KeyError, EOFError, TypeError, AttributeError, zipfile.BadZipFile) as exc:
        raise InvalidParameterError(f"{path} is not a verispec suffix cache ({exc})") from None
    integral = all(np.issubdtype(a.dtype, np.integer) and a.ndim == 1 for a in (tokens, lengths))
    if not integral or (lengths < 0).any() or sum(lengths.tolist()) != len(tokens):  # Python ints: no wrap-around
        raise InvalidParameterError(f"{path} is corrupt: its lengths do not match its tokens")
    if ((tokens < 0) | (tokens >= MAX_TOKEN_ID)).any():
        raise InvalidParameterError(f"{path} is corrupt: token ids outside [0, 2**31)")
    ends = np.cumsum(lengths).tolist()
    return [tokens[end - n : end].tolist() for n, end in zip(lengths.tolist(), ends)]
