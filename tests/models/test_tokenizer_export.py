"""``verispec models export-tokenizer NAME DIR`` (issue 54, item 2): a folder ``AutoTokenizer`` loads
that tokenizes exactly as verispec (and its ``/tokenize``) does, for every tokenizer family of the
GGUF files, and for the real models where they are in the cache; ``/detokenize`` of those ids gives
the text back."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from gguf_tokenizers import write_tokenizer_gguf
from verispec.cli import app
from verispec.errors import InvalidParameterError
from verispec.models.gguf_file import read_gguf_header
from verispec.models.gguf_tokenizer import cached_tokenizer
from verispec.models.loading import load_gguf_info
from verispec.models.store import ModelStore
from verispec.models.tokenizer_export import export_tokenizer

PIECES = [
    "def fib(n):",
    "\n",
    "\n\n",
    " ",
    "   ",
    "\t",
    "\r\n",
    "the quick brown fox",
    "Hello, world!",
    "caf\u00e9",
    "cafe\u0301",
    "\ufb01",
    "\u4f60\u597d",
    "\U0001f642",
    "\u00a0",
    "\u200b",
    "\u05e9\u05dc\u05d5\u05dd",
    "12345",
    "  # comment",
]


def texts(special: list[str], count: int = 1000, seed: int = 0) -> list[str]:
    """``count`` deterministic texts of 1-6 pieces, the family's special tokens among them."""
    rng = random.Random(seed)
    pool = PIECES + special
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 6))) for _ in range(count)]


def assert_tokenizes_alike(exported, tokenizer, strings: list[str]) -> None:
    for text in strings:
        for add_special_tokens in (True, False):
            expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            assert exported.encode(text, add_special_tokens=add_special_tokens) == expected, (text, add_special_tokens)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3", "phi3"])
def test_every_gguf_family_exports_a_tokenizer_that_tokenizes_alike(tmp_path, family):
    path = write_tokenizer_gguf(tmp_path / f"{family}.gguf", family)
    tokenizer = cached_tokenizer(read_gguf_header(path))  # what the pipeline, and /tokenize, encode with
    folder = export_tokenizer(str(path), tmp_path / "exported")
    exported = AutoTokenizer.from_pretrained(folder)
    special = [str(t) for t in tokenizer.all_special_tokens]
    assert_tokenizes_alike(exported, tokenizer, texts(special))
    assert exported.chat_template == tokenizer.chat_template  # phi3's file has one, the others none
    assert len(exported) == len(tokenizer)


def test_a_file_in_the_way_is_refused(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "qwen3.gguf", "qwen3")
    (tmp_path / "taken").write_text("x")
    with pytest.raises(InvalidParameterError, match="is a file: give a folder"):
        export_tokenizer(str(path), tmp_path / "taken")
    result = CliRunner().invoke(app, ["models", "export-tokenizer", str(path), str(tmp_path / "taken")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("error: ")


def test_the_command_prints_the_folder(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "gemma3.gguf", "gemma3")
    result = CliRunner().invoke(app, ["models", "export-tokenizer", str(path), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct", "gemma-3-270m"])
def test_a_real_models_export_tokenizes_alike_and_round_trips(tmp_path, name):
    if ModelStore().cache_state(name) == "missing":  # the suite never downloads: `make test` fetches it
        pytest.skip(f"not in the model cache: {name} (verispec models fetch {name})")
    tokenizer = load_gguf_info(name).tokenizer  # the pipeline's tokenizer, without the weights
    exported = AutoTokenizer.from_pretrained(export_tokenizer(name, tmp_path / "exported"))
    special = [t for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<start_of_turn>")]
    strings = texts([t for t in special if t in tokenizer.get_vocab()])
    assert_tokenizes_alike(exported, tokenizer, strings)
    for text in strings:  # what /detokenize gives for /tokenize's ids (add_special_tokens false)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    assert exported.chat_template == tokenizer.chat_template
