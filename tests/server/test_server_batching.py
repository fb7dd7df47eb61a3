"""The server batches concurrent requests into shared target passes, and every client still
gets exactly what the library generates for its request alone; a client that leaves mid-stream
changes nothing for the others. Official ``openai`` client on a loopback port."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai

from server_support import GatedEngine, LiveServer, metric_value, reference, tiny_pipeline, wait_ready
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.server import create_app

MODEL = "tiny-target"
# (prompt, max_tokens, method, stream, stop): one row per client
REQUESTS = [
    ("hi", 30, "draft", False, None),
    ("hello", 24, "none", True, None),
    ("世界", 40, "ngram", False, None),
    ("hi hi", 33, "auto", True, None),
    ("🙂", 20, "draft", False, ["界"]),
    ("abc", 28, "none", False, None),
    ("你好", 35, "draft", True, None),
    ("x", 18, "auto", False, None),
]


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


def _ask(client, prompt, max_tokens, method, stream, stop):
    kwargs = dict(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stop=stop,
        extra_body={"speculative": {"method": method}},
    )
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


def _alone(reference, prompt, max_tokens, method, stream, stop):
    params = SamplingParams(max_tokens=max_tokens, stop=tuple(stop or ()))
    return reference.engine.generate(reference.encode(prompt), params, SpeculativeConfig(method=method)).text


@contextmanager
def gated_server(**options):
    """A live server over the tiny pair whose engine runs one pass per released permit:
    yields (server, engine, openai client)."""
    pipeline = tiny_pipeline()
    engine = pipeline.engine = GatedEngine(pipeline.engine)
    with LiveServer(create_app(pipeline, max_num_seqs=4, **options)) as server:
        wait_ready(server.url)
        yield server, engine, openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_concurrent_clients_share_passes_and_get_their_alone_output(reference):
    with gated_server(max_queue=16) as (server, engine, client):
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            futures = [pool.submit(_ask, client, *r) for r in REQUESTS]
            # the first pass is held (with the requests that had arrived); the others queue behind it
            _wait_until(
                lambda: (
                    sum(metric_value(server.url, f"verispec_num_requests_{g}") for g in ("running", "waiting"))
                    == len(REQUESTS)
                )
            )
            engine.permits.release(100_000)
            texts = [f.result() for f in futures]
        assert texts == [_alone(reference, *r) for r in REQUESTS]
        passes = metric_value(server.url, "verispec_batch_size_count")
        assert metric_value(server.url, "verispec_batch_size_bucket", le="3.0") < passes  # passes of 4 requests
        assert metric_value(server.url, "verispec_batch_size_bucket", le="4.0") == passes  # never more than 4
        assert metric_value(server.url, "verispec_num_requests_running") == 0
        assert metric_value(server.url, "verispec_request_success_total", finish_reason="length") >= 7


def test_a_client_leaving_mid_stream_changes_nothing_for_the_others(reference):
    with gated_server(max_tokens_cap=200) as (server, engine, client):
        others = REQUESTS[:3]
        with ThreadPoolExecutor(len(others)) as pool:
            host, port = server.url.removeprefix("http://").split(":")
            body = b'{"model": "tiny-target", "prompt": "hi", "max_tokens": 150, "temperature": 0, "stream": true}'
            # greedy: its first token is whole text, so the first pass sends an SSE frame (a sampled
            # first token can be half a UTF-8 character, held back until the next pass)
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(
                    f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                _wait_until(lambda: metric_value(server.url, "verispec_num_requests_running") == 1)  # its pass is held
                futures = [pool.submit(_ask, client, *r) for r in others]
                _wait_until(lambda: metric_value(server.url, "verispec_num_requests_waiting") == len(others))
                engine.permits.release(1)  # the leaving client's first chunk; then the others join
                received = b""
                while b"data: " not in received:
                    received += sock.recv(4096)
            engine.permits.release(100_000)  # the server notices the close at the latest at its next write
            texts = [f.result() for f in futures]
        assert texts == [_alone(reference, *r) for r in others]
        _wait_until(lambda: metric_value(server.url, "verispec_num_requests_running") == 0)  # the worker dropped it
        assert metric_value(server.url, "verispec_requests_failed_total", reason="client_disconnected") == 1


def test_serve_command_refuses_a_kv_budget_below_one_context(monkeypatch):
    import uvicorn
    from typer.testing import CliRunner

    from verispec import cli
    from verispec.engine.loader import SpeculativePipeline

    monkeypatch.setattr(SpeculativePipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline()))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    result = CliRunner().invoke(cli.app, ["serve", "--max-kv-tokens", "10"])
    assert result.exit_code == 2 and "below one context window" in result.output
    assert CliRunner().invoke(cli.app, ["serve", "--max-num-seqs", "3"]).exit_code == 0
