"""Loading a model reference into a transformers causal LM and its tokenizer.

Owns the transformers calls, the dtype/device choice, the header checks that turn corrupt
weight files into clear errors, and the facts the engine needs (EOS ids, context length, logits
width), or those facts alone for a GGUF reference (:func:`load_gguf_info`). Where the files come
from is ``store.py``'s business; this module knows nothing about
generation or speculation.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verispec.errors import InvalidParameterError, ModelIntegrityError, ModelNotFoundError
from verispec.models.gguf_file import read_gguf_header
from verispec.models.gguf_tokenizer import cached_tokenizer
from verispec.models.store import ModelSource, ModelStore

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
_MAX_GGUF_COUNT = 1 << 24  # tensors or metadata entries; real files have a few thousand
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


@dataclass
class LoadedModel:
    """A loaded causal LM (eval mode, no grad) with its tokenizer and the facts about it.

    ``param_bytes`` counts parameters and buffers in bytes; ``vocab_size`` is the logits width
    (may exceed ``len(tokenizer)`` by padding rows); ``load_time_s`` excludes any download.
    """

    name: str
    model: Any  # transformers PreTrainedModel (AutoModelForCausalLM)
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    path: Path | None
    load_time_s: float
    param_bytes: int
    eos_token_ids: tuple[int, ...]
    context_length: int
    vocab_size: int


def load_model(
    ref: str, *, dtype: str = "float32", device: str = "cpu", store: ModelStore | None = None
) -> LoadedModel:
    """Load model reference ``ref`` (built-in name, .gguf, checkpoint dir or hub id).

    GGUF weights are dequantized to ``dtype`` ("float32", "bfloat16" or "float16"). Built-in
    names are fetched on first use through ``store`` (default: ``ModelStore()``, with progress).
    Raises InvalidParameterError (bad dtype/device), ModelNotFoundError (nothing at ``ref``),
    ModelIntegrityError (corrupt or unloadable weights), ModelFetchError (download failed).
    """
    torch_dtype = _parse_dtype(dtype)
    torch_device = parse_device(device)
    source = (store or ModelStore()).resolve(ref)
    start = time.perf_counter()
    model, tokenizer = _load_source(source, torch_dtype)
    model.to(torch_device)
    model.eval()
    model.requires_grad_(False)
    load_time_s = time.perf_counter() - start
    return LoadedModel(
        name=source.name,
        model=model,
        tokenizer=tokenizer,
        path=source.path,
        load_time_s=load_time_s,
        param_bytes=_param_bytes(model),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        context_length=_context_length(model),
        vocab_size=_logits_width(model),
    )


def check_gguf_header(path: Path) -> None:
    """Check that ``path`` starts like a GGUF file: magic, a supported version, sane counts.

    Raises ModelIntegrityError naming the file and what is wrong.
    """
    with open(path, "rb") as source:
        head = source.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise ModelIntegrityError(
            f"{path} is not a valid GGUF file: it does not start with the GGUF magic bytes (found {head[:4]!r})"
        )
    version, tensor_count, kv_count = struct.unpack("<IQQ", head[4:24])
    if version not in GGUF_VERSIONS:
        raise ModelIntegrityError(f"{path} is not a valid GGUF file: version {version} is not one of {GGUF_VERSIONS}")
    if tensor_count > _MAX_GGUF_COUNT or kv_count > _MAX_GGUF_COUNT:
        raise ModelIntegrityError(
            f"{path} is not a valid GGUF file: implausible header ({tensor_count} tensors, {kv_count} metadata entries)"
        )


def check_safetensors_header(path: Path) -> None:
    """Check that ``path`` has a parseable safetensors header and holds all its tensor bytes.

    Raises ModelIntegrityError naming the file and what is wrong.
    """
    size = path.stat().st_size
    with open(path, "rb") as source:
        prefix = source.read(8)
        if len(prefix) < 8:
            raise _bad_safetensors(path, f"only {len(prefix)} bytes long")
        header_length = int.from_bytes(prefix, "little")
        if header_length > min(size - 8, _MAX_SAFETENSORS_HEADER):
            raise _bad_safetensors(path, f"header length {header_length} exceeds the file")
        try:
            header = json.loads(source.read(header_length))
            data_end = max(
                (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise _bad_safetensors(path, f"unparseable header ({exc})") from None
    if 8 + header_length + data_end > size:
        raise _bad_safetensors(path, f"truncated: tensors need {8 + header_length + data_end} bytes, file has {size}")


def _bad_safetensors(path: Path, reason: str) -> ModelIntegrityError:
    return ModelIntegrityError(f"{path} is not a valid safetensors file: {reason}")


def _parse_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InvalidParameterError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}") from None


def parse_device(device: str) -> torch.device:
    """``device`` as a torch device this machine has (a tensor is made there to check).
    Raises InvalidParameterError naming the device and why it is not available."""
    try:
        parsed = torch.device(device)
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InvalidParameterError(f"device {device!r} is not available: {reason}") from None
    return parsed


def _load_source(source: ModelSource, torch_dtype: torch.dtype) -> tuple[Any, Any]:
    """Run transformers on a resolved source; turn its failures into verispec errors."""
    options: dict[str, Any] = {"local_files_only": source.kind != "hub"}
    header = None
    if source.kind == "gguf":
        header = read_gguf_header(source.path)  # not a GGUF file, or truncated: said here, not as numpy's reshape error
        location: str | Path = source.path.parent
        options["gguf_file"] = source.path.name
    elif source.kind == "directory":
        for weights in sorted(source.path.glob("*.safetensors")):
            check_safetensors_header(weights)
        location = source.path
    else:
        location = source.hub_id
    try:
        with _quiet_transformers():  # our own one-line progress says what loads; no carriage-return bars
            model = AutoModelForCausalLM.from_pretrained(location, dtype=torch_dtype, **options)
            # a GGUF's tokenizer is the one every runner uses: llama.cpp's BOS and rules, cached
            tokenizer = cached_tokenizer(header) if header else AutoTokenizer.from_pretrained(location, **options)
    except Exception as exc:  # transformers raises anything from OSError to bare Exception
        if source.kind == "hub":
            raise ModelNotFoundError(f"could not load {source.hub_id!r} from the Hugging Face hub: {exc}") from exc
        raise ModelIntegrityError(
            f"could not load {source.path}: the weights are corrupt or of an unsupported "
            f"kind ({type(exc).__name__}: {exc})"
        ) from exc
    return model, tokenizer


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off while loading, restored after: "Loading weights" follows
    transformers' own switch; the GGUF converter's "Converting and de-quantizing GGUF
    tensors..." calls tqdm directly, so its module's ``tqdm`` is swapped for a disabled one."""
    import functools
    import importlib

    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    swapped = []
    try:
        gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
        if callable(getattr(gguf_utils, "tqdm", None)):
            swapped.append((gguf_utils, gguf_utils.tqdm))
            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    except ImportError:  # an older or newer transformers without the module: nothing to swap
        pass
    try:
        yield
    finally:
        for module, original in swapped:
            module.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()


