"""Which tokens may come next in one request: ``min_tokens`` and structured outputs (grammars).

Owns: the :class:`StructuredOutput` a request asks for (a JSON schema, any JSON object, a regex
or a Lark grammar), compiling it with llguidance (a maintained Earley parser with a token-level
lexer: ``llguidance`` on PyPI, 3 MB, no other dependency; measured on the Qwen2.5 tokenizer at 64
us per mask, under 0.5 % of a target pass here), and the per-request :class:`TokenConstraints`:
the ``allowed`` masks of the rows a target pass scores, the longest valid prefix of a draft, and
the grammar state advanced by committed tokens.

Lossless by construction: row i of a verified chain gets the mask of the state after the output
and the first i draft tokens, the mask plain decoding's step at that point gets, so every
processed row (and with it the argmax, the sampling distribution and the log-probabilities) is
plain decoding's. Knows nothing about models, runners or text beyond the tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.algorithms.draft import DraftOutput
from verispec.errors import InvalidParameterError

STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "grammar")
# JSON as compact as json.dumps: ", " and ": ", no other whitespace (a sampled model otherwise
# pads with newlines until max_tokens, and the output never closes).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar an output must follow.

    Attributes:
        kind: ``"json_object"`` (any JSON object), ``"json_schema"`` (``definition``: the schema
            as JSON text), ``"regex"`` (``definition``: the pattern the whole output matches) or
            ``"grammar"`` (``definition``: a Lark grammar in llguidance's dialect, which also
            embeds JSON schemas as ``%json { ... }``).
        definition: see ``kind``; ignored for ``json_object``.
    Raises:
        InvalidParameterError: unknown kind, or a json_schema that is not a JSON object.
    """

    kind: str
    definition: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidParameterError(
                f"unknown structured output {self.kind!r}; choose one of {', '.join(STRUCTURED_KINDS)}"
            )
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.definition)
            except json.JSONDecodeError as exc:
                raise InvalidParameterError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidParameterError("the JSON schema must be a JSON object")
        elif self.kind != "json_object" and not self.definition:
            raise InvalidParameterError(f"a {self.kind} structured output needs its {self.kind} text")

    @classmethod
    def json_schema(cls, schema: dict) -> StructuredOutput:
        return cls("json_schema", json.dumps(schema))

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) for this output."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.definition, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.definition)
        return llguidance.LLMatcher.grammar_from_lark(self.definition)


