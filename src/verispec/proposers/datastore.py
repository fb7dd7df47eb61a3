"""A static datastore for suffix drafting (REST, He et al. 2024): a corpus's tokens and their
suffix array, memory-mapped, queried for what followed the context's tail.

Owns the file format (a directory: ``tokens.npy`` int32, documents separated by -1;
``suffixes.npy`` int64, the positions sorted by the ``depth`` tokens that start there; and
``datastore.json``), building it from token sequences (:func:`build_datastore`, numpy
``lexsort``), and lookups (:meth:`Datastore.continuations`: binary search for the longest
matching tail, continuations read from the matches). Knows nothing about models or text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from verispec.errors import InvalidParameterError

FORMAT = 1
SEPARATOR = -1  # between documents: never matches a token


def build_datastore(documents: Iterable[Sequence[int]], out: str | Path, depth: int = 8) -> dict:
    """Write the datastore of ``documents`` (token id sequences) to directory ``out``.

    Suffixes are sorted by their first ``depth`` tokens (``lexsort``, the separator -1 sorting
    first), so every n-gram with n <= ``depth`` occupies one contiguous range of the array.
    Returns the summary written to ``datastore.json`` (``num_tokens``, ``num_documents``, ``depth``).

    Raises:
        InvalidParameterError: no tokens, or a depth below 1.
    """
    if depth < 1:
        raise InvalidParameterError(f"depth must be >= 1, got {depth}")
    parts, num_documents = [], 0
    for doc in documents:
        if len(doc):
            parts.append(np.asarray(doc, dtype=np.int32))
            parts.append(np.array([SEPARATOR], dtype=np.int32))
            num_documents += 1
    if not parts:
        raise InvalidParameterError("the corpus has no tokens")
    tokens = np.concatenate(parts)
    n = len(tokens)
    padded = np.concatenate([tokens, np.full(depth, SEPARATOR, dtype=np.int32)])
    keys = [padded[i : i + n] for i in range(depth - 1, -1, -1)]  # lexsort: last key is the primary
    suffixes = np.lexsort(keys).astype(np.int64)
    suffixes = suffixes[tokens[suffixes] != SEPARATOR]  # a suffix starting at a separator matches nothing
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tokens.npy", tokens)
    np.save(out / "suffixes.npy", suffixes)
    summary = {"format": FORMAT, "num_tokens": int(n - num_documents), "num_documents": num_documents, "depth": depth}
    (out / "datastore.json").write_text(json.dumps(summary))
    return summary


class Datastore:
    """A built datastore, memory-mapped (pages load as lookups touch them).

    Raises:
        InvalidParameterError: ``path`` is not a datastore directory, or its files disagree.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            self.summary = json.loads((path / "datastore.json").read_text())
            self.tokens = np.load(path / "tokens.npy", mmap_mode="r")
            self.suffixes = np.load(path / "suffixes.npy", mmap_mode="r")
        except FileNotFoundError:
            raise InvalidParameterError(
                f"{path} is not a verispec datastore (build one: verispec datastore build)"
            ) from None
        except (OSError, ValueError, EOFError, TypeError) as exc:
            raise InvalidParameterError(f"{path} is not a readable verispec datastore ({exc})") from None
        summary = self.summary
        if (
            not isinstance(summary, dict)
            or summary.get("format") != FORMAT
            or not isinstance(summary.get("depth"), int)
            or summary["depth"] < 1
            or self.tokens.dtype != np.int32
            or self.suffixes.dtype != np.int64
            or self.tokens.ndim != 1
            or self.suffixes.ndim != 1
        ):
            raise InvalidParameterError(f"{path} is a damaged datastore or one of another format: rebuild it")
        if len(self.suffixes) and (int(self.suffixes.max()) >= len(self.tokens) or int(self.suffixes.min()) < 0):
            raise InvalidParameterError(f"{path} is corrupt: its suffix array points outside its tokens")
        self.depth = int(self.summary["depth"])
        self.path = path

    def continuations(
        self, context: Sequence[int], length: int, min_ngram: int = 2, max_ngram: int = 8, max_matches: int = 32
    ) -> tuple[int, list[list[int]]]:
        """``(n, continuations)``: the longest n-gram (``min_ngram <= n <= min(max_ngram, depth)``)
        of ``context``'s tail in the corpus, and what followed up to ``max_matches`` of its
        occurrences (spread evenly over all of them, so their shares are the corpus's
        frequencies), ``length`` tokens each, stopping at a document's end; ``(0, [])`` if none."""
        top = min(max_ngram, self.depth, len(context))
        for n in range(top, min_ngram - 1, -1):
            pattern = [int(t) for t in context[len(context) - n :]]
            lo, hi = self._range(pattern)
            if hi <= lo:
                continue
            picks = np.linspace(lo, hi - 1, num=min(max_matches, hi - lo)).astype(np.int64)
            found = []
            for start in self.suffixes[picks].tolist():
                following = self.tokens[start + n : start + n + length].tolist()
                if SEPARATOR in following:
                    following = following[: following.index(SEPARATOR)]
                if following:
                    found.append(following)
            if found:
                return n, found
        return 0, []

    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """``[lo, hi)`` of the suffixes that start with ``pattern`` (binary search, lexicographic)."""
        n = len(pattern)

        def prefix(i: int) -> list[int]:
            start = int(self.suffixes[i])
            return self.tokens[start : start + n].tolist()

        lo, hi = 0, len(self.suffixes)
        while lo < hi:  # first suffix >= pattern
            mid = (lo + hi) // 2
            if prefix(mid) < pattern:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, len(self.suffixes)
        while lo < hi:  # first suffix whose n-prefix > pattern
            mid = (lo + hi) // 2
            if prefix(mid) <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return first, lo
