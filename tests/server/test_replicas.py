"""serve --replicas: the OpenAI app on Ray Serve replicas, each its own batched engine.

The unit tests need no Ray. The cluster test starts a local Ray cluster with 2 replicas of tiny
GGUF models and checks what a user relies on: every request answered, both replicas used, greedy
outputs equal to a single-process server's, and a killed replica's requests failing with a 503
in OpenAI's error shape (never a hang, never Ray's text 500) while the other replica keeps
serving, until Ray brings the replica back.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from gguf_models import perturbed_copy, write_gguf_model
from server_support import LiveServer, wait_ready
from verispec.cli import app
from verispec.engine.loader import SpeculativePipeline
from verispec.errors import InvalidParameterError
from verispec.runners.select import RunnerOptions
from verispec.server import ServerConfig, create_app
from verispec.server.replicas import REPLICA_HEADER, ReplicaSpec, ScalingOptions, merge_expositions

PROMPTS = ["ab!c", "#$%", "ab&'()", "*+,-./", "0123", "ab45"]


def exposition(in_flight: float, tokens: float, bucket_one: float) -> str:
    return (
        "# HELP verispec_requests_in_flight Accepted requests.\n# TYPE verispec_requests_in_flight gauge\n"
        f"verispec_requests_in_flight {in_flight}\n"
        "# HELP verispec_generation_tokens Tokens generated.\n# TYPE verispec_generation_tokens counter\n"
        f"verispec_generation_tokens_total {tokens}\n"
        "# HELP verispec_batch_size Requests per pass.\n# TYPE verispec_batch_size histogram\n"
        f'verispec_batch_size_bucket{{le="1.0"}} {bucket_one}\nverispec_batch_size_bucket{{le="+Inf"}} 5.0\n'
        "verispec_batch_size_count 5.0\nverispec_batch_size_sum 9.0\n"
    )


def samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_of_replicas_are_summed_sample_by_sample():
    merged = samples(merge_expositions([exposition(2, 100, 3), exposition(1, 50, 4)]))
    assert merged[("verispec_replicas", ())] == 2
    assert merged[("verispec_requests_in_flight", ())] == 3
    assert merged[("verispec_generation_tokens_total", ())] == 150
    assert merged[("verispec_batch_size_bucket", (("le", "1.0"),))] == 7
    assert merged[("verispec_batch_size_bucket", (("le", "+Inf"),))] == 10
    assert merged[("verispec_batch_size_sum", ())] == 18


def test_scaling_options_pass_through_to_ray_serve():
    fixed = ScalingOptions(num_replicas=3, num_cpus=0.5).deployment_options()
    assert (
        fixed["num_replicas"] == 3
        and fixed["ray_actor_options"] == {"num_cpus": 0.5}
        and "autoscaling_config" not in fixed
    )
    auto = ScalingOptions(
        num_replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=6
    ).deployment_options()
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 2,
        "target_ongoing_requests": 6,
    }


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_replicas=0), "--replicas must be >= 1"),
        (dict(min_replicas=3, max_replicas=2), "min-replicas"),
        (dict(max_replicas=0), "max replicas"),
        (dict(target_ongoing_requests=4), "give --min-replicas / --max-replicas"),
        (dict(max_replicas=2, target_ongoing_requests=0), "target-ongoing-requests must be > 0"),
        (dict(num_cpus=0), "replica-cpus"),
    ],
)
def test_impossible_scaling_is_a_clear_error(options, message):
    with pytest.raises(InvalidParameterError, match=message):
        ScalingOptions(**options)


def test_a_suffix_cache_file_cannot_be_shared_by_replicas():
    with pytest.raises(InvalidParameterError, match="suffix-cache"):
        ReplicaSpec("t.gguf", config=ServerConfig(suffix_cache="cache.npz"))
    with pytest.raises(InvalidParameterError, match="prefix-cache-file"):
        ReplicaSpec("t.gguf", config=ServerConfig(prefix_cache_file="prefix.cache"))
    assert ReplicaSpec("t.gguf", prefix_cache_gib=0.5).prefix_cache_gib == 0.5  # each replica's own cache


def test_an_engine_that_keeps_failing_or_hangs_reports_itself_unhealthy():
    import asyncio

    from server_support import tiny_pipeline
    from verispec.algorithms.sampling import SamplingParams
    from verispec.engine.request import SpeculativeConfig
    from verispec.server.prom import ServerMetrics
    from verispec.server.worker import MAX_CONSECUTIVE_ERRORS, EngineWorker, Job

    pipe = tiny_pipeline()
    worker = EngineWorker(
        pipe.engine,
        max_queue=8,
        metrics=ServerMetrics(),
        warmup_prompt_token_ids=pipe.encode("Hello"),
        warmup_spec=SpeculativeConfig(method="none"),
    )
    assert worker.health_problem() is None  # not started yet: nothing wrong
    worker.start()
    try:
        assert worker.ready.wait(30) and worker.health_problem() is None
        worker.scheduler.step = lambda: (_ for _ in ()).throw(RuntimeError("broken pass"))
        loop = asyncio.new_event_loop()
        for i in range(MAX_CONSECUTIVE_ERRORS):  # one request at a time: each pass fails
            worker.submit(
                Job(pipe.encode("Hello"), SamplingParams(max_tokens=4), SpeculativeConfig(method="none"), loop)
            )
            deadline = time.monotonic() + 10
            while worker.consecutive_errors <= i and time.monotonic() < deadline:
                time.sleep(0.01)
        assert "passes failed" in (worker.health_problem() or "")
    finally:
        worker.stop()
    assert "passes failed" in (worker.health_problem() or "")  # still broken after it stopped
    hung = EngineWorker(
        pipe.engine,
        max_queue=8,
        metrics=ServerMetrics(),
        warmup_prompt_token_ids=pipe.encode("Hello"),
        warmup_spec=SpeculativeConfig(method="none"),
    )
    hung.ready.set()  # as if warmed up, its thread then stuck in one pass while a request waits
    hung.submit(Job(pipe.encode("Hello"), SamplingParams(max_tokens=4), SpeculativeConfig(method="none"), loop))
    assert hung.health_problem(stall_s=500) is None
    hung.last_turn_end -= 1000
    assert "no engine turn ended in 500 s" in (hung.health_problem(stall_s=500) or "")


def test_replicas_without_ray_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    result = CliRunner().invoke(app, ["serve", "--replicas", "2"])
    assert result.exit_code == 2
    assert "pip install 'verispec[ray]'" in result.output.replace("\n", "")


def test_replica_options_are_checked_before_anything_loads(monkeypatch):
    pytest.importorskip("ray")
    result = CliRunner().invoke(app, ["serve", "--replicas", "2", "--min-replicas", "3", "--max-replicas", "1"])
    assert result.exit_code == 2 and "min-replicas" in result.output
    result = CliRunner().invoke(app, ["serve", "--replicas", "2", "--target", "/nonexistent/model.gguf"])
    assert result.exit_code == 2 and "not found" in result.output


# --- a local Ray cluster ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("replicas")
    target = write_gguf_model(directory / "target.gguf")
    return {"target": target, "draft": perturbed_copy(target, directory / "draft.gguf", "output.weight", 0.3)}


@pytest.fixture(scope="module")
def cluster(files):
    ray = pytest.importorskip("ray")
    from ray import serve

    from verispec.server.replicas import run_replicas

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 * 2**20,
        logging_level="ERROR",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}},
    )
    port = free_port()
    spec = ReplicaSpec(
        str(files["target"]),
        str(files["draft"]),
        runner="gguf",
        config=ServerConfig(max_num_seqs=4, max_tokens_cap=256, max_queue=512),
    )
    try:
        run_replicas(
            spec,
            ScalingOptions(num_replicas=2, num_cpus=0.5, max_ongoing_requests=32),
            host="127.0.0.1",
            port=port,
            blocking=False,
        )
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout_s=120)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def ask(url: str, prompt: str, max_tokens: int = 24, **extra):
    """One greedy completion with the official client: (status, text or error, replica id)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        raw = client.completions.with_raw_response.create(
            model="target.gguf", prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
        )
    except openai.APIStatusError as exc:
        return exc.status_code, str(exc), None
    except openai.APIConnectionError as exc:  # the connection cut: reported, never a hang
        return 599, str(exc), None
    return raw.status_code, raw.parse().choices[0].text, raw.headers.get(REPLICA_HEADER)