def _param_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


# Special tokens that end generation wherever a vocabulary has them (llama.cpp's end-of-generation
# list, src/llama-vocab.cpp: a GGUF names one EOS, e.g. Qwen2.5 instruct's <|im_end|>, but a raw
# completion ends with <|endoftext|> and FIM-trained coders emit their file markers)
END_OF_GENERATION_TOKENS = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<end_of_utterance>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)


def _eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Stop tokens of a transformers model: generation_config's EOS id(s) first, then the model
    config's, then :func:`stop_token_ids`'s."""
    generation_config = getattr(model, "generation_config", None)
    return stop_token_ids(
        tokenizer, getattr(generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None)
    )


def stop_token_ids(tokenizer: Any, *candidates) -> tuple[int, ...]:
    """Stop tokens: ``candidates`` (ids, lists of ids or None) first, then the tokenizer's EOS,
    then the vocabulary's special end-of-generation tokens (:data:`END_OF_GENERATION_TOKENS`).

    Order is kept and duplicates dropped, so the first id is the primary EOS.
    """
    ids: list[int] = []
    for candidate in (*candidates, tokenizer.eos_token_id, _special_end_tokens(tokenizer)):
        for token_id in candidate if isinstance(candidate, (list, tuple)) else [candidate]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def _special_end_tokens(tokenizer: Any) -> list[int]:
    """Ids of the tokenizer's *special* added tokens named in :data:`END_OF_GENERATION_TOKENS`."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted(
        int(i)
        for i, token in added.items()
        if getattr(token, "special", False) and str(token) in END_OF_GENERATION_TOKENS
    )


