"""Faults answer in OpenAI's shape: a stream cut by a fault ends with an error event then [DONE],
a failed request gets OpenAI's error JSON with its status (503 + Retry-After when the engine or
a replica is unavailable), and every request that died is counted in /metrics by reason. Ray's
proxy layer (:class:`verispec.server.faults.FaultLayer`) is tested alone, over fake apps that
fail as Ray's proxy does when a replica dies (no cluster)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_support import LiveServer, metric_value, tiny_pipeline, wait_ready
from verispec.server import create_app
from verispec.server.faults import PROXY_CALLBACK, PROXY_CALLBACK_ENV, FaultLayer, proxy_middlewares
from verispec.server.prom import FAILURE_REASONS

MODEL = "tiny-target"
C, CHAT = "/v1/completions", "/v1/chat/completions"
BODIES = {
    C: {"model": MODEL, "prompt": "hi", "max_tokens": 120, "temperature": 0},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "temperature": 0},
}


def failed(url: str, reason: str) -> float:
    return metric_value(url, "verispec_requests_failed_total", reason=reason)


def events(text: str) -> list:
    """The data of each Server-Sent Event: parsed JSON, or the string ``[DONE]``."""
    found = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            found.append(data if data == "[DONE]" else json.loads(data))
    return found


@pytest.fixture
def server():
    """A fresh single-process server (its counters start at zero) over the tiny pair."""
    with LiveServer(create_app(tiny_pipeline(), max_num_seqs=1)) as live:
        wait_ready(live.url)
        live.worker = live.app.state.verispec.worker
        yield live


def fail_after(monkeypatch, worker, good_passes: int, pause_s: float = 0.0) -> None:
    """From now on the worker's passes raise after ``good_passes`` good ones (each ``pause_s`` long)."""
    step, count = worker.scheduler.step, [0]

    def faulty():
        count[0] += 1
        if count[0] > good_passes:
            raise RuntimeError("injected fault")
        time.sleep(pause_s)
        return step()

    monkeypatch.setattr(worker.scheduler, "step", faulty)


# ----- the single-process app -----


def test_every_reason_is_exported_from_zero(server):
    assert all(failed(server.url, reason) == 0 for reason in FAILURE_REASONS)


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_stream_cut_by_a_worker_fault_ends_with_an_error_event_then_done(server, monkeypatch, path):
    fail_after(monkeypatch, server.worker, good_passes=3)
    response = httpx.post(server.url + path, json={**BODIES[path], "stream": True}, timeout=60)
    assert response.status_code == 200  # the stream had started
    sent = events(response.text)
    assert sent[-1] == "[DONE]"
    error = sent[-2]["error"]
    assert error["type"] == "server_error" and error["code"] == "server_error" and "error id" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    texts = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") for c in sent[:-2]]
    assert any(texts)  # tokens came before the fault
    assert failed(server.url, "worker_error") == 1
    monkeypatch.undo()
    assert httpx.post(server.url + path, json={**BODIES[path], "max_tokens": 4}).status_code == 200  # still serving


def test_a_stream_whose_shaping_raises_ends_with_an_error_event(server, monkeypatch):
    from verispec.server.responses import ChoiceView

    def broken(self, *args, **kwargs):
        raise ValueError("a bug in the stream")

    monkeypatch.setattr(ChoiceView, "logprobs", broken)
    response = httpx.post(server.url + CHAT, json={**BODIES[CHAT], "stream": True}, timeout=60)
    sent = events(response.text)
    assert sent[-1] == "[DONE]" and sent[-2]["error"]["type"] == "server_error"
    assert failed(server.url, "internal_error") == 1


def test_a_request_that_dies_gets_openai_error_json_and_is_counted(server, monkeypatch):
    fail_after(monkeypatch, server.worker, good_passes=1)
    response = httpx.post(server.url + C, json=BODIES[C], timeout=60)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error" and "error id" in response.json()["error"]["message"]
    assert failed(server.url, "worker_error") == 1
    assert metric_value(server.url, "verispec_http_errors_total", status="500") == 1


def test_an_engine_that_cannot_serve_answers_503_with_retry_after(server, monkeypatch):
    monkeypatch.setattr(server.worker, "stopped_problem", lambda *a: "the engine thread ended")
    for stream in (False, True):
        response = httpx.post(server.url + C, json={**BODIES[C], "stream": stream}, timeout=60)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "engine_unavailable"
        assert "the engine thread ended" in response.json()["error"]["message"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json() == {
        "status": "unavailable",
        "problem": "the engine thread ended",
    }
    assert failed(server.url, "engine_unavailable") == 2


def test_a_replica_whose_passes_keep_failing_answers_503():
    pipeline = tiny_pipeline()
    with LiveServer(create_app(pipeline, unhealthy_is_unavailable=True)) as live:
        wait_ready(live.url)
        assert httpx.post(live.url + C, json={**BODIES[C], "max_tokens": 2}).status_code == 200
        live.app.state.verispec.worker.consecutive_errors = 3  # what Ray's health check sees too
        response = httpx.post(live.url + C, json=BODIES[C])
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert "passes failed" in response.json()["error"]["message"]


def _send_and_drop(url: str, body: dict, read_until: bytes | None) -> None:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST {C} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        sock.sendall(head.encode() + data)
        received = b""
        while read_until is not None and read_until not in received:
            received += sock.recv(4096)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_is_counted(server, monkeypatch, stream):
    fail_after(monkeypatch, server.worker, good_passes=10_000, pause_s=0.05)  # slow passes, no fault
    _send_and_drop(server.url, {**BODIES[C], "max_tokens": 200, "stream": stream}, b"data: " if stream else None)
    deadline = time.monotonic() + 20
    while failed(server.url, "client_disconnected") < 1:
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.05)
    assert failed(server.url, "client_disconnected") == 1


