"""Matrices derived from a GGUF file (re-quantized weights), kept on disk so a later load reads
them instead of computing them again.

Owns the cache files' layout, keys, checks and atomic publication. Knows nothing about what
the matrices mean: callers name each one and say how to compute it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from verispec.errors import CacheFileError
from verispec.models.cache_files import read_checked, report_damaged, write_checked


def default_cache_dir() -> Path:
    """Where the runners keep derived weights: ``$VERISPEC_HOME/weights``."""
    from verispec.models.store import verispec_home

    return verispec_home() / "weights"


CHECK_CHUNK_BYTES = 16 * 2**20  # read this much at a time when checking crc32s
DTYPES = {"int8": (torch.int8, np.int8), "uint8": (torch.uint8, np.uint8), "float32": (torch.float32, np.float32)}


class WeightCache:
    """The matrices of one ``kind`` (``"int8"``, ``"iq4_nl"``, ...) computed from one GGUF file.

    ``<directory>/<file stem>-<kind>-<key>.bin`` holds the arrays one after another, the ``.json``
    beside it (a checked file: header with size and sha256, :mod:`verispec.models.cache_files`)
    their offsets, dtypes, shapes and crc32s, and the ``.bin``'s size and modification time when
    it was published. The key hashes ``version``, ``kind`` and the GGUF file's path, size and
    modification time, so a changed file (or a changed computation: bump ``version``) is computed
    again. A hit maps each array only while the caller uses it. A miss computes each matrix and
    appends it as it goes; :meth:`finish` publishes the pair by fsync and renames once complete,
    so a crash or a full disk leaves no half cache (the load goes on uncached), and removes the
    caches of earlier versions of the same file.

    Checks before a hit: the index must pass its sha256 and the ``.bin`` must have the size the
    index says; when the ``.bin``'s modification time is not the recorded one, every array's
    crc32 is checked too (as the model store re-hashes a touched file). A cache that fails is said
    once on stderr (the file and what was wrong) and computed again and rewritten in this load;
    it is never read as data and never raises. Arrays are stored as computed, bit for bit, so the
    cache never changes results.
    """

    KIND = "verispec-weights/1"

    def __init__(self, gguf_path: Path, directory: Path, kind: str, version: int) -> None:
        stat = gguf_path.stat()
        digest = hashlib.sha256(
            f"{version}:{kind}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
        ).hexdigest()[:16]
        self.prefix = f"{gguf_path.stem}-{kind}-"
        self.data_path = Path(directory) / f"{self.prefix}{digest}.bin"
        self.index_path = self.data_path.with_suffix(".json")
        self.entries: dict | None = self._read_index()
        self._writer = None
        self._written: dict = {}
        self._offset = 0

    @property
    def hit(self) -> bool:
        """Whether the arrays were found (read, not computed)."""
        return bool(self.entries)

    def _read_index(self) -> dict | None:
        """The checked index of a cache that passes every check, else None (said once if damaged)."""
        try:
            index = json.loads(read_checked(self.index_path, self.KIND))
            entries = index["matrices"]
            end = max((a["offset"] + a["nbytes"] for arrays in entries.values() for a in arrays), default=0)
            if not entries or end != index["data_size"]:
                raise CacheFileError("lists no matrices, or not the bytes it records")
        except FileNotFoundError:
            return None
        except CacheFileError as exc:
            report_damaged(self.index_path, str(exc), "the derived weights are computed again")
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problem = f"is not a weight index ({type(exc).__name__}: {exc})"
            report_damaged(self.index_path, problem, "the derived weights are computed again")
            return None
        try:
            stat = self.data_path.stat()
        except OSError as exc:
            report_damaged(self.data_path, f"cannot be read ({exc.strerror})", "the derived weights are computed again")
            return None
        problem = None
        if stat.st_size != index["data_size"]:
            problem = f"has {stat.st_size} bytes, its index records {index['data_size']} (truncated)"
        elif stat.st_mtime_ns != index["data_mtime_ns"] and (bad := self._first_bad_array(entries)) is not None:
            problem = f"fails the crc32 check of matrix {bad} (corrupt)"
        if problem is not None:
            report_damaged(self.data_path, problem, "the derived weights are computed again")
            return None
        return entries

    def _first_bad_array(self, entries: dict) -> str | None:
        """The first matrix whose bytes do not match their recorded crc32 (None: all match)."""
        with open(self.data_path, "rb") as data:
            for key, arrays in entries.items():
                for a in arrays:
                    data.seek(a["offset"])
                    crc, left = 0, a["nbytes"]
                    while left > 0:
                        chunk = data.read(min(left, CHECK_CHUNK_BYTES))
                        if not chunk:
                            break
                        crc, left = zlib.crc32(chunk, crc), left - len(chunk)
                    if left or crc != a["crc32"]:
                        return key
        return None

    def get(self, key: str, compute: Callable[[], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        """The arrays of matrix ``key``: read (mapped copy-on-write), or computed and stored."""
        if self.entries is not None and key in self.entries:
            arrays = []
            for a in self.entries[key]:
                dtype = DTYPES[a["dtype"]][1]
                mapped = np.memmap(self.data_path, dtype=dtype, mode="c", offset=a["offset"], shape=tuple(a["shape"]))
                arrays.append(torch.from_numpy(mapped))
            return tuple(arrays)
        arrays = tuple(compute())
        if self.entries is None:
            self._append(key, arrays)
        return arrays

    def _append(self, key: str, arrays: tuple[Tensor, ...]) -> None:
        try:
            if self._writer is None:
                self.data_path.parent.mkdir(parents=True, exist_ok=True)
                # SIM115: the writer stays open across _append calls; finish() or _abandon() closes it
                self._writer = open(self.data_path.with_suffix(f".bin.tmp{os.getpid()}"), "wb")  # noqa: SIM115
            records = []
            for array in arrays:
                name = next(n for n, (t, _) in DTYPES.items() if t == array.dtype)
                data = memoryview(array.contiguous().numpy()).cast("B")
                self._writer.write(data)
                records.append(
                    {
                        "offset": self._offset,
                        "nbytes": data.nbytes,
                        "dtype": name,
                        "shape": list(array.shape),
                        "crc32": zlib.crc32(data),
                    }
                )
                self._offset += data.nbytes
            self._written[key] = records
        except OSError as exc:
            self._abandon(exc)

    def _abandon(self, exc: OSError) -> None:
        print(
            f"verispec: not caching derived weights in {self.data_path.parent} ({exc}); "
            "the next load computes them again",
            file=sys.stderr,
        )
        if self._writer is not None:
            self._writer.close()
            Path(self._writer.name).unlink(missing_ok=True)
        self._writer = None
        self.entries = {}  # stop writing; nothing is read from an empty index

    def finish(self) -> None:
        """Publish what this load wrote (no-op after a hit or a failure)."""
        if self._writer is None:
            return
        try:
            self._writer.flush()
            os.fsync(self._writer.fileno())
            self._writer.close()
            os.replace(self._writer.name, self.data_path)
            stat = self.data_path.stat()
            index = {"matrices": self._written, "data_size": stat.st_size, "data_mtime_ns": stat.st_mtime_ns}
            write_checked(self.index_path, self.KIND, json.dumps(index).encode())
            for stale in self.data_path.parent.glob(f"{self.prefix}*.bin"):
                if stale != self.data_path:  # an earlier version of the file: never read again
                    stale.unlink(missing_ok=True)
                    stale.with_suffix(".json").unlink(missing_ok=True)
        except OSError as exc:
            self._abandon(exc)
        self._writer = None
