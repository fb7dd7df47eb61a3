"""Client mistakes get OpenAI-shaped 4xx, server faults a 500 with an error id, and the server
keeps serving; the queue bound (429), the API key (401) and client disconnects."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from server_support import (
    MAX_BODY_BYTES,
    MAX_TOKENS_CAP,
    GatedEngine,
    LiveServer,
    gated,
    http,
    metric_value,
    served,
    tiny_pipeline,
    wait_ready,
)
from verispec.server import create_app

MODEL = "tiny-target"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
C, CHAT = "/v1/completions", "/v1/chat/completions"

DEEP_SCHEMA: dict = {"type": "integer"}
for _ in range(130):
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}

BAD_INPUTS = [
    # (path, body (dict, or raw bytes), status, param or code expected in the error)
    (C, b'{"model": "tiny-target", "prompt": ', 400, None),  # malformed JSON
    (C, b"[1, 2]", 400, None),  # JSON, but not an object
    (C, b"", 400, None),  # no body
    (C, {**OK, "temperature": "hot"}, 400, "temperature"),  # wrong type
    (C, {**OK, "max_tokens": 2.5}, 400, "max_tokens"),  # float for an int
    (C, {**OK, "stream": "yes"}, 400, "stream"),  # string for a bool
    (C, {**OK, "logit_bias": {"a": 5}}, 400, "logit_bias"),  # keys are token ids
    (C, {**OK, "logit_bias": {"1": 500}}, 400, "logit_bias"),  # bias outside [-100, 100]
    (C, {**OK, "logit_bias": {"\u00b2": 5}}, 400, "logit_bias"),  # a Unicode digit is not a token id
    (C, {**OK, "logit_bias": {"9" * 5000: 5}}, 400, "logit_bias"),  # beyond any vocabulary
    (C, {**OK, "n": 16, "prompt": ["a"] * 16}, 400, "n"),  # more choices than the queue holds
    (
        C,
        {**OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_SCHEMA}}},
        400,
        "response_format",
    ),  # nested beyond the grammar compiler's limit
    (CHAT, {**CHAT_OK, "tool_choice": "required"}, 400, "tool_choice"),  # no tools
    (CHAT, {**CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400, "tools"),  # twice f
    (C, {**OK, "logit_bias": {"1000000": 5}}, 400, "logit_bias"),  # id outside the vocabulary
    (C, {**OK, "suffix": "x"}, 400, "suffix"),  # unsupported field (insertion)
    (C, {**OK, "logprobs": 21}, 400, "logprobs"),  # more alternatives than OpenAI allows
    (CHAT, {**CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs"),  # alternatives without logprobs
    (C, {**OK, "min_tokens": 5}, 400, None),  # min_tokens above max_tokens
    (C, {**OK, "response_format": {"type": "json_schema"}}, 400, "response_format"),  # no schema
    (C, {**OK, "response_format": {"type": "regex", "regex": "("}}, 400, "response_format"),  # does not compile
    (C, {**OK, "response_format": {"type": "xml"}}, 400, "response_format"),
    (
        CHAT,
        {
            **CHAT_OK,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
    ),  # unknown tool
    (C, {**OK, "temperature": -0.5}, 400, "temperature"),  # temperature < 0
    (C, {**OK, "top_p": 0.0}, 400, "top_p"),  # top_p outside (0, 1]
    (C, {**OK, "top_p": 1.5}, 400, "top_p"),
    (C, {**OK, "max_tokens": 0}, 400, "max_tokens"),  # max_tokens < 1
    (C, {**OK, "max_tokens": MAX_TOKENS_CAP + 1}, 400, "max_tokens"),  # above the server's cap
    (CHAT, {**CHAT_OK, "max_completion_tokens": MAX_TOKENS_CAP + 1}, 400, "max_completion_tokens"),
    (C, {**OK, "prompt": "hi " * 200}, 400, "context_length_exceeded"),  # longer than the context
    (CHAT, {**CHAT_OK, "messages": [{"role": "user", "content": "x" * 300}]}, 400, "context_length_exceeded"),
    (C, {**OK, "model": "gpt-4"}, 404, "model_not_found"),  # unknown model
    (CHAT, {**CHAT_OK, "model": "../etc/passwd"}, 404, "model_not_found"),  # never a path
    (C, {**OK, "n": 17}, 400, "n"),  # above the server's limit
    (C, {**OK, "n": 0}, 400, "n"),
    (C, {"prompt": "hi"}, 400, "model"),  # missing model
    (C, {**OK, "prompt": ""}, 400, "prompt"),  # empty prompt
    (C, {**OK, "prompt": ["a"] * 17}, 400, "prompt"),  # more prompts than the server's limit
    (C, {**OK, "prompt": ["a", ""]}, 400, "prompt"),  # one empty prompt among several
    (C, {**OK, "prompt": [1, 10**6]}, 400, "prompt"),  # token id outside the vocabulary
    (C, {**OK, "prompt": [1, -1]}, 400, "prompt"),
    (C, b'{"model": "tiny-target", "prompt": "\\ud800"}', 400, "prompt"),  # lone surrogate
    (C, {**OK, "stop": ""}, 400, "stop"),  # empty stop string
    (C, {**OK, "stop": ["x"] * 17}, 400, "stop"),  # too many stop strings
    (C, {**OK, "seed": 2**64}, 400, "seed"),  # seed beyond 64 bits
    (C, {**OK, "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {**OK, "repetition_penalty": 1e-300}, 400, "repetition_penalty"),  # would make NaN probabilities
    (C, {**OK, "temperature": 1e-40}, 400, "temperature"),  # ditto
    (C, {**OK, "top_p": 5e-324}, 400, "top_p"),  # ditto (0 in float32)
    (C, {**OK, "speculative": {"method": "bogus"}}, 400, "speculative"),  # unknown method
    (C, {**OK, "speculative": {"num_speculative_tokens": 0}}, 400, "speculative"),
    (C, {**OK, "speculative": {"k": 3}}, 400, "speculative"),
    (CHAT, {**CHAT_OK, "messages": []}, 400, "messages"),  # no messages
    (CHAT, {**CHAT_OK, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),  # unknown role
    (
        CHAT,
        {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages",
    ),
    (C, {**OK, "prompt": "x" * (MAX_BODY_BYTES + 1)}, 413, "request_too_large"),  # body size limit
]


@pytest.mark.parametrize("path, body, status, where", BAD_INPUTS)
def test_bad_input_gets_its_4xx_and_server_keeps_serving(http, path, body, status, where):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if where is not None:
        assert where in (error["param"], error["code"]), error
    assert http.post(C, json=OK).status_code == 200


@pytest.mark.parametrize(
    "headers, sent",
    [
        ({"content-type": "application/x-www-form-urlencoded"}, "Content-Type: application/x-www-form-urlencoded"),
        ({"content-type": "text/plain; charset=utf-8"}, "Content-Type: text/plain; charset=utf-8"),
    ],
)
def test_a_body_not_sent_as_json_is_told_to_send_json(http, headers, sent):
    # issue 54, item 7: `curl -d '{...}'` sends form data and got "body: Input should be a valid dictionary"
    response = http.post(C, content=json.dumps(OK).encode(), headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        f"the body must be a JSON object sent with Content-Type: application/json; this request sent {sent} "
        "(curl -d sends form data: add -H 'Content-Type: application/json')"
    )
    assert http.post(C, json=OK).status_code == 200


@pytest.mark.parametrize("headers", [{"content-type": "application/json"}, {"content-type": "application/x+json"}, {}])
def test_json_that_is_no_object_keeps_its_own_message(http, headers):
    # FastAPI reads these as JSON (no Content-Type too): the body is JSON, only not an object
    response = http.post(C, content=b"[1, 2]", headers=headers)
    assert response.status_code == 400 and "Content-Type" not in response.json()["error"]["message"]


def test_streamed_body_over_the_limit_is_413(http):
    def chunks():  # no Content-Length: the limit must count what arrives
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b" " * 1024

    response = http.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", C, 405), ("GET", "/v2/nothing", 404), ("DELETE", "/v1/models", 405), ("GET", "/v1/models/gpt-4", 404)],
)
def test_wrong_route_or_method(http, method, path, status):
    response = http.request(method, path)
    assert response.status_code == status and response.json()["error"]["message"]


# ----- servers of their own: API key, queue bound, faults, disconnects -----


def test_api_key_guards_v1_only():
    with LiveServer(create_app(tiny_pipeline(), api_key="s3cret")) as server:
        wait_ready(server.url)
        for headers, status in [
            ({}, 401),
            ({"Authorization": "Bearer nope"}, 401),
            ({"Authorization": "s3cret"}, 401),
            ({"Authorization": "Bearer s3cret"}, 200),
        ]:
            assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == status
        assert httpx.post(f"{server.url}{C}", json=OK).json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0).choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def _in_flight(server) -> float:
    return metric_value(server.url, "verispec_requests_in_flight")


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


def test_health_is_ready_only_after_warm_up():
    pipeline = tiny_pipeline()
    engine = pipeline.engine = GatedEngine(pipeline.engine)
    engine.warmup_gate.clear()
    with LiveServer(create_app(pipeline)) as server:
        health = httpx.get(f"{server.url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        response = httpx.post(f"{server.url}{C}", json=OK)
        assert (response.status_code, response.json()["error"]["code"]) == (503, "not_ready")
        engine.warmup_gate.set()
        engine.permits.release(10_000)
        wait_ready(server.url)
        assert httpx.post(f"{server.url}{C}", json=OK).status_code == 200


def test_full_queue_answers_429_and_queued_requests_complete(gated):
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=f"{gated.url}/v1", api_key="x", max_retries=0, timeout=60)
    ask = lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0).choices[0].text  # noqa: E731
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(ask)
        gated.engine.entered.wait(10)  # the first request is in the engine
        waiting = pool.submit(ask)
        _wait_until(lambda: metric_value(gated.url, "verispec_num_requests_waiting") == 1)
        response = httpx.post(f"{gated.url}{C}", json=OK)
        assert response.status_code == 429
        assert response.json()["error"] == {
            "message": "the request queue is full (1 waiting): retry later",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
        gated.engine.permits.release(10_000)
        assert running.result() == waiting.result() != ""


@pytest.mark.parametrize("stream", [False, True])
def test_server_fault_is_a_500_with_an_error_id(gated, stream):
    gated.engine.permits.release(10_000)
    gated.engine.fail = True
    response = httpx.post(f"{gated.url}{C}", json={**OK, "stream": stream})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "error id" in error["message"]
    assert metric_value(gated.url, "verispec_requests_failed_total", reason="worker_error") == 1
    assert httpx.post(f"{gated.url}{C}", json=OK).status_code == 200


def _send_and_drop(url: str, body: bytes, read_until: bytes | None) -> None:
    """POST ``body`` over a raw socket, optionally read until ``read_until``, then disconnect."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST {C} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        received = b""
        while read_until is not None and read_until not in received:
            received += sock.recv(4096)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_stops_generation_and_frees_kv(gated, stream):
    import json

    engine = gated.engine
    engine.permits.release(1)  # the first chunk only
    body = json.dumps({**OK, "max_tokens": 150, "stream": stream}).encode()
    _send_and_drop(gated.url, body, b"data: " if stream else None)
    engine.entered.wait(10)
    _wait_until(lambda: _in_flight(gated) == 0)  # the server saw the client go
    engine.permits.release(10_000)
    _wait_until(lambda: metric_value(gated.url, "verispec_num_requests_running") == 0)  # the worker dropped it
    assert engine.num_chunks == 2  # the worker dropped it after the pass running at the disconnect, not at 150 tokens
    assert engine.target.num_cached_tokens == 0  # KV cache freed
    assert httpx.post(f"{gated.url}{C}", json=OK).status_code == 200


