"""The target's reading of the training data, kept on disk: one file per sequence, so a head's
``--resume``, a second head on the same data, or a reading cut short by Ctrl-C never pays the
target's passes twice (they are most of a CPU run: ~17 ms a token for the 1.5B default on two
Zen 3 cores). Knows nothing about the head or the loss.

A file holds one :class:`~verispec.training.teacher.Teacher` as safetensors (float32 features and
final hidden state, int64 token ids and argmax, ~24 KB a token for the 1.5B default with three
feature layers), named by the sha256 of who read it (:func:`reader_identity`), the feature layers
and the token ids; a file is written under a temporary name and renamed, so a killed run leaves
no half file. A file that does not load, or whose tokens or shapes do not match, is read again and
replaced (counted in :attr:`TeacherCache.damaged`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from verispec.errors import InvalidParameterError
from verispec.training.teacher import Teacher

FORMAT_VERSION = 1


def reader_identity(kind: str, target: str, path: Path | None = None) -> str:
    """Who reads the data, as a cache key part: the teacher ``kind`` (``gguf``, ``int8``,
    ``torch``), the target reference, and for a file its resolved path, size and modification
    time (a re-downloaded or re-quantized file reads afresh). The kernels' ISA path is not part
    of it: every path gives the same bits (:mod:`verispec.runners.kernels`)."""
    parts = [kind, target]
    if path is not None:
        stat = Path(path).stat()
        parts += [str(Path(path).resolve()), str(stat.st_size), str(stat.st_mtime_ns)]
    return "|".join(parts)


def teacher_key(reader: str, feature_layers: Sequence[int], token_ids: Sequence[int]) -> str:
    """sha256 (hex) of the format version, ``reader``, ``feature_layers`` and ``token_ids``."""
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, reader, [int(i) for i in feature_layers]]).encode())
    digest.update(torch.as_tensor([int(t) for t in token_ids], dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()


class TeacherCache:
    """Teachers of one reader in ``folder`` (created, parents included).

    Attributes:
        hits / misses / damaged: sequences served from a file / read by the target / whose file
            was unreadable or did not match (read again, replaced; also counted in ``misses``).
    Raises:
        InvalidParameterError: ``folder`` cannot be created or is not a folder.
    """

    def __init__(self, folder: Path, reader: str) -> None:
        self.folder, self.reader = Path(folder), reader
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidParameterError(f"teacher cache {self.folder}: {exc.strerror or exc}") from exc
        self.hits = self.misses = self.damaged = 0

    def path(self, feature_layers: Sequence[int], token_ids: Sequence[int]) -> Path:
        return self.folder / f"{teacher_key(self.reader, feature_layers, token_ids)}.safetensors"

    def load(self, feature_layers: Sequence[int], token_ids: Sequence[int]) -> Teacher | None:
        """The stored teacher of ``token_ids``, or None (absent, or damaged: counted)."""
        path = self.path(feature_layers, token_ids)
        if not path.is_file():
            return None
        try:
            tensors = load_file(path)
            found = Teacher(
                tensors["token_ids"], tensors["features"], tensors["final_hidden"], tensors["target_argmax"]
            )
        except (OSError, SafetensorError, KeyError, ValueError, RuntimeError):
            self.damaged += 1
            return None
        rows = len(token_ids)
        ids = torch.as_tensor([int(t) for t in token_ids], dtype=torch.int64)
        shapes_ok = (
            found.features.dim() == 2
            and found.final_hidden.dim() == 2
            and found.features.shape[0] == rows
            and found.final_hidden.shape[0] == rows
            and found.target_argmax.shape == (rows,)
        )
        if found.token_ids.shape != ids.shape or not torch.equal(found.token_ids, ids) or not shapes_ok:
            self.damaged += 1
            return None
        return found

    def store(self, feature_layers: Sequence[int], teacher: Teacher) -> None:
        """Write ``teacher`` atomically (temporary file, then rename)."""
        path = self.path(feature_layers, teacher.token_ids.tolist())
        partial = path.with_name(path.name + ".partial")
        tensors = {
            "token_ids": teacher.token_ids,
            "features": teacher.features,
            "final_hidden": teacher.final_hidden,
            "target_argmax": teacher.target_argmax,
        }
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            partial,
            metadata={"reader": self.reader, "feature_layers": json.dumps([int(i) for i in feature_layers])},
        )
        os.replace(partial, path)

    def reading(
        self, read: Callable[[Sequence[int]], Teacher], feature_layers: Sequence[int]
    ) -> Callable[[Sequence[int]], Teacher]:
        """``read`` (one sequence -> its teacher, the target's pass) behind this cache. Stored
        as read (float32, int64), so a first run and a later one train on the same bits. A
        teacher shorter than its sequence (cut at the runner's context) is not stored."""

        def cached(token_ids: Sequence[int]) -> Teacher:
            ids = [int(t) for t in token_ids]
            found = self.load(feature_layers, ids)
            if found is not None:
                self.hits += 1
                return found
            self.misses += 1
            teacher = read(ids)
            if teacher.token_ids.numel() != len(ids):  # cut at the runner's context: keyed by what it read
                return teacher
            self.store(feature_layers, teacher)
            return teacher

        return cached

    def size_bytes(self) -> int:
        """Bytes of the stored files."""
        return sum(p.stat().st_size for p in self.folder.glob("*.safetensors"))

    def summary(self) -> str:
        """One line: what came from the files, what was read, the folder's size."""
        damaged = f" ({self.damaged} damaged files read again)" if self.damaged else ""
        return (
            f"teacher cache {self.folder}: {self.hits} sequences from the cache, "
            f"{self.misses} read by the target{damaged}; {self.size_bytes() / 2**30:.2f} GiB"
        )