@pytest.fixture(scope="module")
def single_process_texts(files):
    pipe = SpeculativePipeline.load(str(files["target"]), str(files["draft"]), runners=RunnerOptions(kind="gguf"))
    with LiveServer(create_app(pipe, ServerConfig(max_num_seqs=4))) as server:
        wait_ready(server.url)
        answers = {prompt: ask(server.url, prompt) for prompt in PROMPTS}
    assert all(status == 200 for status, _, _ in answers.values()), answers
    return {prompt: text for prompt, (_, text, _) in answers.items()}


def replica_ids(url: str, tries: int = 24) -> set[str]:
    return {ask(url, PROMPTS[i % len(PROMPTS)], max_tokens=2)[2] for i in range(tries)}


def test_two_replicas_share_the_load_and_answer_as_one_process(cluster, single_process_texts):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(20)]
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda p: ask(cluster, p), prompts))
    assert [status for status, _, _ in results] == [200] * 20
    assert len({replica for _, _, replica in results}) == 2  # Ray's router used both replicas
    for prompt, (_, text, _) in zip(prompts, results):
        assert text == single_process_texts[prompt]  # greedy: the same tokens as one process
    metrics = samples(httpx.get(cluster + "/metrics", timeout=30).text)
    assert metrics[("verispec_replicas", ())] == 2
    answered = sum(v for (name, _), v in metrics.items() if name == "verispec_request_success_total")
    assert answered >= 20  # both replicas' counters, summed


