"""The ``openai`` SDK side of the server feature tests: a client on a live server over the tiny pair
(the ``client`` fixture), request wrappers that add the ``speculative`` extension, views of
responses compared with a stated tolerance on log-probabilities, and the schema and tool the tests share."""

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


LOGPROB_TOLERANCE = 1e-4
"""How far a log-probability in a speculative response may be from plain decoding's on the tiny
server. Its torch runner (float32) is not batch-invariant: a k-row verify pass and a 1-row step add
in other orders and differ in the last bits (at most 1.2e-6 over the four methods, measured
2026-12-07), and how many rows a step verifies
depends on what the server and its cost model saw before (``auto``'s choices follow the suffix cache
and the controller), so comparing rounded values failed when one landed on a rounding boundary, in
some test orders only. Tokens, text, bytes and finish reasons are compared exactly; bit-identical
log-probabilities are the gguf runner's claim (tests/engine/test_features_exact.py)."""


def difference(got, expected, tolerance: float = LOGPROB_TOLERANCE, where: str = "response") -> str | None:
    """Where ``got`` differs from ``expected`` (nested lists, tuples and dicts), or None: floats
    within ``tolerance`` of each other are the same, everything else must be equal."""
    if isinstance(expected, float) or isinstance(got, float):
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (got, expected))
        if numbers and abs(got - expected) <= tolerance:
            return None
        return f"{where}: {got!r} != {expected!r} (tolerance {tolerance})"
    if isinstance(expected, dict) and isinstance(got, dict):
        if got.keys() != expected.keys():
            return f"{where}: keys {sorted(got)} != {sorted(expected)}"
        return next((d for k in expected if (d := difference(got[k], expected[k], tolerance, f"{where}[{k!r}]"))), None)
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(got) != len(expected):
            return f"{where}: {len(got)} items != {len(expected)}"
        pairs = enumerate(zip(got, expected))
        return next((d for i, (g, e) in pairs if (d := difference(g, e, tolerance, f"{where}[{i}]"))), None)
    return None if got == expected else f"{where}: {got!r} != {expected!r}"


def assert_same(got, expected, tolerance: float = LOGPROB_TOLERANCE) -> None:
    """``got`` equals ``expected``, log-probabilities within ``tolerance`` (:func:`difference`)."""
    found = difference(got, expected, tolerance)
    assert found is None, found


def completion_view(response):
    """Text, finish reason and logprobs of each choice, to compare with :func:`assert_same`."""
    return [
        (
            c.text,
            c.finish_reason,
            c.logprobs and (c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs),
        )
        for c in response.choices
    ]


def chat_view(response):
    """Content, finish reason and logprobs of each choice, to compare with :func:`assert_same`."""

    def logprobs(c):
        if c.logprobs is None:
            return None
        return [
            (e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs]) for e in c.logprobs.content
        ]

    return [(c.message.content, c.finish_reason, logprobs(c)) for c in response.choices]
