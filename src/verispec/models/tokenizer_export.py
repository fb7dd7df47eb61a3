"""A model's tokenizer written as a folder ``transformers.AutoTokenizer`` loads, tokenizing exactly as
verispec does (and as its server's ``/tokenize`` answers), for tools that need a Hugging Face
tokenizer beside an OpenAI-compatible server: lm-evaluation-harness scores loglikelihood tasks
with one (``tokenizer_backend=huggingface``). Knows nothing about serving or generation.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from verispec.errors import InvalidParameterError, ModelIntegrityError
from verispec.models.gguf_file import read_gguf_header
from verispec.models.gguf_tokenizer import cached_tokenizer, save_tokenizer
from verispec.models.store import ModelStore

# strings the written folder must tokenize as verispec does before it is kept: spaces, tabs and
# newlines, composed and decomposed accents (a model class's own normalizer would change them),
# CJK and emoji, special tokens written as text
PROBES = (
    "def f(x):\n    return x  # two spaces\n\n\ttab",
    "caf\u00e9 cafe\u0301 \ufb01 \u00c5ngstr\u00f6m",
    "\u4f60\u597d\uff0c\u4e16\u754c \U0001f642",
    " leading and trailing ",
)
# what AutoTokenizer instantiates: the tokenizer.json as written (a model's own class, e.g.
# Qwen2Tokenizer, rebuilds its pipeline from the vocabulary on load, NFC included, which llama.cpp
# and verispec do not do). transformers 5 names it TokenizersBackend and keeps this name for it;
# transformers 4 knows only this one.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def export_tokenizer(ref: str, directory: Path, *, store: ModelStore | None = None) -> Path:
    """Write the tokenizer of model ``ref`` (a built-in name, a ``.gguf`` file or a checkpoint
    folder) into ``directory`` (created; files of the same names replaced): ``tokenizer.json``,
    ``tokenizer_config.json`` (special tokens, BOS as the model adds it) and the chat template
    (``chat_template.jinja``) where the model has one. ``AutoTokenizer.from_pretrained(directory)``
    then gives the ids verispec prompts with, checked on :data:`PROBES` before returning.

    Returns ``directory``.

    Raises:
        ModelNotFoundError, ModelIntegrityError, ModelFetchError: from the model store, or a
            folder that does not tokenize as the model's own tokenizer.
        InvalidParameterError: ``directory`` is a file, or cannot be written.
    """
    store = store or ModelStore()
    directory = Path(directory).expanduser()
    if directory.exists() and not directory.is_dir():
        raise InvalidParameterError(f"{directory} is a file: give a folder to write the tokenizer into")
    source = store.resolve(ref)
    header = read_gguf_header(source.path) if source.kind == "gguf" else None
    if header is not None:
        tokenizer = cached_tokenizer(header)
    else:
        from transformers import AutoTokenizer

        location = source.path if source.path is not None else source.hub_id
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=source.kind != "hub")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=directory))
    except OSError as exc:
        raise InvalidParameterError(f"cannot write the tokenizer into {directory}: {exc.strerror}") from None
    try:
        if header is not None:  # without tokens past the file's vocabulary, as the cache keeps it
            save_tokenizer(tokenizer, header, scratch)
        else:
            tokenizer.save_pretrained(scratch)
        (scratch / "verispec.json").unlink(missing_ok=True)
        config_file = scratch / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["tokenizer_class"] = TOKENIZER_CLASS
        for key in ("is_local", "local_files_only"):  # facts of the cache it was read from, not of the folder
            config.pop(key, None)
        if getattr(tokenizer, "chat_template", None):  # also here: older transformers read no chat_template.jinja
            config["chat_template"] = tokenizer.chat_template
        config_file.write_text(json.dumps(config, ensure_ascii=False, indent=1))
        _check_same_tokens(tokenizer, scratch, source.name)
        for path in scratch.iterdir():
            path.replace(directory / path.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory


def _check_same_tokens(tokenizer, folder: Path, name: str) -> None:
    from transformers import AutoTokenizer

    written = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    probes = list(PROBES)
    special = [t for t in (tokenizer.bos_token, tokenizer.eos_token) if t]
    probes.append("".join(f"{t}x" for t in special))
    for text in probes:
        for add_special_tokens in (True, False):
            expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            if written.encode(text, add_special_tokens=add_special_tokens) != expected:
                raise ModelIntegrityError(
                    f"the tokenizer written for {name} does not tokenize {text!r} as {name}'s own: not kept"
                )
    if (written.chat_template or None) != (getattr(tokenizer, "chat_template", None) or None):
        raise ModelIntegrityError(f"the tokenizer written for {name} lost its chat template: not kept")
