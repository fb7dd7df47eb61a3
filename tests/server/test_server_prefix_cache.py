"""The prefix cache through the server (issue 53): ``usage.prompt_tokens_details.cached_tokens``
(streamed too), the Prometheus figures, the same text with the cache on and off, and the file a
server saves at shutdown and reads at start (``--prefix-cache-file``) with its refusals.
"""

import json
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gguf_models import write_gguf_model
from verispec.engine.loader import SpeculativePipeline
from verispec.engine.prefix_cache import PrefixCache
from verispec.runners.select import RunnerOptions
from verispec.server import create_app

PROMPT = "abcdefghij" * 8 + "!!"  # ~80 tokens of the tiny byte-level vocabulary: several 16-token blocks
GREEDY = {"max_tokens": 12, "temperature": 0, "speculative": {"method": "none"}}


@pytest.fixture(scope="module")
def target_file(tmp_path_factory):
    return write_gguf_model(tmp_path_factory.mktemp("prefix-server") / "target.gguf")


def pipeline(target_file, gib: float = 0.5) -> SpeculativePipeline:
    return SpeculativePipeline.load(str(target_file), None, runners=RunnerOptions(kind="gguf"), prefix_cache_gib=gib)


def metrics(client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def complete(client, prompt: str = PROMPT, **extra) -> dict:
    response = client.post("/v1/completions", json={"model": client.model, "prompt": prompt, **GREEDY, **extra})
    assert response.status_code == 200, response.text
    return response.json()


class served(TestClient):
    """The app over ``pipe`` in a test client, ready (warmed up) once entered."""

    def __init__(self, pipe, **options) -> None:
        super().__init__(create_app(pipe, **options))
        self.model = pipe.target.name

    def __enter__(self):
        super().__enter__()
        deadline = time.monotonic() + 60
        while self.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        return self


def test_cached_tokens_in_usage_and_metrics_and_the_same_text(target_file, tmp_path):
    with served(pipeline(target_file, gib=0)) as client:
        cold = complete(client)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert "verispec_prefix_cache_hits_total" not in metrics(client)  # no cache: no figures
    with served(pipeline(target_file)) as client:
        first = complete(client)
        second = complete(client)
        longer = complete(client, prompt=PROMPT + "more text")
        figures = metrics(client)
        streamed = client.post(
            "/v1/completions",
            json={
                "model": client.model,
                "prompt": PROMPT,
                "stream": True,
                "stream_options": {"include_usage": True},
                **GREEDY,
            },
        )
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == cold["choices"][0]["text"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // 16 * 16 > 0  # all of its full blocks but the last token's
    assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached
    assert figures["verispec_prefix_cache_hits_total"] >= 2 * cached
    assert figures["verispec_prefix_cache_queries_total"] >= 3 * prompt_tokens
    assert figures["verispec_prefix_cache_blocks"] > 0 and figures["verispec_prefix_cache_bytes"] > 0
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


def test_the_cache_file_round_trip_and_its_refusals(target_file, tmp_path, capfd):
    path = tmp_path / "prefix.cache"
    with served(pipeline(target_file), prefix_cache_file=str(path)) as client:
        text = complete(client)["choices"][0]["text"]
    assert path.stat().st_size > 0  # saved at shutdown
    pipe = pipeline(target_file)
    with served(pipe, prefix_cache_file=str(path)) as client:
        assert len(pipe.prefix_cache) > 0  # read back at start
        warm = complete(client)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and warm["choices"][0]["text"] == text
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    pipe = pipeline(target_file)
    with served(pipe, prefix_cache_file=str(path)) as client:
        assert len(pipe.prefix_cache) == 0 or complete(client)  # ignored, said once
    assert "prefix cache starts empty" in capfd.readouterr().err
    with served(pipeline(target_file), prefix_cache_file=str(path)) as client:
        complete(client)  # writes a good file again at shutdown
    other = pipeline(target_file)
    other.prefix_cache_identity = lambda: {"target": "another model"}  # weights changed since the file was written
    with served(other, prefix_cache_file=str(path)):
        assert len(other.prefix_cache) == 0
    assert "written for other models or kernels" in capfd.readouterr().err


def test_warm_prompts_are_cached_before_the_first_request(target_file, tmp_path):
    system = tmp_path / "system.txt"
    system.write_text(PROMPT)
    pipe = pipeline(target_file)
    assert pipe.tokenizer.chat_template is None  # the tiny model has none: the text is prefilled as it is
    with served(pipe, warm_prompts=(str(system),)) as client:
        out = complete(client, prompt=PROMPT + " question")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(pipe.encode(PROMPT)) // 16 * 16 - 16 > 0


def test_a_runner_without_exact_copies_has_no_cache_and_says_why(target_file, tmp_path):
    pipe = pipeline(target_file)
    assert "prefix cache 0.50 GiB" in pipe.prefix_cache_summary() and "KiB a token" in pipe.prefix_cache_summary()
    off = pipeline(target_file, gib=0)
    assert off.prefix_cache is None and "off" in off.prefix_cache_summary()
    assert isinstance(pipe.prefix_cache, PrefixCache)
    with pytest.raises(Exception, match="prefix-cache-gib"):
        pipeline(target_file, gib=-1)
