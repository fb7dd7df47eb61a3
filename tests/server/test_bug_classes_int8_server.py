"""The public bug classes of issue 29 that go through a live server over the tiny pair: a client
leaving while its speculative step is in flight (the others and the next request stay exact),
streamed deltas of multi-token steps (whole characters, tool-call arguments), and a speculation
the server cannot run refused with a 400. Compared against plain decoding of the same request."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from helpers import single_thread
from openai_client import WEATHER
from server_support import FIXED_DRAFT, GatedEngine, LiveServer, metric_value, reference, tiny_pipeline, wait_ready
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.server import create_app

PLAIN = SpeculativeConfig(method="none")

# ----- a client leaving while its speculative step is in flight -----


MODEL = "tiny-target"


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


def _complete(client, prompt: str, method: str, max_tokens: int = 30) -> str:
    return (
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"speculative": {"method": method, "schedule": "constant"}},
        )
        .choices[0]
        .text
    )


def _plain(reference, prompt: str, max_tokens: int = 30) -> str:
    return reference.engine.generate(reference.encode(prompt), SamplingParams(max_tokens=max_tokens), PLAIN).text


def test_a_client_leaving_during_its_draft_pass_leaves_the_others_and_the_next_request_exact(reference):
    pipeline = tiny_pipeline()
    engine = pipeline.engine = GatedEngine(pipeline.engine)
    with LiveServer(create_app(pipeline, max_num_seqs=4, max_tokens_cap=200, default_spec=FIXED_DRAFT)) as server:
        wait_ready(server.url)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        others = [("hello", "draft"), ("世界", "ngram"), ("hi hi", "draft")]
        host, port = server.url.removeprefix("http://").split(":")
        body = (
            b'{"model": "tiny-target", "prompt": "hi", "max_tokens": 150, "temperature": 0, "stream": true,'
            b' "speculative": {"method": "draft", "schedule": "constant", "num_speculative_tokens": 5}}'
        )
        with ThreadPoolExecutor(len(others)) as pool:
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(
                    f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                _wait_until(lambda: metric_value(server.url, "verispec_num_requests_running") == 1)  # its pass is held
                futures = [pool.submit(_complete, client, prompt, method) for prompt, method in others]
                _wait_until(lambda: metric_value(server.url, "verispec_num_requests_waiting") == len(others))
                engine.permits.release(1)  # its prefill pass: a first chunk; the others join the next pass
                received = b""
                while b"data: " not in received:
                    received += sock.recv(4096)
                # the next pass (the leaving client's draft verified beside the others) is held now
                _wait_until(lambda: metric_value(server.url, "verispec_num_requests_running") == 1 + len(others))
            engine.permits.release(100_000)  # the client is gone while its speculative step was in flight
            texts = [f.result() for f in futures]
        assert texts == [_plain(reference, prompt) for prompt, _ in others]
        _wait_until(lambda: metric_value(server.url, "verispec_num_requests_running") == 0)  # the worker dropped it
        # a following request (on the slot the leaving client freed) succeeds and equals plain
        assert _complete(client, "hi", "draft", max_tokens=60) == _plain(reference, "hi", max_tokens=60)
        scheduler = server.app.state.verispec.worker.scheduler
        _wait_until(lambda: not scheduler.running and not scheduler.waiting)
        assert metric_value(server.url, "verispec_num_requests_running") == 0
        assert scheduler.reserved_kv_tokens == 0  # the leaving client's KV reservation was given back


# ----- streamed deltas of multi-token steps -----


def _stream_completion(client, prompt, method, **kwargs) -> tuple[list[str], str]:
    """(the streamed deltas, the text of the same request not streamed)."""
    deltas = [
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt=prompt,
            stream=True,
            extra_body={"speculative": {"method": method, "schedule": "constant"}},
            **kwargs,
        )
        if c.choices
    ]
    whole = (
        client.completions.create(
            model=MODEL, prompt=prompt, extra_body={"speculative": {"method": method, "schedule": "constant"}}, **kwargs
        )
        .choices[0]
        .text
    )
    return deltas, whole


@pytest.fixture(scope="module")
def wide():
    """A server over the tiny pair whose cap (200 tokens) fits a whole tool call: an openai client."""
    with LiveServer(create_app(tiny_pipeline(), max_tokens_cap=200, default_spec=FIXED_DRAFT)) as server:
        wait_ready(server.url)
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def whole_characters(deltas: list[str]) -> bool:
    """No delta holds half a UTF-8 character (U+FFFD), save the text's very end: max_tokens may cut
    the last character, as plain decoding's text does. Empty deltas (the last event) are skipped."""
    deltas = [d for d in deltas if d]
    return "\ufffd" not in "".join(deltas[:-1]) and "\ufffd" not in deltas[-1].rstrip("\ufffd")


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "none"])
def test_streamed_deltas_concatenate_to_the_whole_text_without_broken_characters(wide, reference, method):
    for prompt in ("Hello", "你好", "你"):  # "你" is 2 tokens of 3 bytes: its continuation starts mid-character
        deltas, whole = _stream_completion(wide, prompt, method, max_tokens=50, temperature=0)
        assert "".join(deltas) == whole == _plain(reference, prompt, max_tokens=50)
        assert whole_characters(deltas), deltas
        assert (
            len(deltas) > 3
            and any(ord(ch) > 0xFFFF for ch in whole)
            and any("\u4e00" <= ch <= "\u9fff" for ch in whole)
        )
    if method != "none":
        assert any(len(d.encode()) > 4 for d in deltas)  # multi-token steps: several tokens in one delta


