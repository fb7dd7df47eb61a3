"""The tokenizer of a GGUF file, built from its metadata so that it tokenizes as llama.cpp does, and cached.

transformers converts the vocabulary (``transformers/integrations/gguf``: BPE ``gpt2`` with the
split of ``tokenizer.ggml.pre``, SentencePiece ``llama``, Gemma's and Phi-3's variants). This module
picks the tokenizer class from the header we already read (transformers' own path re-reads every
array of the file first: ~45 of the ~55 s a 262k-token Gemma vocabulary took here), then sets what
llama.cpp (``src/llama-vocab.cpp``, the reference our prompts must equal) reads differently:

- BOS: ``tokenizer.ggml.add_bos_token`` when the file says, else llama.cpp's default for the
  vocabulary: SentencePiece yes; BPE only for the Llama 3 pre-tokenizers (``llama-bpe``...) and a few.
- BPE words found whole in the vocabulary are one token, merges unused, for the pre-tokenizers
  where llama.cpp does so (``ignore_merges``: the Llama 3 family and a few).
- SentencePiece space prefix (``tokenizer.ggml.add_space_prefix``, default yes): a ``▁`` before the
  text and after each special token, every space a ``▁``; no pre-tokenizer.
- Phi-3 (``general.name`` has "phi-3" or "phi3"): special tokens swallow the whitespace after
  them, except ``<unk>``, ``<s>`` and ``<|endoftext|>``.

The result is kept in ``$VERISPEC_HOME/tokenizers/<key>`` (key: tokenizer digest, architecture and
the rules above), so files sharing one tokenizer build it once. Knows nothing about models or generation.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from verispec.errors import ModelIntegrityError
from verispec.models.gguf_file import GGUFHeader

RULES_VERSION = 1  # bump when a rule below changes: cached tokenizers built under older rules are not reused
SPACE = "\u2581"  # SentencePiece's visible space
# BPE pre-tokenizers for which llama.cpp adds BOS when the file does not say (llama-vocab.cpp)
BPE_PRE_WITH_BOS = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"}
    | {"tekken", "chameleon"}
)
# BPE pre-tokenizers for which llama.cpp takes a word found whole in the vocabulary as one token,
# before trying merges (its ignore_merges; Llama 3's tokenizer.json says the same)
BPE_PRE_IGNORING_MERGES = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"}
    | {"minicpm5", "youtu", "glm4", "glm5", "tekken", "granite-embed-multi-97m"}
)
NOT_STRIPPED_PHI3 = frozenset({"<unk>", "<s>", "<|endoftext|>"})
# general.architecture -> transformers model type, where they differ (transformers' load_gguf_checkpoint)
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def llama_cpp_adds_bos(metadata: dict[str, Any]) -> bool:
    """Whether llama.cpp puts BOS before a prompt of this file (``add_special``), per llama-vocab.cpp."""
    if metadata.get("tokenizer.ggml.bos_token_id") is None:
        return False
    flag = metadata.get("tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        return metadata.get("tokenizer.ggml.pre") in BPE_PRE_WITH_BOS
    return model in ("llama", "bert", "gemma4")


def is_phi3_name(metadata: dict[str, Any]) -> bool:
    """llama.cpp's test for Phi-3's whitespace-swallowing special tokens: the model's name."""
    name = str(metadata.get("general.name", "")).lower()
    return "phi-3" in name or "phi3" in name


def cache_key(header: GGUFHeader) -> str:
    """24 hex digits naming the built tokenizer: the same for files whose tokenizers tokenize alike."""
    facts = [RULES_VERSION, header.architecture, is_phi3_name(header.metadata), header.tokenizer_digest]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:24]


