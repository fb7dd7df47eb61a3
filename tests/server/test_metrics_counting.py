"""Each request is counted once, by one rule (issue 44, item 11): a disconnect is a failure, not
also a finished request; accepted tokens are tokens of the completion; exact bounds and named
params in errors; SIGINT exits 130."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_support import (
    CONTEXT_LENGTH,
    _loaded,
    bigram_qwen2,
    build_tokenizer,
    gated,
    metric_value,
    successor_table,
    tiny_pipeline,
)
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import SpeculativePipeline

C = "/v1/completions"
OK = {"model": "tiny-target", "prompt": "hi", "max_tokens": 2, "temperature": 0}


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_is_counted_once_as_failed(gated, stream):
    engine = gated.engine
    engine.permits.release(1)  # its first pass only
    body = json.dumps({**OK, "max_tokens": 150, "stream": stream}).encode()
    host, port = gated.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST {C} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        received = b""
        while stream and b"data: " not in received:
            received += sock.recv(4096)
        engine.entered.wait(10)
    _wait_until(lambda: metric_value(gated.url, "verispec_requests_in_flight") == 0)
    engine.permits.release(10_000)
    _wait_until(lambda: metric_value(gated.url, "verispec_num_requests_running") == 0)  # the worker dropped it
    text = httpx.get(gated.url + "/metrics").text
    assert metric_value(gated.url, "verispec_requests_failed_total", reason="client_disconnected") == 1
    answered = [line for line in text.splitlines() if line.startswith("verispec_request_success_total{")]
    assert answered and all(line.endswith(" 0.0") for line in answered), answered  # not also a finished request
    assert 'finish_reason="abort"' not in text and 'finish_reason="error"' not in text


def test_a_server_fault_is_counted_once_as_failed(gated):
    gated.engine.permits.release(10_000)
    gated.engine.fail = True
    assert httpx.post(gated.url + C, json=OK).status_code == 500
    assert metric_value(gated.url, "verispec_requests_failed_total", reason="worker_error") == 1
    text = httpx.get(gated.url + "/metrics").text
    assert all(
        line.endswith(" 0.0") for line in text.splitlines() if line.startswith("verispec_request_success_total{")
    )


def test_accepted_tokens_are_tokens_of_the_completion():
    # the draft is the target itself: every drafted token is accepted, and a stop string ends the
    # completion inside an accepted draft; the tokens drafted past it are not completion tokens
    tokenizer = build_tokenizer()
    model = bigram_qwen2(tokenizer, successor_table(tokenizer), seed=0)
    pipe = SpeculativePipeline(_loaded("t", model, tokenizer), _loaded("d", model, tokenizer))
    spec = SpeculativeConfig(method="draft", schedule="constant", num_speculative_tokens=8)
    out = pipe.generate("Hello", SamplingParams(max_tokens=40, stop=("世",)), spec)
    assert out.finish_reason == "stop" and out.metrics.spec.num_draft_tokens > 0
    drafted_tokens = sum(
        source == "draft" for source in out.token_sources
    )  # the completion's tokens that came from drafts
    assert out.metrics.spec.num_accepted_tokens == drafted_tokens
    assert out.metrics.spec.num_accepted_tokens < out.metrics.output_tokens  # the first token is the target's
    assert CONTEXT_LENGTH > 40


def test_the_seed_limit_is_printed_as_the_exact_integer(gated):
    response = httpx.post(gated.url + C, json={**OK, "seed": 2**64})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (
        error["param"] == "seed"
        and error["message"] == "seed: Input should be less than or equal to 18446744073709551615"
    )


def test_a_method_whose_drafter_is_not_loaded_names_its_param(gated):
    gated.engine.permits.release(10_000)
    response = httpx.post(gated.url + C, json={**OK, "speculative": {"method": "eagle"}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "speculative.method" and "needs its drafter loaded" in error["message"]


@pytest.mark.parametrize("command", ["serve"])  # generate: typer already maps KeyboardInterrupt to 130
def test_sigint_exits_130(tmp_path, command):
    from gguf_models import write_gguf_model

    target = write_gguf_model(tmp_path / "t.gguf")
    args = ["--target", str(target), "--draft", "none", "--runner", "gguf", "--method", "none"]
    if command == "generate":
        args = ["abc", *args, "--max-tokens", "400", "--max-context", "512"]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args += ["--port", str(s.getsockname()[1])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "verispec"), command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        marker = b"Uvicorn running" if command == "serve" else b"loaded target"
        seen = b""
        deadline = time.monotonic() + 120
        while marker not in seen and time.monotonic() < deadline and process.poll() is None:
            seen += process.stdout.read1(4096)
        assert marker in seen, seen.decode(errors="replace")
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_usage_of_several_choices_queue_is_the_longest_wait_and_ttft_the_mean():
    from verispec.metrics import RequestMetrics, SpecDecodeStats
    from verispec.server.protocol import usage

    def metrics(ttft_ms, output_tokens, accepted):
        spec = SpecDecodeStats(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=accepted)
        return RequestMetrics(
            prompt_tokens=5,
            output_tokens=output_tokens,
            ttft_ms=ttft_ms,
            tpot_ms=10.0,
            decode_tokens_per_s=100.0,
            total_tokens_per_s=50.0,
            e2e_ms=100.0,
            draft_ms=1.0,
            target_ms=2.0,
            num_target_forwards=3,
            spec=spec,
        )

    # two choices of one prompt, waiting 0.25 s and 0.5 s for the engine
    got = usage([(0, metrics(40.0, 7, 4), 0.25), (0, metrics(60.0, 9, 6), 0.5)])
    assert got.queue_ms == 500.0  # the longest wait, not the sum or the mean
    assert got.ttft_ms == 50.0 and got.prompt_tokens == 5 and got.completion_tokens == 16
    assert (got.num_draft_tokens, got.num_accepted_tokens, got.acceptance_rate) == (16, 10, 10 / 16)
