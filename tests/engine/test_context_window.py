"""The context window (``--max-context``): its default, its KV cost, and requests that cannot finish
inside it refused with the numbers (OpenAI / vLLM), never cut at the window (issue 44, item 4)."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from gguf_models import write_gguf_model
from server_support import MAX_BODY_BYTES, MAX_TOKENS_CAP, LiveServer, tiny_pipeline, wait_ready
from verispec import cli
from verispec.engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, SpeculativePipeline
from verispec.errors import ContextLengthError, InvalidParameterError
from verispec.runners.select import RunnerOptions

C = "/v1/completions"
TRAINED = 512  # the tiny GGUF files' context_length


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("window")
    return write_gguf_model(folder / "t.gguf"), write_gguf_model(folder / "d.gguf", seed=1)


def _generate(tiny_gguf, *args):
    target, draft = tiny_gguf
    return CliRunner().invoke(
        cli.app, ["generate", "--target", str(target), "--draft", str(draft), "--runner", "gguf", *args]
    )


def test_generate_refuses_a_prompt_plus_max_tokens_over_max_context(tiny_gguf):
    # 40 one-character tokens + 32 new ones need 72 positions; a 64-token window cannot hold them
    result = _generate(tiny_gguf, "!" * 40, "--max-context", "64", "--max-tokens", "32", "--method", "none")
    assert result.exit_code == 2, result.output
    assert "max_tokens is 32" in result.output and "context window is 64" in result.output
    assert "at most" in result.output  # the room left: 64 - the prompt's tokens


def test_generate_refuses_max_context_above_the_trained_context(tiny_gguf):
    result = _generate(tiny_gguf, "ab", "--max-context", str(TRAINED + 1), "--max-tokens", "2", "--method", "none")
    assert result.exit_code == 2, result.output
    assert (
        f"--max-context {TRAINED + 1} exceeds" in result.output
        and f"trained context of {TRAINED} tokens" in result.output
    )


def test_max_context_sets_the_window_and_its_kv_bytes(tiny_gguf):
    from verispec.runners import kv_cache_bytes

    target, draft = tiny_gguf
    pipe = SpeculativePipeline.load(str(target), str(draft), runners=RunnerOptions(kind="gguf", max_context_length=128))
    assert pipe.context_window == 128 and pipe.target_runner.max_context_length == 128
    # 2 layers x 2 (K, V) x 2 kv heads x 64 head_dim x 4 bytes (float32) per token
    assert pipe.target_runner.kv_bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert kv_cache_bytes(pipe.target_runner) == 2 * 2 * 2 * 64 * 4 * 128
    assert pipe.window_summary(8).startswith(
        "context window 128 tokens; KV cache per sequence: target 0 MiB + draft 0 MiB"
    )
    pipe.check_window(100, 28)  # exactly the window: fits
    with pytest.raises(
        ContextLengthError,
        match="the prompt has 100 tokens and max_tokens is 29 .129 in all. but the context window is 128",
    ):
        pipe.check_window(100, 29)
    default = SpeculativePipeline.load(str(target), None, runners=RunnerOptions(kind="gguf"))
    assert default.context_window == TRAINED  # min(trained, 4096)


def test_runner_options_refuse_a_window_below_one():
    with pytest.raises(InvalidParameterError, match="max_context_length must be >= 1"):
        RunnerOptions(kind="gguf", max_context_length=0)


@pytest.fixture(scope="module")
def narrow():
    """A server whose target window is 64 tokens (the tiny models are trained on 256)."""
    pipe = tiny_pipeline()
    pipe.target_runner.max_context_length = 64
    app = create_app_for(pipe)
    with LiveServer(app) as server:
        wait_ready(server.url)
        yield server


def create_app_for(pipe):
    from verispec.server import create_app

    return create_app(pipe, max_tokens_cap=MAX_TOKENS_CAP, max_queue=4, max_body_bytes=MAX_BODY_BYTES)


def test_server_refuses_prompt_plus_max_tokens_over_the_window(narrow):
    # 50 prompt tokens + max_tokens 20 = 70 > 64: before, the answer stopped at 14 tokens ("length")
    response = httpx.post(
        narrow.url + C, json={"model": "tiny-target", "prompt": [1] * 50, "max_tokens": 20}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert error["message"].startswith(
        "the prompt has 50 tokens and max_tokens is 20 (70 in all) but the context window is 64"
    )
    assert "at most 14 tokens" in error["message"]


def test_server_lowers_a_default_max_tokens_to_the_room_left(narrow):
    # chat's default max_tokens is the server's cap (200 here): lowered to the 64 - prompt room, not refused
    body = {
        "model": "tiny-target",
        "messages": [{"role": "user", "content": "Hello " * 5}],
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(narrow.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.real_model
def test_real_pair_window_kv_bytes_and_a_4000_token_prompt_refused():
    from verispec.models.store import ModelStore
    from verispec.runners import kv_cache_bytes

    store = ModelStore()
    if any(store.cache_state(name) == "missing" for name in (DEFAULT_TARGET, DEFAULT_DRAFT)):
        pytest.skip("the default pair is not in the model cache (verispec models fetch NAME)")
    pipe = SpeculativePipeline.load(DEFAULT_TARGET, DEFAULT_DRAFT, runners=RunnerOptions(kind="gguf"))
    assert pipe.context_window == 4096 and pipe.target.context_length == 32768  # the GGUF header's
    assert kv_cache_bytes(pipe.target_runner) == 28 * 2 * 2 * 128 * 4 * 4096  # 224 MiB
    assert kv_cache_bytes(pipe.draft_runner) == 24 * 2 * 2 * 64 * 4 * 4096  # 96 MiB
    app = create_app_for(pipe)
    with LiveServer(app) as server:
        wait_ready(server.url, timeout_s=300)
        prompt = pipe.tokenizer.encode("x = 1\n" * 1000)[:4050]  # max_tokens within the server's cap (64)
        response = httpx.post(
            server.url + C, json={"model": DEFAULT_TARGET, "prompt": prompt, "max_tokens": 60}, timeout=120
        )
        assert response.status_code == 400, response.text
        assert (
            "4050 tokens and max_tokens is 60 (4110 in all) but the context window is 4096"
            in response.json()["error"]["message"]
        )