# ----- Ray Serve's proxy layer, alone -----


def ray_error() -> Exception:
    ray_exceptions = pytest.importorskip("ray.exceptions")
    return ray_exceptions.ActorDiedError()  # what Ray raises for a request whose replica died


def sse_app(frames: list[bytes], then: Exception | None):
    """A downstream app that starts a stream, sends ``frames``, then raises ``then`` or returns
    leaving the body open (what Ray's proxy does when the replica dies mid-stream)."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for frame in frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        if then is not None:
            raise then

    return app


async def call(layer: FaultLayer, method: str = "POST", path: str = C) -> httpx.Response:
    transport = httpx.ASGITransport(app=layer)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        return await client.request(method, path, json=BODIES[C] if method == "POST" else None)


def layer_failed(layer: FaultLayer, reason: str) -> float:
    return layer.failed.labels(reason=reason)._value.get()


@pytest.mark.parametrize("downstream", ["raises", "answers nothing", "ray text 500", "ray text 503"])
def test_a_dead_replica_answers_503_openai_json_and_retry_after(downstream):
    error = ray_error()

    async def app(scope, receive, send):
        if downstream == "raises":
            raise error
        if downstream.startswith("ray text"):
            status = int(downstream.split()[-1])
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"Internal Server Error"})

    layer = FaultLayer(app)
    response = asyncio.run(call(layer))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "replica_unavailable"
    assert layer_failed(layer, "replica_unavailable") == 1


@pytest.mark.parametrize("then", ["raises", "returns"])
def test_a_stream_cut_by_a_dead_replica_ends_with_an_error_event_then_done(then):
    frames = [b'data: {"choices": [{"text": "Hel"}]}\n\n', b'data: {"choices": [{"text": "lo"}]}\n\n']
    layer = FaultLayer(sse_app(frames, ray_error() if then == "raises" else None))
    response = asyncio.run(call(layer))
    sent = events(response.text)
    assert sent[:2] == [{"choices": [{"text": "Hel"}]}, {"choices": [{"text": "lo"}]}]
    assert sent[2]["error"]["code"] == "replica_unavailable" and sent[3] == "[DONE]" and len(sent) == 4
    assert layer_failed(layer, "replica_unavailable") == 1


def test_answers_that_need_no_mending_pass_untouched():
    complete = FaultLayer(sse_app([b'data: {"x": 1}\n\n', b"data: [DONE]\n\n"], None))
    assert events(asyncio.run(call(complete)).text) == [{"x": 1}, "[DONE]"]

    async def app_error(scope, receive, send):  # the app's own OpenAI error
        body = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}})
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})

    layer = FaultLayer(app_error)
    response = asyncio.run(call(layer))
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert all(layer_failed(layer, reason) == 0 for reason in FAILURE_REASONS) and not layer_failed(complete, "timeout")


@pytest.mark.parametrize("status, reason, retry", [(408, "timeout", None), (429, "overloaded", "1")])
def test_ray_timeouts_and_back_pressure_become_openai_errors(status, reason, retry):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"Request abc timed out after 5s."})

    layer = FaultLayer(app)
    response = asyncio.run(call(layer))
    assert response.status_code == status and response.json()["error"]["code"] == reason
    assert response.headers.get("retry-after") == retry
    assert layer_failed(layer, reason) == 1


def test_metrics_through_the_proxy_add_its_counts():
    from verispec.server.prom import ServerMetrics

    replica = ServerMetrics()
    replica.failed.labels(reason="replica_unavailable").inc(2)
    replica.failed.labels(reason="worker_error").inc()
    replica_text = replica.exposition()[0].decode()
    dead = [True]

    async def app(scope, receive, send):
        if scope["path"] == "/metrics":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(replica_text)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": replica_text.encode()})
        elif not dead[0]:
            raise AssertionError("unreachable")

    layer = FaultLayer(app)
    assert asyncio.run(call(layer)).status_code == 503
    text = asyncio.run(call(layer, "GET", "/metrics")).text
    values = {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "verispec_requests_failed_total"
    }
    assert values["replica_unavailable"] == 3 and values["worker_error"] == 1 and values["timeout"] == 0


def test_ray_proxies_are_told_to_run_the_layer(monkeypatch):
    from starlette.middleware import Middleware

    from verispec.server import replicas

    [middleware] = proxy_middlewares()
    assert isinstance(middleware, Middleware) and middleware.cls is FaultLayer
    started: dict = {}

    class Stop(Exception):
        pass

    class FakeRay:
        is_initialized = staticmethod(lambda: True)
        cluster_resources = staticmethod(lambda: {"CPU": 64.0})

    class FakeServe:
        @staticmethod
        def start(**options):
            started.update(options)
            raise Stop

    monkeypatch.setattr(replicas, "import_serve", lambda: (FakeRay, FakeServe))
    with pytest.raises(Stop):
        replicas.run_replicas(replicas.ReplicaSpec("target"), replicas.ScalingOptions(), blocking=False)
    assert started["controller_options"]["runtime_env"]["env_vars"] == {PROXY_CALLBACK_ENV: PROXY_CALLBACK}


def test_the_proxy_layer_loads_without_the_engine():
    code = "import sys, verispec.server.faults as f; f.proxy_middlewares(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # Ray's proxies stay small