def cached_tokenizer(header: GGUFHeader, directory: Path | None = None):
    """The transformers tokenizer of a GGUF file, tokenizing as llama.cpp does, built once and kept.

    The first call builds it from the file (seconds; a line on stderr says so after 2 s); later
    calls, for this file or any with the same :func:`cache_key`, load the saved fast tokenizer.
    Within one process, files with one key share one tokenizer object (~100 MiB for a 152k-token
    vocabulary); nothing in verispec mutates it. ``encode(text)`` (``add_special_tokens=True``)
    gives llama.cpp's ``tokenize(text, add_special=True, parse_special=True)``. Raises
    ModelIntegrityError when transformers cannot build it.
    """
    if directory is None:
        from verispec.models.store import verispec_home

        directory = verispec_home() / "tokenizers"
    target = Path(directory) / cache_key(header)
    key = str(target.resolve())
    if key not in _IN_PROCESS:
        _IN_PROCESS[key] = _load_or_build(header, target)
    return _IN_PROCESS[key]


_IN_PROCESS: dict = {}  # resolved cache folder -> tokenizer object, for this process


def _load_or_build(header: GGUFHeader, target: Path):
    """The saved tokenizer in ``target``, or one built from the GGUF file, saved there and loaded
    back, so the first start tokenizes exactly as every later one (a read-only cache: built in a
    temporary folder, loaded, deleted)."""
    if (target / "tokenizer_config.json").exists():
        try:
            return _load_saved(target)
        except Exception:  # a damaged cache entry: rebuild it below
            pass
    from verispec.progress import announce_slow

    with announce_slow(f"building the tokenizer of {header.path.name}", f"once; kept in {target.parent}"):
        tokenizer = build_tokenizer(header)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        except OSError:
            scratch = Path(tempfile.mkdtemp(prefix="verispec-tokenizer-"))
        try:
            save_tokenizer(tokenizer, header, scratch)
            tokenizer = _load_saved(scratch)
            if scratch.parent == target.parent:
                shutil.rmtree(target, ignore_errors=True)
                scratch.replace(target)
        except OSError:
            pass  # a read-only cache only costs the next start its time
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return tokenizer


def save_tokenizer(tokenizer, header: GGUFHeader, folder: Path) -> None:
    """Save ``tokenizer`` in ``folder`` without tokens past the file's vocabulary: transformers'
    classes add their default special tokens (``<|endoftext|>`` to Llama 3's 128,256), which would
    give ids the model has no row for and make ``len(tokenizer)`` exceed its logits."""
    tokenizer.save_pretrained(folder)
    vocab_size = int(header.metadata.get("tokenizer.ggml.tokens", 0))
    backend_file, config_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
    backend = json.loads(backend_file.read_text())
    dropped = {t["content"] for t in backend.get("added_tokens", []) if t["id"] >= vocab_size}
    if dropped:
        backend["added_tokens"] = [t for t in backend["added_tokens"] if t["id"] < vocab_size]
        backend_file.write_text(json.dumps(backend, ensure_ascii=False))
        config = json.loads(config_file.read_text())
        decoder = config.get("added_tokens_decoder", {})
        config["added_tokens_decoder"] = {k: v for k, v in decoder.items() if int(k) < vocab_size}
        for name, value in list(config.items()):
            if isinstance(value, str) and value in dropped:
                config[name] = None  # e.g. an unk_token the vocabulary does not have
            elif isinstance(value, list):
                config[name] = [v for v in value if not (isinstance(v, str) and v in dropped)]
        config_file.write_text(json.dumps(config, ensure_ascii=False, indent=1))
    (folder / "verispec.json").write_text(json.dumps({"source": str(header.path), "rules": RULES_VERSION}))


def _load_saved(folder: Path):
    """A saved tokenizer, its ``tokenizer.json`` taken as written. (A model's own class, e.g.
    ``Qwen2Tokenizer``, rebuilds its pipeline from the vocabulary on load: NFC and all, which
    llama.cpp does not do, and without this module's rules.)"""
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(folder, local_files_only=True)


