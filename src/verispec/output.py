"""Turning committed tokens into text, deciding when a request is finished, and streaming deltas.

Owns: incremental detokenization (holding back incomplete UTF-8), EOS / stop-string /
max-token stops, and which part of the text may be shown while it could still become a stop
string. Tokens are appended one at a time in order, so a block of accepted tokens stops at
exactly the token where plain decoding would stop. Knows nothing about models or drafting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


REPLACEMENT_CHAR = "\ufffd"


def find_earliest_stop(text: str, stop: Sequence[str], search_from: int) -> int | None:
    """Index in ``text`` where the earliest stop string begins, searching from ``search_from``.

    Earliest in the text, not first in the list: with stops ``["b", "a"]`` in ``"xab"`` it is 1.
    Returns None when no stop string occurs.
    """
    found = [i for i in (text.find(s, search_from) for s in stop) if i >= 0]
    return min(found) if found else None


def stop_prefix_holdback(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

    That many trailing characters must not be streamed yet: the next token may complete a stop.
    """
    longest = 0
    for s in stop:
        for length in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:length]):
                longest = length
                break
    return longest


class OutputBuilder:
    """Accumulates the output of one request, token by token.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str``.
        eos_token_ids: tokens that end the output (not included in it) unless ``ignore_eos``.
        stop: stop strings; the text is cut before the earliest occurrence.
        max_tokens: the output has at most this many tokens.
    """

    def __init__(
        self,
        tokenizer: Detokenizer,
        *,
        eos_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        max_tokens: int,
        ignore_eos: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._eos = frozenset(() if ignore_eos else eos_token_ids)
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self._prefix_offset = 0
        self._read_offset = 0
        self._streamed = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> bool:
        """Add one token; returns True when the output is finished (further tokens are ignored)."""
        if self.finished:
            return True
        if token_id in self._eos:
            self.finish_reason = "stop"
            self._flush()
            return True
        self.token_ids.append(token_id)
        old_len = len(self.text)
        self.text += self._decode_step()
        if self._stop and len(self.text) > old_len:
            stop_at = find_earliest_stop(self.text, self._stop, max(0, old_len - self._max_stop_len + 1))
            if stop_at is not None:
                self.text = self.text[:stop_at]
                self.finish_reason = "stop"
                return True
        if len(self.token_ids) >= self.max_tokens:
            self.finish("length")
        return self.finished

    def finish(self, reason: str) -> None:
        """End the output for an outside reason (``length`` at the context limit, ``abort``)."""
        if not self.finished:
            self.finish_reason = reason
            self._flush()
            if self._stop:
                stop_at = find_earliest_stop(self.text, self._stop, 0)
                if stop_at is not None:
                    self.text, self.finish_reason = self.text[:stop_at], "stop"

    def take_delta(self) -> str:
        """Text that became final since the last call (all of the rest once finished)."""
        visible = len(self.text)
        if not self.finished:
            visible -= stop_prefix_holdback(self.text, self._stop)
        delta = self.text[self._streamed : visible] if visible > self._streamed else ""
        self._streamed = max(self._streamed, visible)
        return delta

    def _decode_step(self) -> str:
        # vLLM-style incremental detokenization: decode a short window that starts a few tokens
        # back so that merges and leading spaces come out as in a full decode; emit only text
        # that no longer ends in an incomplete UTF-8 sequence.
        ids = self.token_ids
        prefix_text = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        new_text = self._tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return new_text[len(prefix_text) :]
        return ""

    def _flush(self) -> None:
        if self._read_offset < len(self.token_ids):
            ids = self.token_ids
            prefix_text = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
            new_text = self._tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=True)
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(ids)