class GrammarCompiler:
    """One tokenizer's llguidance view (built once: about 1 s for a 150k vocabulary) and the
    grammars compiled for it.

    Args:
        tokenizer: a Hugging Face fast tokenizer (the target's).
        vocab_size: the width of the target's logits rows (may exceed the tokenizer's length).
        stop_token_ids: the tokens that end an output; the grammar allows them once it accepts.
    Raises:
        InvalidParameterError: ``llguidance`` is not installed, or the tokenizer is not a fast one.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        try:
            import llguidance.hf
        except ImportError:  # pragma: no cover - a dependency of the package
            raise InvalidParameterError("structured outputs need llguidance: pip install llguidance") from None
        if not hasattr(tokenizer, "backend_tokenizer"):
            raise InvalidParameterError("structured outputs need a Hugging Face fast tokenizer (tokenizers)")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(self.stop_token_ids) or None
        )

    def matcher(self, output: StructuredOutput):
        """A fresh ``llguidance.LLMatcher`` at the start of ``output``'s grammar.

        Raises:
            InvalidParameterError: the schema, regex or grammar does not compile (its message).
        """
        import llguidance

        grammar = output.grammar()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise InvalidParameterError(f"the {output.kind} does not compile: {messages[0] if messages else 'invalid'}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(f"the {output.kind} does not compile: {matcher.get_error()}")
        return matcher


class TokenConstraints:
    """One request's token masks: stop tokens masked while the output is shorter than
    ``min_tokens``, and the grammar's allowed tokens (``matcher``: an ``llguidance.LLMatcher``).

    Args:
        vocab_size: width of the logits rows (masks are ``[rows, vocab_size]`` bool, True = allowed).
        stop_token_ids: the tokens ``min_tokens`` masks (none with ``ignore_eos``).
        min_tokens: output length below which the stop tokens are masked.
        matcher: the grammar state after the tokens committed so far, or None.
        end_token_ids: the model's end tokens (default: ``stop_token_ids``): an accepting grammar
            allows them, and they leave the grammar's state as it is (with ``ignore_eos`` the
            output goes on, and the grammar, complete, keeps allowing only them).

    A row the masks would leave empty (``min_tokens`` against a grammar that allows only the end,
    or a grammar that cannot go on) allows the end tokens: the output ends rather than sample
    from nothing, in plain decoding and in every verify row alike.
    """

    def __init__(
        self,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        min_tokens: int = 0,
        matcher=None,
        end_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = _ids(stop_token_ids, vocab_size)
        self.end_token_ids = self.stop_token_ids if end_token_ids is None else _ids(end_token_ids, vocab_size)
        self._stop_set = frozenset(self.stop_token_ids.tolist())
        self._end_set = frozenset(self.end_token_ids.tolist())
        self.min_tokens = min_tokens
        self.matcher = matcher

    @property
    def active(self) -> bool:
        return self.matcher is not None or self.min_tokens > 0

    def masks(self, num_output: int, appended_token_ids: Sequence[int] = ()) -> Tensor | None:
        """``[len(appended) + 1, vocab]`` bool: row i for the step after the output
        (``num_output`` tokens) and ``appended[:i]``; None when nothing is masked.

        Rows after a token the grammar refuses allow everything: that token is rejected for
        certain (its target probability is 0), so those rows are never used.
        """
        num_rows = len(appended_token_ids) + 1
        if not self.active or (self.matcher is None and num_output >= self.min_tokens):
            return None
        rows = torch.ones(num_rows, self.vocab_size, dtype=torch.bool)
        if self.matcher is not None:
            fed = 0
            for i in range(num_rows):
                rows[i] = self._grammar_mask()
                if i == num_rows - 1:
                    break
                ok, n = self._feed([appended_token_ids[i]])
                fed += n
                if not ok:
                    break
            self.matcher.rollback(fed)
        for i in range(num_rows):
            if num_output + i < self.min_tokens and self.stop_token_ids.numel():
                rows[i, self.stop_token_ids] = False
            self._never_empty(rows[i])
        return rows

    def path_masks(self, num_output: int, paths: Sequence[Sequence[int]]) -> Tensor | None:
        """``[len(paths), vocab]`` bool: row j for the step after the output and ``paths[j]``
        (a token tree's nodes along their own paths); None when nothing is masked."""
        if not self.active or (self.matcher is None and num_output >= self.min_tokens):
            return None
        rows = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        for j, path in enumerate(paths):
            if self.matcher is not None:
                ok, fed = self._feed(path)
                if ok:
                    rows[j] = self._grammar_mask()
                self.matcher.rollback(fed)
            if num_output + len(path) < self.min_tokens and self.stop_token_ids.numel():
                rows[j, self.stop_token_ids] = False
            self._never_empty(rows[j])
        return rows

    def valid_prefix_length(self, num_output: int, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the constraints allow after the output."""
        valid = len(token_ids)
        if self.matcher is not None:  # the masks' rule token by token (end tokens included), then undone
            fed = 0
            for i, token in enumerate(token_ids):
                ok, n = self._feed([token])
                fed += n
                if not ok:
                    valid = i
                    break
            self.matcher.rollback(fed)
        if self.min_tokens > num_output:
            for i, token in enumerate(token_ids[:valid]):
                if num_output + i < self.min_tokens and token in self._stop_set:
                    return i
        return valid

    def forced_tokens(self, limit: int) -> list[int]:
        """At most ``limit`` tokens the grammar forces after the committed output (llguidance's
        fast-forward tokens: the only bytes it allows next, in its canonical tokenization), [] without
        a grammar. Free drafts ("jump-forward decoding", SGLang, Zheng et al. 2024, §4): they are
        verified as any draft, so a model that tokenizes the same bytes otherwise only rejects them."""
        if self.matcher is None or limit <= 0 or self.matcher.is_stopped():
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()[:limit]]

    def commit(self, token_ids: Sequence[int]) -> None:
        """Advance the grammar by the tokens the output committed (end tokens leave it as it is)."""
        if self.matcher is None:
            return
        self._feed(token_ids)  # stops at a token the grammar refuses (never one the masks allowed)

    def _feed(self, token_ids: Sequence[int]) -> tuple[bool, int]:
        """Feed ``token_ids`` to the grammar until one is refused: ``(all taken, tokens fed)``
        (what :meth:`rollback` must undo). An end token is taken only where the grammar accepts,
        and feeds nothing."""
        fed = 0
        for token in token_ids:
            if token in self._end_set:
                if not (self.matcher.is_accepting() or self.matcher.is_stopped()):
                    return False, fed
                continue
            if self.matcher.try_consume_tokens([int(token)]) != 1:
                return False, fed
            fed += 1
        return True, fed

    def _never_empty(self, row: Tensor) -> None:
        if not bool(row.any()) and self.end_token_ids.numel():
            row[self.end_token_ids] = True

    def _grammar_mask(self) -> Tensor:
        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        mask = _unpack_bits(bits)[: self.vocab_size]
        if mask.numel() < self.vocab_size:
            mask = torch.nn.functional.pad(mask, (0, self.vocab_size - mask.numel()), value=False)
        if self.end_token_ids.numel():
            mask[self.end_token_ids] = self.matcher.is_accepting() or self.matcher.is_stopped()
        return mask


def _ids(token_ids: Sequence[int], vocab_size: int) -> Tensor:
    return torch.tensor(sorted({int(t) for t in token_ids if 0 <= t < vocab_size}), dtype=torch.long)


def cut_draft(constraints: TokenConstraints, num_output: int, draft: DraftOutput, greedy: bool) -> DraftOutput:
    """``draft`` cut before its first token the constraints refuse, where that is lossless; else
    ``draft`` itself.

    Lossless for greedy requests and for drafts without probabilities (one-hot): the refused
    token has target probability 0, so it would be rejected for certain, and the token the
    target then takes (argmax, or the residual of a one-hot draft: the target itself) is the one
    it takes after the cut. A sampled draft with probabilities is not cut: its residual
    ``max(0, p - q)`` differs from ``p``, so a cut would change the distribution; the draft
    model masks its own rows instead (:meth:`verispec.proposers.DraftRequest.allowed_after`).
    Trees are not cut (their nodes are masked along their paths).
    """
    if draft.tree is not None or not draft.draft_token_ids or (draft.draft_probs is not None and not greedy):
        return draft
    valid = constraints.valid_prefix_length(num_output, draft.draft_token_ids)
    if valid == len(draft.draft_token_ids):
        return draft
    probs = draft.draft_probs[:valid] if draft.draft_probs is not None else None
    return dataclasses.replace(draft, draft_token_ids=draft.draft_token_ids[:valid], draft_probs=probs)


_BIT = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)


def _unpack_bits(bits: Tensor) -> Tensor:
    """Little-endian bits of ``bits`` (``[n]`` uint8) -> ``[8 n]`` bool (bit b of byte i = token 8 i + b)."""
    return (bits[:, None] & _BIT[None, :]).ne(0).reshape(-1)
