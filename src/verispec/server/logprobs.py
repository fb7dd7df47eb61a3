"""Log-probabilities on the wire: the completions shape (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) and the chat shape (``content``: token, logprob, bytes,
top_logprobs), from the engine's :class:`~verispec.algorithms.sampling.TokenLogprob` lists.

Token strings are the token's own text (``decode([id])``); ``bytes`` are its UTF-8 bytes, exact
for byte-level BPE tokens that hold part of a character. Knows nothing about decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from verispec.algorithms.sampling import TokenLogprob


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte table (byte-level BPE vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_DECODER = _byte_decoder()


class TokenText:
    """Text and bytes of single tokens of one tokenizer (cached)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        """The token's text; part of a character is ``bytes:\\xNN...`` (OpenAI's convention)."""
        raw = self._bytes(token_id)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _decoded(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> tuple[int, ...]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in BYTE_DECODER for c in piece):
            return tuple(BYTE_DECODER[c] for c in piece)
        return tuple(self._decoded(token_id).encode("utf-8"))


def completion_logprobs(
    texts: TokenText, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], prefix: bytes = b""
) -> dict[str, Any]:
    """The completions ``logprobs`` object; an entry None (the prompt's first token) is null.

    ``text_offset[i]``: characters of the text before token i (``prefix``: the bytes of the text
    before ``token_ids``); a character split across tokens counts at the token completing it.
    """
    tokens, token_logprobs, top, offsets = [], [], [], []
    data = bytearray(prefix)
    for token_id, entry in zip(token_ids, entries):
        tokens.append(texts.text(token_id))
        offsets.append(len(bytes(data).decode("utf-8", errors="ignore")))
        data += bytes(texts.bytes(token_id))
        token_logprobs.append(None if entry is None else entry.logprob)
        top.append(None if entry is None else {texts.text(t): lp for t, lp in entry.top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def token_bytes(texts: TokenText, token_ids: Sequence[int]) -> bytes:
    """The bytes of ``token_ids``' text, end to end."""
    return b"".join(bytes(texts.bytes(t)) for t in token_ids)


def chat_logprobs(texts: TokenText, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``)."""
    content = []
    for entry in entries:
        content.append(
            {
                "token": texts.text(entry.token_id),
                "logprob": entry.logprob,
                "bytes": list(texts.bytes(entry.token_id)),
                "top_logprobs": [
                    {"token": texts.text(t), "logprob": lp, "bytes": list(texts.bytes(t))} for t, lp in entry.top
                ],
            }
        )
    return {"content": content}
