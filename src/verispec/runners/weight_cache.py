"""Matrices derived from a GGUF file (re-quantized weights), kept on disk so a later load reads
them instead of computing them again.

Owns the cache files' layout, keys, validation and atomic publication. Knows nothing about what
the matrices mean: callers name each one and say how to compute it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

def default_cache_dir() -> Path:
    """Where the runners keep derived weights: ``$VERISPEC_HOME/weights``."""
    from verispec.models.store import verispec_home

    return verispec_home() / "weights"


DTYPES = {"int8": (torch.int8, np.int8), "uint8": (torch.uint8, np.uint8), "float32": (torch.float32, np.float32)}


class WeightCache:
    """The matrices of one ``kind`` (``"int8"``, ``"iq4_nl"``, ...) computed from one GGUF file.

    ``<directory>/<file stem>-<kind>-<key>.bin`` holds the arrays one after another, the ``.json``
    beside it their offsets, dtypes and shapes; the key hashes ``version``, ``kind`` and the GGUF
    file's path, size and modification time, so a changed file (or a changed computation: bump
    ``version``) is computed again. A hit maps each array only while the caller uses it. A miss
    computes each matrix and appends it as it goes; :meth:`finish` publishes the pair by renames
    once complete, so a crash or a full disk leaves no half cache (the load goes on uncached),
    and removes the caches of earlier versions of the same file. A cache whose index does not
    match its size is ignored and rewritten. Arrays are stored as computed, bit for bit, so the
    cache never changes results.
    """

    def __init__(self, gguf_path: Path, directory: Path, kind: str, version: int) -> None:
        stat = gguf_path.stat()
        digest = hashlib.sha256(f"{version}:{kind}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
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
        try:
            entries = json.loads(self.index_path.read_text())["matrices"]
            end = max((a["offset"] + a["nbytes"] for arrays in entries.values() for a in arrays), default=0)
            if not entries or self.data_path.stat().st_size != end:
                return None
            return entries
        except (OSError, ValueError, KeyError, TypeError):
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
                self._writer = open(self.data_path.with_suffix(f".bin.tmp{os.getpid()}"), "wb")
            records = []
            for array in arrays:
                name = next(n for n, (t, _) in DTYPES.items() if t == array.dtype)
                data = array.contiguous().numpy()
                self._writer.write(memoryview(data).cast("B"))
                records.append({"offset": self._offset, "nbytes": data.nbytes, "dtype": name, "shape": list(data.shape)})
                self._offset += data.nbytes
            self._written[key] = records
        except OSError as exc:
            self._abandon(exc)

    def _abandon(self, exc: OSError) -> None:
        print(f"verispec: not caching derived weights in {self.data_path.parent} ({exc}); the next load computes them again",
              file=sys.stderr)
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
            self._writer.close()
            index_tmp = self.index_path.with_suffix(f".json.tmp{os.getpid()}")
            index_tmp.write_text(json.dumps({"matrices": self._written}))
            os.replace(self._writer.name, self.data_path)
            os.replace(index_tmp, self.index_path)
            for stale in self.data_path.parent.glob(f"{self.prefix}*.bin"):
                if stale != self.data_path:  # an earlier version of the file: never read again
                    stale.unlink(missing_ok=True)
                    stale.with_suffix(".json").unlink(missing_ok=True)
        except OSError as exc:
            self._abandon(exc)
        self._writer = None
