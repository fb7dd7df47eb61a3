"""The suffix cache's file: the kept token sequences on disk, checked before they are read.

Owns the file format of :meth:`verispec.proposers.suffix.SuffixCache.save` and ``load``: a
checked file (:mod:`verispec.models.cache_files`: a header line with the payload's size and
sha256, written to a temporary file, fsynced and renamed over the old one) whose payload is
little-endian int64 ``[number of sequences, their lengths..., their tokens end to end...]``;
files of the first format (``.npz``: ``tokens``, ``lengths``, ``format``) are still read. Knows
nothing about the index built from the sequences.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np

from verispec.errors import CacheFileError, InvalidParameterError
from verispec.models.cache_files import ForeignFileError, read_checked, write_checked

KIND = "verispec-suffix-cache/2"
MAX_TOKEN_ID = 2**31


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