def test_a_killed_replica_fails_its_requests_and_comes_back(cluster):
    import ray

    before = replica_ids(cluster)
    assert len(before) == 2
    victim = sorted(before)[0]
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("#" + victim)]
    assert len(names) == 1
    results: list = []

    def load():
        with ThreadPoolExecutor(20) as pool:
            # 8 choices of 200 tokens each: every replica is busy for seconds
            results.extend(pool.map(lambda i: ask(cluster, PROMPTS[i % len(PROMPTS)], max_tokens=200, n=8), range(20)))

    thread = threading.Thread(target=load)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # kill once the requests are in the replicas (summed over both)
        in_flight = samples(httpx.get(cluster + "/metrics", timeout=30).text).get(
            ("verispec_requests_in_flight", ()), 0
        )
        if in_flight >= 16:
            break
        time.sleep(0.05)
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    thread.join(timeout=120)
    assert not thread.is_alive(), "requests hung after a replica died"
    statuses = [status for status, _, _ in results]
    assert len(statuses) == 20 and all(s in (200, 503) for s in statuses), results  # Ray's proxy runs FaultLayer
    assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
    assert all("replica serving this request is unavailable" in text for status, text, _ in results if status == 503), (
        results
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Ray starts a replacement; both answer again
        ids = replica_ids(cluster, tries=12)
        if len(ids - {None}) == 2 and victim not in ids:
            break
        time.sleep(2)
    assert len(ids - {None}) == 2 and victim not in ids, ids


def test_a_client_that_left_a_replica_is_a_disconnect_not_a_server_fault():
    """Ray Serve's receive() raises TaskCancelledError when its proxy cancels a request whose
    client hung up; a streaming response listening for the disconnect took it for its own fault
    (a traceback and a 500 counted as internal_error per hang-up in the replica soak)."""
    import asyncio

    pytest.importorskip("ray")
    from ray.exceptions import TaskCancelledError
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from verispec.server.replicas import ReplicaHeader

    async def forever():
        while True:
            yield b"data: x\n\n"
            await asyncio.sleep(0.01)

    async def stream(request):
        return StreamingResponse(forever(), media_type="text/event-stream")

    app = ReplicaHeader(Starlette(routes=[Route("/s", stream, methods=["POST"])]), replica_id="r1")
    calls, sent = [], []

    async def receive():
        calls.append(1)
        if len(calls) == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(0.05)
        raise TaskCancelledError()  # what Ray's proxy makes of a client that left

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/s",
        "headers": [],
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
        "http_version": "1.1",
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))  # ends, raising nothing
    start = sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"x-verispec-replica", b"r1") in start["headers"]
    assert any(m.get("body") for m in sent[1:])  # it streamed until the client left


@pytest.mark.parametrize("waits", [True, False])
def test_a_replica_starts_serving_only_after_its_warm_up(monkeypatch, waits):
    """Ray routes requests to a replica once its app's startup ends: a restarted replica must not
    take them before its engine warmed up (it answered 503 not_ready in the replica soak)."""
    from fastapi.testclient import TestClient

    from server_support import tiny_pipeline
    from verispec.server import create_app
    from verispec.server.replicas import startup_waits_for_warm_up
    from verispec.server.worker import EngineWorker

    warm_up = EngineWorker._warm_up

    def slow_warm_up(self):
        time.sleep(0.5)
        warm_up(self)

    monkeypatch.setattr(EngineWorker, "_warm_up", slow_warm_up)
    app = create_app(tiny_pipeline())
    if waits:
        app = startup_waits_for_warm_up(app)
    with TestClient(app) as client:  # the lifespan's startup has ended here
        status = client.get("/health").status_code
    assert status == (200 if waits else 503)
