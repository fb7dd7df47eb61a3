"""``POST /tokenize`` and ``POST /detokenize`` (issue 54, item 2), in vLLM's shapes (llama.cpp's names
too): the ids the generation routes use, a round trip that gives the text back exactly, and the
folder ``verispec models export-tokenizer`` writes tokenizing as ``/tokenize`` does."""

from __future__ import annotations

import random

import httpx
import pytest
from transformers import AutoTokenizer

from helpers import tiny_qwen2
from server_support import LiveServer, build_tokenizer, http, save_checkpoint, served, wait_ready
from verispec.engine.loader import SpeculativePipeline
from verispec.models.tokenizer_export import export_tokenizer
from verispec.runners.select import RunnerOptions
from verispec.server import create_app

MODEL = "tiny-target"
# unicode (composed and decomposed, CJK split across merged bytes, emoji, no-break and zero-width
# spaces, right-to-left), whitespace runs, and the special tokens written as text
TEXTS = [
    "Hello world",
    "  two  spaces\n\n\ttab\r\n",
    " leading and trailing ",
    "caf\u00e9 cafe\u0301 \ufb01 \u00c5",
    "\u4f60\u597d\uff0c\u4e16\u754c \U0001f642\U0001f642",
    "\u00a0no-break\u200bzero-width\u2028line",
    "\u05e9\u05dc\u05d5\u05dd \u2211 x\u00b2",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<|im_end|><|im_end|>  <|im_start|>",
    "",
]
PIECES = [*TEXTS, "def f(x):", "\n", " ", "\t", "return", "\u00e9", "\U0001f600", "<|im_end|>", "12345", "  \n  "]


def random_texts(count: int, seed: int = 0) -> list[str]:
    """``count`` texts of 1-6 pieces each (deterministic)."""
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 6))) for _ in range(count)]


def tokenize(http, **body):
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def detokenize(http, tokens):
    response = http.post("/detokenize", json={"tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_then_detokenize_gives_the_text_back(http, text):
    got = tokenize(http, model=MODEL, prompt=text, add_special_tokens=False, return_token_strs=True)
    assert got["tokens"] == build_tokenizer().encode(text, add_special_tokens=False)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 256
    assert len(got["token_strs"]) == got["count"]
    assert detokenize(http, got["tokens"]) == {"prompt": text, "content": text}


def test_a_prompt_gives_the_ids_completions_use(http):
    got = tokenize(http, prompt="Hello 你好")  # add_special_tokens defaults to true, as vLLM's
    body = {"model": MODEL, "prompt": "Hello 你好", "max_tokens": 1}
    assert got["count"] == http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"]
    assert tokenize(http, content="Hello 你好", add_special=True)["tokens"] == got["tokens"]  # llama.cpp's names


def test_messages_give_the_ids_chat_completions_use(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    got = tokenize(http, model=MODEL, messages=messages)
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"
    assert detokenize(http, got["tokens"])["prompt"] == rendered
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    assert got["count"] == http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    without = tokenize(http, messages=messages, add_generation_prompt=False, add_special_tokens=False)
    assert detokenize(http, without["tokens"])["prompt"] == rendered.removesuffix("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/tokenize", {}, 400, "give exactly one of prompt (or content) and messages"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "exactly one"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": True, "add_special": True}, 400, "not both"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}, 400, "does not"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0].content is missing"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "the model 'other' does not exist"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "with_pieces": True}, 400, "with_pieces"),
        ("/detokenize", {"tokens": [1, 100000]}, 400, "token id 100000 is outside the tokenizer's vocabulary"),
        ("/detokenize", {"tokens": [-1]}, 400, "token id -1 is outside"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_bodies_are_named(http, path, body, status, message):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def checkpoint_server(tmp_path_factory):
    """A server over a checkpoint folder, loaded as verispec loads one (its tokenizer: AutoTokenizer's)."""
    tokenizer = build_tokenizer()
    model = tiny_qwen2(seed=0, vocab_size=len(tokenizer))
    checkpoint = save_checkpoint(tmp_path_factory.mktemp("tokenize") / "checkpoint", model, tokenizer)
    pipe = SpeculativePipeline.load(str(checkpoint), None, runners=RunnerOptions(kind="torch"))
    with LiveServer(create_app(pipe)) as live:
        wait_ready(live.url)
        with httpx.Client(base_url=live.url, timeout=60) as client:
            yield checkpoint, client


def test_the_exported_folder_tokenizes_as_tokenize_does(checkpoint_server, tmp_path):
    checkpoint, client = checkpoint_server
    folder = export_tokenizer(str(checkpoint), tmp_path / "exported")
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    exported = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS + random_texts(1000):
        for add_special_tokens in (True, False):
            served_ids = tokenize(client, prompt=text, add_special_tokens=add_special_tokens)["tokens"]
            assert exported.encode(text, add_special_tokens=add_special_tokens) == served_ids, text
    messages = [{"role": "user", "content": "caf\u00e9 \U0001f642"}]
    served_ids = tokenize(client, messages=messages)["tokens"]
    rendered = exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert exported.encode(rendered, add_special_tokens=False) == served_ids  # the template writes any BOS