def _context_length(model: Any) -> int:
    config = model.config.get_text_config()
    for attribute in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelIntegrityError(f"the model config of {model.name_or_path} names no context length")


def _logits_width(model: Any) -> int:
    output_embeddings = model.get_output_embeddings()
    if output_embeddings is not None and hasattr(output_embeddings, "weight"):
        return int(output_embeddings.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


@dataclass(frozen=True)
class TokenizerInfo:
    """What a model's prompts are checked against before its weights load: its tokenizer and
    trained context (tokens)."""

    name: str
    tokenizer: Any  # transformers PreTrainedTokenizerBase, as the loaded model's
    context_length: int


def load_tokenizer_info(ref: str, *, store: ModelStore | None = None) -> TokenizerInfo | None:
    """The tokenizer and trained context of ``ref`` without its weights: a GGUF file's header and
    (cached) tokenizer, as :func:`load_gguf_info`; a checkpoint folder's tokenizer files and config.
    None for a hub id (nothing is downloaded for a check) or a folder transformers cannot read (the
    load says why). A built-in name is fetched on first use, as loading it would.

    Raises:
        ModelNotFoundError, ModelIntegrityError, ModelFetchError: from the model store.
    """
    store = store or ModelStore()
    source = store.resolve(ref)
    if source.kind == "gguf":
        loaded = load_gguf_info(ref, store=store)
        return TokenizerInfo(loaded.name, loaded.tokenizer, loaded.context_length)
    if source.kind != "directory":
        return None
    from transformers import AutoConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path, local_files_only=True)
        config = AutoConfig.from_pretrained(source.path, local_files_only=True).get_text_config()
    except Exception:  # transformers raises anything from OSError to bare Exception; the load reports it
        return None
    for attribute in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value > 0:
            return TokenizerInfo(source.name, tokenizer, value)
    return None


def load_gguf_info(ref: str, *, store=None, runner: str = "llama.cpp"):
    """A :class:`LoadedModel` for a GGUF reference without a torch model (every runner but torch
    reads its weights itself).

    ``model`` is None; the tokenizer (built once, then cached by tokenizer: see
    :func:`verispec.models.gguf_tokenizer.cached_tokenizer`), EOS ids, context length and logits width
    come from the GGUF header; no tensor is read. ``param_bytes`` is the file size. Raises
    InvalidParameterError when ``ref`` is not a GGUF file, and the model store's errors
    (ModelNotFoundError, ModelIntegrityError, ModelFetchError).
    """
    source = (store or ModelStore()).resolve(ref)
    if source.kind != "gguf":
        raise InvalidParameterError(f"the {runner} runner needs a .gguf model, and {ref!r} is a {source.kind}")
    start = time.perf_counter()
    header = read_gguf_header(source.path)
    tokenizer = cached_tokenizer(header)
    eos = stop_token_ids(
        tokenizer, *(header.metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom"))
    )
    embedding = header.tensors.get("output.weight") or header.tensors.get("token_embd.weight")
    vocab_size = int(embedding.shape[1]) if embedding is not None and len(embedding.shape) == 2 else len(tokenizer)
    return LoadedModel(
        name=source.name,
        model=None,
        tokenizer=tokenizer,
        path=source.path,
        load_time_s=time.perf_counter() - start,
        param_bytes=source.path.stat().st_size,
        eos_token_ids=eos,
        context_length=int(header.arch_value("context_length", 2048)),
        vocab_size=vocab_size,
    )
