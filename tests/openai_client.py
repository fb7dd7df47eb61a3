"""The ``openai`` SDK side of the server feature tests: a client on a live server over the tiny pair
(the ``client`` fixture), request wrappers that add the ``speculative`` extension, views of
responses rounded for comparison, and the schema and tool the tests share."""

from __future__ import annotations

import openai
import pytest

from server_support import LiveServer, build_tokenizer, tiny_pipeline, wait_ready
from verispec.server import create_app

MODEL = "tiny-target"
EOS = str(build_tokenizer().eos_token_id)
METHODS = ["draft", "ngram", "auto", "tree"]
CHAT = [{"role": "user", "content": "你好"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": [1, 2, 3]},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client():
    """A server over the tiny pair with room for grammar-bound outputs (one token per character)."""
    with LiveServer(create_app(tiny_pipeline(), max_tokens_cap=200, max_queue=64)) as server:
        wait_ready(server.url)
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def spec(method):
    return {"speculative": {"method": method, "num_speculative_tokens": 4}}


EXTENSIONS = ("min_tokens", "response_format", "ignore_eos")  # not in the SDK's completions.create


def completion(client, method, **kwargs):
    kwargs.setdefault("prompt", "Hello")
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("temperature", 0)
    extra = {**spec(method), **{k: kwargs.pop(k) for k in EXTENSIONS if k in kwargs}}
    return client.completions.create(model=MODEL, extra_body=extra, **kwargs)


def chat(client, method, **kwargs):
    kwargs.setdefault("messages", CHAT)
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("temperature", 0)
    extra = {**spec(method), **{k: kwargs.pop(k) for k in ("min_tokens", "ignore_eos") if k in kwargs}}
    return client.chat.completions.create(model=MODEL, extra_body=extra, **kwargs)


def rounded(value, places=4):
    """Floats rounded (the tiny server's torch runner is not batch-invariant: a k-row verify
    pass and a 1-row step differ in the last bits; the gguf runner's rows are bit-identical,
    tests/engine/test_features_exact.py); the tokens themselves must be equal."""
    if isinstance(value, float):
        return round(value, places)
    if isinstance(value, dict):
        return {k: rounded(v, places) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(rounded(v, places) for v in value)
    return value


def completion_view(response):
    return rounded(
        [
            (
                c.text,
                c.finish_reason,
                c.logprobs and (c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs),
            )
            for c in response.choices
        ]
    )


def chat_view(response):
    def logprobs(c):
        if c.logprobs is None:
            return None
        return [
            (e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs]) for e in c.logprobs.content
        ]

    return rounded([(c.message.content, c.finish_reason, logprobs(c)) for c in response.choices])
