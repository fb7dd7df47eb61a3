"""The server's side of the public bug classes of issue 29 (the engine's side is in
``test_bug_classes.py``): a seed honoured when the server batches the request with others, a
client that leaves while its speculative step is in flight, streamed text and tool-call deltas
under multi-token steps (multi-byte characters split across tokens included), and refusals of
misconfigurations at load and request time. Official ``openai`` client on a loopback port, the
tiny byte-level pair of ``server_support``; draft lengths fixed (``schedule: constant``).
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest

from server_support import (
    FIXED_DRAFT,
    GatedEngine,
    LiveServer,
    metric_value,
    reference,
    tiny_pipeline,
    wait_ready,
)
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.errors import InvalidParameterError
from verispec.server import create_app

MODEL = "tiny-target"
PLAIN = SpeculativeConfig(method="none")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def speculative(method: str = "draft", k: int = 5) -> dict:
    return {"speculative": {"method": method, "num_speculative_tokens": k, "schedule": "constant"}}


def library_spec(method: str = "draft", k: int = 5) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_speculative_tokens=k, schedule="constant")


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


@contextmanager
def gated_server(**options):
    """A live server over the tiny pair whose engine runs one pass per released permit."""
    pipeline = tiny_pipeline()
    engine = pipeline.engine = GatedEngine(pipeline.engine)
    with LiveServer(create_app(pipeline, max_num_seqs=4, **options)) as server:
        wait_ready(server.url)
        yield server, engine, openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def live():
    """A server with room for a forced tool call (one token per byte)."""
    with LiveServer(create_app(tiny_pipeline(), max_tokens_cap=200, default_spec=FIXED_DRAFT)) as server:
        wait_ready(server.url)
        server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        yield server


def complete(client, prompt, *, method="draft", stream=False, **kwargs):
    """The text of one completion (streamed: the deltas as a list) and its usage."""
    kwargs = {"max_tokens": 40, "temperature": 0, **kwargs}
    if not stream:
        answer = client.completions.create(model=MODEL, prompt=prompt, extra_body=speculative(method), **kwargs)
        return answer.choices[0].text, answer.usage
    deltas, usage = [], None
    for chunk in client.completions.create(
        model=MODEL,
        prompt=prompt,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=speculative(method),
        **kwargs,
    ):
        deltas += [c.text for c in chunk.choices if c.text]
        usage = chunk.usage or usage
    return deltas, usage


# ----- 2. a seed holds when the server batches the request -----


def test_a_seeded_request_batched_by_the_server_gets_its_alone_tokens(reference):
    # (prompt, temperature, seed, method): two seeded, a greedy and an unseeded request share passes
    rows = [
        ("Hello", 0.8, 7, "draft"),
        ("你好", 1.0, 8, "ngram"),
        ("世界", 0.0, None, "draft"),
        ("hi", 0.9, None, "draft"),
    ]
    with gated_server() as (server, engine, client):
        with ThreadPoolExecutor(len(rows)) as pool:
            futures = [pool.submit(complete, client, p, method=m, temperature=t, seed=s) for p, t, s, m in rows]
            _wait_until(
                lambda: sum(metric_value(server.url, f"verispec_num_requests_{g}") for g in ("running", "waiting")) == 4
            )
            engine.permits.release(100_000)
            texts = [f.result()[0] for f in futures]
        passes = metric_value(server.url, "verispec_batch_size_count")
        assert metric_value(server.url, "verispec_batch_size_bucket", le="1.0") < passes  # they shared passes
    for (prompt, temperature, seed, method), text in zip(rows[:2], texts):
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=seed)
        assert text == reference.engine.generate(reference.encode(prompt), params, library_spec(method)).text


# ----- 5. a client that leaves while its speculative step is in flight -----


def _open_stream(server, body: dict) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_a_client_leaving_mid_speculative_step_leaves_the_others_and_the_engine_whole(reference):
    others = [("世界", "draft", True), ("hi", "ngram", False), ("🙂", "tree", False)]  # (prompt, method, stream)
    with gated_server(max_tokens_cap=200) as (server, engine, client):
        scheduler = server.app.state.verispec.worker.scheduler
        with ThreadPoolExecutor(len(others)) as pool:
            body = {
                "model": MODEL,
                "prompt": "Hello",
                "max_tokens": 150,
                "temperature": 0,
                "stream": True,
                **speculative(),
            }
            sock = _open_stream(server, body)
            _wait_until(lambda: metric_value(server.url, "verispec_num_requests_running") == 1)  # its prefill is held
            engine.permits.release(1)
            received = b""
            while b"data: " not in received:  # its first token came; its first speculative pass is held now
                received += sock.recv(4096)
            futures = [pool.submit(complete, client, p, method=m, stream=s) for p, m, s in others]
            _wait_until(lambda: metric_value(server.url, "verispec_num_requests_waiting") == len(others))
            sock.close()  # gone while the pass that verifies its draft waits at the gate
            engine.permits.release(100_000)
            texts = ["".join(t) if isinstance(t, list) else t for t, _ in (f.result() for f in futures)]
        plain = SamplingParams(max_tokens=40)
        assert texts == [reference.engine.generate(reference.encode(p), plain, PLAIN).text for p, _, _ in others]
        _wait_until(lambda: metric_value(server.url, "verispec_num_requests_running") == 0)  # the worker dropped it
        assert metric_value(server.url, "verispec_requests_failed_total", reason="client_disconnected") == 1
        # the engine keeps serving: four at once take every slot, the one it left among them
        prompts = ["Hello", "你好", "abc", "é!"]
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda p: complete(client, p, max_tokens=30)[0], prompts))
        assert again == [
            reference.engine.generate(reference.encode(p), SamplingParams(max_tokens=30), PLAIN).text for p in prompts
        ]
        _wait_until(lambda: not scheduler.running and not scheduler.waiting)
        assert scheduler.reserved_kv_tokens == 0 and scheduler.num_free_seqs == scheduler.max_num_seqs  # nothing leaked
        assert metric_value(server.url, "verispec_num_requests_running") == 0


# ----- 6. streamed deltas under multi-token steps -----


def test_library_stream_never_splits_a_character_across_chunks(reference):
    tokenizer = reference.tokenizer
    for prompt in ["Hello", "你好", "🙂"]:
        ids = reference.encode(prompt)
        chunks = list(reference.engine.stream(ids, SamplingParams(max_tokens=40), library_spec()))
        output = chunks[-1].output
        committed, held_back = [], 0
        for chunk in chunks[:-1]:  # the last may end with the half character max_tokens cut
            committed += chunk.token_ids
            held_back += tokenizer.decode(committed).endswith("\ufffd")  # a step ended inside a character
            assert "\ufffd" not in chunk.text
        assert held_back > 0 and len(chunks) < len(output.token_ids)  # split characters, multi-token steps
        assert "".join(c.text for c in chunks) == tokenizer.decode(output.token_ids, skip_special_tokens=True)
        assert output.token_ids == reference.engine.generate(ids, SamplingParams(max_tokens=40), PLAIN).token_ids


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 5)])
@pytest.mark.parametrize("prompt", ["Hello", "你好", "🙂"])
def test_streamed_text_equals_the_whole_answer_and_plain_decoding(live, reference, prompt, temperature, seed):
    deltas, usage = complete(live.client, prompt, stream=True, temperature=temperature, seed=seed)
    whole, _ = complete(live.client, prompt, temperature=temperature, seed=seed)
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=seed)
    alone = reference.engine.generate(reference.encode(prompt), params, library_spec())
    # one decode of all the tokens: a delta cut inside a character would leave two U+FFFD here
    assert "".join(deltas) == whole == reference.tokenizer.decode(alone.token_ids, skip_special_tokens=True)
    assert len(deltas) < usage.completion_tokens  # steps emitted several tokens
    if temperature == 0:  # valid text, but for the half character max_tokens may cut at the end
        assert not any("\ufffd" in d for d in deltas[:-1])
        assert whole == reference.engine.generate(reference.encode(prompt), params, PLAIN).text


def test_a_stop_string_inside_an_accepted_block_streams_what_the_whole_answer_says(live, reference):
    deltas, _ = complete(live.client, "Hello", stream=True, stop=["界é"])
    whole, _ = complete(live.client, "Hello", stop=["界é"])
    plain = reference.engine.generate(reference.encode("Hello"), SamplingParams(max_tokens=40, stop=("界é",)), PLAIN)
    assert "".join(deltas) == whole == plain.text == " 你好🙂世"


def test_streamed_chat_content_equals_the_whole_message(live):
    def chat(method, stream):
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "你好"}],
            max_tokens=40,
            temperature=0,
            extra_body=speculative(method),
        )
        if not stream:
            return live.client.chat.completions.create(**kwargs).choices[0].message.content
        return "".join(
            c.choices[0].delta.content or ""
            for c in live.client.chat.completions.create(stream=True, **kwargs)
            if c.choices
        )

    assert chat("draft", True) == chat("draft", False) == chat("none", False)


def test_streamed_tool_call_arguments_equal_the_whole_answers(live):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "你好"}],
        tools=[WEATHER],
        tool_choice=choice,
        max_tokens=160,
        temperature=0,
    )
    whole = live.client.chat.completions.create(extra_body=speculative(), **kwargs).choices[0].message.tool_calls
    plain = live.client.chat.completions.create(extra_body=speculative("none"), **kwargs).choices[0].message.tool_calls
    names, arguments = {}, {}
    for chunk in live.client.chat.completions.create(stream=True, extra_body=speculative(), **kwargs):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names[call.index] = names.get(call.index, "") + (call.function.name or "")
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert names == {0: "get_weather"}
    assert arguments[0] == whole[0].function.arguments == plain[0].function.arguments
    assert json.loads(arguments[0])["city"] in ("Paris", "Oslo")


# ----- 7. misconfigurations are refused, at load or per request -----


def test_a_default_method_whose_drafter_is_not_loaded_is_refused_at_load(reference):
    from verispec.engine.loader import SpeculativePipeline

    no_draft = SpeculativePipeline(reference.target, None)
    for method in ("draft", "eagle"):
        with pytest.raises(InvalidParameterError, match=f"method '{method}' needs its drafter loaded"):
            create_app(no_draft, default_spec=SpeculativeConfig(method=method))
    assert create_app(no_draft).state.verispec.default_spec.method == "none"  # nothing asked for: plain


@pytest.mark.parametrize(
    "options, message",
    [
        ({"method": "eagle"}, "method 'eagle' needs its drafter loaded"),  # no head loaded
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in [1, 64]"),  # cannot draft at all
        ({"num_speculative_tokens": 65}, "num_speculative_tokens must be in [1, 64]"),
    ],
)
def test_a_request_asking_for_what_cannot_draft_gets_a_400(live, options, message):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "speculative": options}
    response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