def build_tokenizer(header: GGUFHeader):
    """Build the tokenizer of ``header``'s file (no cache): transformers' conversion, then the
    llama.cpp rules of this module's docstring. Raises ModelIntegrityError when transformers fails."""
    try:
        tokenizer = _transformers_tokenizer(header)
    except Exception as exc:  # transformers raises anything from OSError to bare Exception
        raise ModelIntegrityError(
            f"could not read the tokenizer of {header.path}: {type(exc).__name__}: {exc}"
        ) from exc
    metadata = header.metadata
    if metadata.get("tokenizer.ggml.model") == "gpt2" and metadata.get("tokenizer.ggml.pre") in BPE_PRE_IGNORING_MERGES:
        tokenizer.backend_tokenizer.model.ignore_merges = True
    if metadata.get("tokenizer.ggml.model") == "llama":
        _set_space_prefix(tokenizer, bool(metadata.get("tokenizer.ggml.add_space_prefix", True)))
    if is_phi3_name(metadata):
        _strip_after_special_tokens(tokenizer, header)
    want_bos = llama_cpp_adds_bos(metadata)
    if _adds_bos(tokenizer) != want_bos:
        tokenizer.add_bos_token = want_bos  # transformers rewrites the post-processor on assignment
    return tokenizer


def _transformers_tokenizer(header: GGUFHeader):
    """transformers' tokenizer of the file, of the class AutoTokenizer would choose for it, without
    AutoTokenizer's read of the whole file for a model config (it is only used to name the class)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    architecture = header.architecture
    model_type = _MODEL_TYPES.get(architecture, architecture)
    if architecture == "llama" and "mistral" in str(header.metadata.get("general.name", "")).lower():
        model_type = "mistral"
    class_name = TOKENIZER_MAPPING_NAMES.get(model_type, "") or "TokenizersBackend"
    tokenizer_class = tokenizer_class_from_name(class_name)
    options = {"gguf_file": header.path.name, "local_files_only": True}
    if tokenizer_class is None:  # a class this transformers cannot import: let it decide, slowly
        return AutoTokenizer.from_pretrained(header.path.parent, **options)
    return tokenizer_class.from_pretrained(header.path.parent, **options)


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]


def _set_space_prefix(tokenizer, add_space_prefix: bool) -> None:
    """SentencePiece as llama.cpp runs it: spaces become ``▁``, and with ``add_space_prefix`` a ``▁``
    starts every stretch of text (the start, and after each special token); no pre-tokenizer."""
    from tokenizers import normalizers

    replace = normalizers.Replace(pattern=" ", content=SPACE)
    backend = tokenizer.backend_tokenizer
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(prepend=SPACE), replace]) if add_space_prefix else replace
    )
    backend.pre_tokenizer = None


def _strip_after_special_tokens(tokenizer, header: GGUFHeader) -> None:
    """Phi-3: every control or user-defined token but ``<unk>``, ``<s>``, ``<|endoftext|>`` swallows
    the whitespace after it (llama.cpp's RSTRIP), as the Phi-3 tokenizer.json marks them."""
    from tokenizers import AddedToken

    tokens = header.read_array("tokenizer.ggml.tokens")
    types = header.read_array("tokenizer.ggml.token_type") if "tokenizer.ggml.token_type" in header.arrays else []
    stripped = [
        AddedToken(token, rstrip=True, special=token_type != _USER_DEFINED, normalized=False)
        for token, token_type in zip(tokens, types, strict=False)
        if (token_type in (_CONTROL, _USER_DEFINED) and token not in NOT_STRIPPED_PHI3) or token == "</s>"
    ]
    if stripped:
        tokenizer.backend_tokenizer.add_special_tokens(stripped)


def chat_token_ids(
    tokenizer, conversation: list[dict], *, add_generation_prompt: bool = True, **template_options
) -> list[int]:
    """Token ids of ``conversation`` through the tokenizer's chat template, ready for the
    assistant's turn (``add_generation_prompt=False``: ending with the last message), as llama.cpp
    makes them (``common/chat.cpp``): where the vocabulary adds BOS, a BOS the template writes at
    the start is dropped and the tokenizer's own added, so a prompt starts with exactly one BOS
    whether or not the template writes it; special tokens in the rendered text are parsed. Raises
    what the template raises (jinja's TemplateError)."""
    text = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **template_options
    )
    bos = tokenizer.bos_token
    if bos and _adds_bos(tokenizer) and text.startswith(bos):
        text = text[len(bos) :]
    return list(tokenizer.encode(text, add_special_tokens=True))