def test_sampled_stream_and_chat_deltas_keep_whole_characters(wide):
    for seed in (1, 2, 3):  # sampled text strays (it may hold stray bytes: the same ones in both)
        deltas, whole = _stream_completion(wide, "你", "draft", max_tokens=40, temperature=0.8, seed=seed)
        assert "".join(deltas) == whole and "".join(deltas).count("\ufffd") == whole.count("\ufffd")
    spec = {"speculative": {"method": "draft", "schedule": "constant"}}
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "你好"}], max_tokens=40, temperature=0, extra_body=spec
    )
    streamed = [
        c.choices[0].delta.content or "" for c in wide.chat.completions.create(stream=True, **kwargs) if c.choices
    ]
    assert "".join(streamed) == wide.chat.completions.create(**kwargs).choices[0].message.content
    assert whole_characters(streamed)


def test_streamed_tool_call_arguments_equal_the_whole_response(wide):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
        temperature=0,
        extra_body={"speculative": {"method": "draft", "schedule": "constant"}},
    )
    whole = wide.chat.completions.create(**kwargs).choices[0].message.tool_calls
    streamed: dict[int, list[str]] = {}
    names = {}
    for chunk in wide.chat.completions.create(stream=True, **kwargs):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed.setdefault(call.index, []).append(call.function.arguments or "")
            names[call.index] = call.function.name or names.get(call.index)
    assert len(whole) == len(streamed) == 1
    assert "".join(streamed[0]) == whole[0].function.arguments and names[0] == whole[0].function.name == "get_weather"
    assert set(json.loads(whole[0].function.arguments)) == {"city", "unit"}


# ----- a speculation the server cannot run -----


@pytest.mark.parametrize(
    "speculative, message",
    [
        ({"method": "eagle"}, "needs its drafter loaded"),  # the tiny pair has no EAGLE head
        ({"method": "draft", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft", "num_speculative_tokens": 65}, "num_speculative_tokens"),
        ({"method": "medusa"}, "method"),
    ],
)
def test_the_server_refuses_a_speculation_it_cannot_run(wide, speculative, message):
    with pytest.raises(openai.BadRequestError, match=message):
        wide.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"speculative": speculative})