# ----- the `verispec serve` command -----


def test_serve_command_loads_binds_loopback_and_serves(monkeypatch):
    import uvicorn
    from typer.testing import CliRunner

    from verispec import cli
    from verispec.engine.loader import SpeculativePipeline

    captured = {}
    monkeypatch.setattr(SpeculativePipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline()))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: captured.update(app=app, **kwargs))
    result = CliRunner().invoke(cli.app, ["serve", "--max-tokens-cap", "8", "-k", "3"])
    assert result.exit_code == 0, result.output
    assert (captured["host"], captured["port"]) == ("127.0.0.1", 8000)
    with LiveServer(captured["app"]) as server:
        wait_ready(server.url)
        too_many = httpx.post(f"{server.url}{C}", json={**OK, "max_tokens": 9})
        assert too_many.json()["error"]["param"] == "max_tokens"
        usage = httpx.post(f"{server.url}{C}", json={**OK, "max_tokens": 8}).json()["usage"]
        assert usage["num_draft_tokens"] <= 3 * usage["num_drafts"]  # -k 3 is the default


@pytest.mark.parametrize(
    "args", [["--target", "/nonexistent/model.gguf", "--draft", "none"], ["--method", "bogus"], ["--log-level", "loud"]]
)
def test_serve_command_user_mistakes_exit_2(args):
    from typer.testing import CliRunner

    from verispec import cli

    result = CliRunner().invoke(cli.app, ["serve", *args])
    assert result.exit_code == 2 and "error" in result.output


def test_prompt_over_the_runners_window_is_refused_as_context_length_exceeded():
    # the runner's KV window (e.g. the gguf runner's 4096) can be shorter than the model's own
    # context (32768 for Qwen2.5): the HTTP check must use the shorter, in the one error shape
    pipe = tiny_pipeline()
    window = pipe.target.context_length // 2
    pipe.target_runner.max_context_length = window
    app = create_app(pipe, max_tokens_cap=MAX_TOKENS_CAP, max_queue=4, max_body_bytes=MAX_BODY_BYTES)
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        wait_ready(server.url)
        response = client.post(C, json={**OK, "prompt": [1] * (window + 1)})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert f"context window is {window}" in error["message"]
        assert client.post(C, json={**OK, "prompt": [1] * (window - 8)}).status_code == 200


def test_an_unknown_dtype_is_refused_before_any_model_is_read():
    from verispec.engine.loader import SpeculativePipeline
    from verispec.errors import InvalidParameterError

    with pytest.raises(
        InvalidParameterError, match="dtype 'float8' is not supported; use one of float32, bfloat16, float16"
    ):
        SpeculativePipeline.load("no-such-model", None, dtype="float8")
