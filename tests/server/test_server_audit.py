"""`serve --audit-rate`: delivered responses re-decoded plainly in the worker's idle time, the
agreements counted in ``/metrics`` and ``/health``; a waiting request goes before any audit."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_support import GatedEngine, LiveServer, metric_value, served, tiny_pipeline, wait_ready
from verispec.errors import InvalidParameterError
from verispec.server import create_app

MODEL = "tiny-target"
CHAT = [{"role": "user", "content": "你好"}]


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


def _audit(url: str) -> dict:
    return httpx.get(f"{url}/health").json()["audit"]


def _audits(url: str, result: str) -> float:
    return metric_value(url, "verispec_audits_total", result=result)


def test_rate_one_audits_every_response_and_greedy_agrees():
    with LiveServer(create_app(tiny_pipeline(), audit_rate=1.0)) as server:
        wait_ready(server.url)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        greedy = dict(max_tokens=20, temperature=0)
        client.completions.create(model=MODEL, prompt="hi", **greedy)
        list(client.completions.create(model=MODEL, prompt="hi", stream=True, **greedy))
        client.chat.completions.create(model=MODEL, messages=CHAT, **greedy)
        list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **greedy))
        client.completions.create(model=MODEL, prompt="hi", max_tokens=16, temperature=0.8, seed=3)
        _wait_until(lambda: _audit(server.url)["audited"] == 5)  # the worker went idle and audited

        assert [_audits(server.url, r) for r in ("agree", "disagree", "sampled", "failed")] == [4, 0, 1, 0]
        for name in ("requests", "selected"):
            assert metric_value(server.url, f"verispec_audit_{name}_total") == 5
        assert metric_value(server.url, "verispec_audit_dropped_total") == 0
        assert metric_value(server.url, "verispec_audits_pending") == 0
        for decoding in ("speculative", "plain"):  # the sampled request's tokens, scored by the target
            assert metric_value(server.url, "verispec_audit_logprob_tokens_total", decoding=decoding) > 0
            assert metric_value(server.url, "verispec_audit_logprob_sum", decoding=decoding) < 0
        audit = _audit(server.url)
        assert (audit["rate"], audit["pending"], audit["agreed"], audit["disagreed"]) == (1.0, 0, 4, 0)
        assert (audit["agreement_rate"], audit["disagreements"]) == (1.0, [])


def test_rate_zero_audits_nothing(served):
    before = metric_value(served.url, "verispec_audit_requests_total")
    httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=60)
    _wait_until(lambda: metric_value(served.url, "verispec_audit_requests_total") == before + 1)
    assert metric_value(served.url, "verispec_audit_selected_total") == 0
    assert sum(_audits(served.url, r) for r in ("agree", "disagree", "sampled", "failed")) == 0
    assert _audit(served.url)["rate"] == 0.0


def test_a_waiting_request_is_served_before_a_queued_audit():
    pipeline = tiny_pipeline()
    engine = pipeline.engine = GatedEngine(pipeline.engine)
    with LiveServer(create_app(pipeline, audit_rate=1.0, max_queue=1, max_num_seqs=1)) as server:
        wait_ready(server.url)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        ask = lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0)  # noqa: E731
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(ask)
            assert engine.entered.wait(10)  # the first request is in the engine
            second = pool.submit(ask)
            _wait_until(lambda: metric_value(server.url, "verispec_num_requests_waiting") == 1)
            engine.permits.release(10_000)  # the first finishes and queues its audit; the second waits
            first.result(), second.result()
        _wait_until(lambda: _audit(server.url)["audited"] == 2)
        # warm-up, both requests, then both audits: the first's audit did not jump the waiting request
        assert engine.calls == ["generate", "stream", "stream", "generate", "generate"]
        assert _audits(server.url, "agree") == 2


def test_bad_rate_is_refused():
    with pytest.raises(InvalidParameterError, match="audit rate"):
        create_app(tiny_pipeline(), audit_rate=1.5)


@pytest.mark.parametrize("rate", ["1.5", "-0.1", "nan"])
def test_serve_command_bad_audit_rate_exits_2(rate):
    from typer.testing import CliRunner

    from verispec import cli

    result = CliRunner().invoke(cli.app, ["serve", "--audit-rate", rate])
    assert result.exit_code == 2 and f"error: --audit-rate must be in [0, 1], got {float(rate)}" in result.output


def test_serve_command_passes_the_audit_rate(monkeypatch):
    import uvicorn
    from typer.testing import CliRunner

    from verispec import cli
    from verispec.engine.loader import SpeculativePipeline

    captured = {}
    monkeypatch.setattr(SpeculativePipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline()))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: captured.update(app=app))
    result = CliRunner().invoke(cli.app, ["serve", "--audit-rate", "0.25"])
    assert result.exit_code == 0, result.output
    assert captured["app"].state.verispec.auditor.rate == 0.25
