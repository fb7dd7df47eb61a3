"""What can be known about a model pair before anything loads or downloads: that every named file is
whole and of the kind its name says, and that the draft's vocabulary is the target's (from the GGUF
headers, or from the registry for a built-in model not downloaded yet). Seconds, not the minutes a
load takes. Knows nothing about torch, runners or generation; the full check of a loaded pair
(tokenizer lengths, logits widths, EOS ids) stays in ``compat.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verispec.errors import IncompatibleDraftError, ModelIntegrityError
from verispec.models.compat import check_same_tokens
from verispec.models.gguf_file import GGUFHeader, read_gguf_header
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.models.store import ModelStore

TOKENS_KEY = "tokenizer.ggml.tokens"


@dataclass
class _Vocabulary:
    """What is known of one model's vocabulary without loading it (None: unknown)."""

    label: str
    size: int | None
    digest: str | None  # GGUFHeader.tokens_digest, or the registry's tokens_sha256
    path: Path | None = None  # a GGUF file whose token strings can be read on a mismatch
    header: GGUFHeader | None = None


def check_before_loading(target: str, draft: str | None = None, *, store: ModelStore | None = None) -> None:
    """Refuse a pair that cannot load, or cannot speculate together, before any model loads.

    Checks each reference names something (a built-in name, a ``.gguf`` file, a checkpoint folder,
    a hub id); reads each local GGUF file's header and tensor table (magic, version, a file as long
    as its tensors need) and each checkpoint's safetensors headers; then, where both vocabularies
    are known without loading, that the draft's token list is the target's, string for string (an
    equal size is not enough). Nothing is downloaded: a built-in model not in the cache is judged by
    the registry's record of its token list (its size and digest: the sizes are named, not a token).
    Takes milliseconds for built-in names and about 0.3 s per 150k-token GGUF header read.

    Raises:
        ModelNotFoundError: a reference that names nothing usable.
        ModelIntegrityError: a file that is not a valid GGUF or safetensors file, or is truncated.
        IncompatibleDraftError: the vocabularies differ (where both token lists are on disk, in
            one line naming the first id that differs and both its strings; else both sizes).
    """
    store = store or ModelStore()
    target_vocabulary = _vocabulary(target, store)
    if draft is None:
        return
    draft_vocabulary = _vocabulary(draft, store)
    _check_same_vocabulary(target_vocabulary, draft_vocabulary)


@dataclass(frozen=True)
class DefaultDraft:
    """The draft model a command takes when none is named, and why (one line for stderr; None where
    nothing needs saying: the built-in pair)."""

    draft: str | None
    reason: str | None


def default_draft(target: str, *, store: ModelStore | None = None) -> DefaultDraft:
    """The draft for ``target`` when the user names none: the built-in draft
    (``qwen2.5-coder-0.5b-instruct``) where the target is known, before loading, to have its token
    list (the registry's digest or the GGUF header's), else no draft model (``auto`` then drafts by
    lookup), with the reason. Reads at most the target's GGUF header; downloads nothing.

    Raises:
        ModelNotFoundError, ModelIntegrityError: ``target`` names nothing usable, or a broken file.
    """
    store = store or ModelStore()
    if target == DEFAULT_TARGET:
        return DefaultDraft(DEFAULT_DRAFT, None)
    builtin = store.registry.get(DEFAULT_DRAFT)
    if target == DEFAULT_DRAFT or builtin is None:
        return DefaultDraft(None, f"no draft model: {target} is the built-in draft itself (--draft MODEL to give one)")
    digest = _vocabulary(target, store).digest
    if digest is not None and digest == builtin.tokens_sha256:
        return DefaultDraft(DEFAULT_DRAFT, f"draft model: the built-in {DEFAULT_DRAFT}, which has {target}'s tokenizer")
    why = "is not known to have" if digest is None else "does not have"
    return DefaultDraft(
        None,
        f"no draft model: the built-in draft {DEFAULT_DRAFT} {why} {target}'s tokenizer, so auto drafts by lookup "
        "only (--draft MODEL with the target's tokenizer to draft with a model)",
    )


def _vocabulary(ref: str, store: ModelStore) -> _Vocabulary:
    if ref in store.registry:  # judged from the registry: no download, no hashing
        entry = store.registry[ref]
        path = store.model_path(ref)
        on_disk = path if store.cache_state(ref) == "cached" and path.is_file() else None
        return _Vocabulary(ref, entry.vocab_size, entry.tokens_sha256, on_disk)
    source = store.resolve(ref)  # not a built-in: nothing to fetch; raises ModelNotFoundError
    if source.kind == "gguf":
        header = read_gguf_header(source.path)
        count = header.metadata.get(TOKENS_KEY)
        return _Vocabulary(str(source.path), count, header.tokens_digest or None, source.path, header)
    if source.kind == "directory":
        from verispec.models.loading import check_safetensors_header

        for weights in sorted(source.path.glob("*.safetensors")):
            check_safetensors_header(weights)
    return _Vocabulary(source.name, None, None)


def _check_same_vocabulary(target: _Vocabulary, draft: _Vocabulary) -> None:
    if target.digest is None or draft.digest is None or target.digest == draft.digest:
        return
    target_tokens, draft_tokens = _tokens(target), _tokens(draft)
    if target_tokens is not None and draft_tokens is not None:
        check_same_tokens(target_tokens, draft_tokens)  # raises, naming the first id that differs and both strings
        return
    raise IncompatibleDraftError(
        f"draft vocabulary differs from the target's: the draft {draft.label} has {draft.size} tokens and the "
        f"target {target.label} {target.size}, with other token strings; the draft must use the target's "
        "tokenizer, or give --draft none for no draft model (known from the built-in models' table: nothing was "
        "downloaded or loaded)"
    )


def _tokens(vocabulary: _Vocabulary) -> list[str] | None:
    """The token strings of a GGUF file on disk, or None (not on disk, or unreadable)."""
    if vocabulary.path is None:
        return None
    try:
        header = vocabulary.header or read_gguf_header(vocabulary.path)
        return header.read_array(TOKENS_KEY)
    except (ModelIntegrityError, KeyError, OSError):
        return None
