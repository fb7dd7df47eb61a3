"""Tests of the GGUF tokenizer: every family tokenizes a prompt as llama.cpp does, BOS included.

The tiny vocabulary-only files of ``gguf_tokenizers.py`` (Llama 3, Qwen3, Gemma 3, Phi-3 shapes) are
compared with llama.cpp's own tokenizer (``llama_cpp.Llama(vocab_only=True).tokenize``, BOS and
special tokens on: what a llama.cpp server does with a prompt); the real Gemma 3 270M file too,
when it is in the model cache.
"""

from __future__ import annotations

import functools

import pytest

from gguf_tokenizers import CHAT_TEMPLATE, CORPUS, write_tokenizer_gguf
from verispec.models import gguf_tokenizer
from verispec.models.gguf_file import read_gguf_header
from verispec.models.gguf_tokenizer import (
    cache_key,
    cached_tokenizer,
    chat_token_ids,
    is_phi3_name,
    llama_cpp_adds_bos,
)
from verispec.models.store import ModelStore

FAMILIES = ("llama3", "qwen3", "gemma3", "phi3")
TEXTS = [
    *CORPUS,
    "Hello",
    " leading space",
    "  two spaces",
    "x\n\n  y\t",
    "ünïcödé 🙂 e\u0301",  # multi-byte, and a decomposed é llama.cpp does not normalize
    "<|user|>\nhi<|end|>\n<|assistant|>\n",  # Phi-3: its special tokens eat the newline after them
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|begin_of_text|>hi<|eot_id|>",
    "<|endoftext|> not in Llama 3's vocabulary",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizers")
    return {family: write_tokenizer_gguf(folder / f"{family}.gguf", family) for family in FAMILIES}


@pytest.fixture(scope="module")
def tokenizers(files, tmp_path_factory):
    cache = tmp_path_factory.mktemp("tokenizer-cache")
    return {family: cached_tokenizer(read_gguf_header(path), cache) for family, path in files.items()}


def llama_cpp_vocab(path):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_ids_equal_llama_cpp(files, tokenizers, family):
    vocab = llama_cpp_vocab(files[family])
    for text in TEXTS:
        ours = tokenizers[family].encode(text, add_special_tokens=True)
        assert ours == vocab.tokenize(text.encode(), add_bos=True, special=True), (family, text)


@pytest.mark.parametrize(
    "family, bos_first, length",
    [
        ("llama3", True, 395),  # no flag in the file: llama.cpp adds BOS for pre-tokenizer llama-bpe
        ("qwen3", False, 395),  # gpt2/qwen2 without a flag: no BOS
        ("gemma3", True, 458),  # add_bos_token true
        ("phi3", True, 459),  # add_bos_token true
    ],
)
def test_bos_and_length_follow_the_file(files, tokenizers, family, bos_first, length):
    tokenizer = tokenizers[family]
    header = read_gguf_header(files[family])
    assert (tokenizer.encode("Hello")[0] == tokenizer.bos_token_id) is bos_first
    assert len(tokenizer) == length == header.metadata["tokenizer.ggml.tokens"]  # no token past the vocabulary


def test_what_transformers_alone_gets_wrong(files):
    """Each rule of gguf_tokenizer.py changes something here: without it, llama.cpp's ids differ."""
    llama3 = gguf_tokenizer._transformers_tokenizer(read_gguf_header(files["llama3"]))
    assert llama3.encode("Hello")[0] != llama3.bos_token_id  # no BOS for Llama 3
    assert len(llama3) == 396  # <|endoftext|> added past the 395 tokens
    phi3 = gguf_tokenizer._transformers_tokenizer(read_gguf_header(files["phi3"]))
    text = "<|user|>\nhi<|end|>\n"
    assert phi3.encode(text) != llama_cpp_vocab(files["phi3"]).tokenize(text.encode(), add_bos=True, special=True)


@pytest.mark.parametrize(
    "metadata, adds_bos",
    [
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe"}, True),  # Llama 3
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}, False),  # Qwen2/Qwen3
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False}, 0),
        ({"tokenizer.ggml.model": "llama"}, True),  # SentencePiece without a flag
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_bos_token": False}, False),
        ({"tokenizer.ggml.model": "t5"}, False),
    ],
)
def test_llama_cpp_bos_rule(metadata, adds_bos):
    assert llama_cpp_adds_bos({"tokenizer.ggml.bos_token_id": 1, **metadata}) == bool(adds_bos)
    assert llama_cpp_adds_bos(metadata) is False  # no BOS id: nothing to add


def test_phi3_is_known_by_name():
    assert is_phi3_name({"general.name": "Phi-3 Mini 4k Instruct"}) and is_phi3_name({"general.name": "phi3"})
    assert not is_phi3_name({"general.name": "Phi 4 Mini Instruct"})  # Phi-4-mini: a BPE vocabulary, no rule


def test_the_cache_is_read_back_alike_and_keyed_by_architecture(files, tmp_path):
    header = read_gguf_header(files["gemma3"])
    first = cached_tokenizer(header, tmp_path)
    assert cached_tokenizer(header, tmp_path) is first  # one object per process
    gguf_tokenizer._IN_PROCESS.clear()
    again = cached_tokenizer(header, tmp_path)  # from disk now
    assert again is not first
    assert [again.encode(t) for t in TEXTS] == [first.encode(t) for t in TEXTS]
    assert [p.name for p in tmp_path.iterdir()] == [cache_key(header)]  # no scratch folder left behind
    assert cache_key(header) != cache_key(read_gguf_header(files["phi3"]))


def test_a_slow_build_says_so(files, tmp_path, capsys, monkeypatch):
    from verispec import progress

    monkeypatch.setattr(progress, "announce_slow", functools.partial(progress.announce_slow, after_s=0.0))
    monkeypatch.setattr(gguf_tokenizer, "_IN_PROCESS", {})
    cached_tokenizer(read_gguf_header(files["qwen3"]), tmp_path)
    assert "building the tokenizer of qwen3.gguf" in capsys.readouterr().err


def test_chat_template_from_metadata_and_one_bos(files, tokenizers):
    tokenizer = tokenizers["phi3"]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = chat_token_ids(tokenizer, [{"role": "user", "content": "hi"}])
    rendered = "<|user|>\nhi<|end|>\n<|assistant|>\n"  # the template writes no BOS: llama.cpp adds it
    assert ids == llama_cpp_vocab(files["phi3"]).tokenize(rendered.encode(), add_bos=True, special=True)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_a_template_that_writes_bos_gives_one(tokenizers):
    tokenizer = tokenizers["gemma3"]
    template = (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>user\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    )
    ids = chat_token_ids(tokenizer, [{"role": "user", "content": "hi"}], chat_template=template)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


@pytest.mark.real_model
def test_the_real_gemma_file_tokenizes_as_llama_cpp(user_verispec_home):
    store = ModelStore(home=user_verispec_home)
    if store.cache_state("gemma-3-270m") != "cached":
        pytest.skip("gemma-3-270m is not in the model cache (verispec models fetch gemma-3-270m)")
    path = store.fetch("gemma-3-270m")
    tokenizer = cached_tokenizer(read_gguf_header(path))
    vocab = llama_cpp_vocab(path)
    assert len(tokenizer) == 262_144
    for text in TEXTS:
        assert tokenizer.encode(text) == vocab.tokenize(text.encode(), add_bos=True, special=True), text
    assert tokenizer.encode("Hello, world!") == [2, 9259, 236764, 1902, 236888]  # <bos> first
