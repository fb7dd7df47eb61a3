"""The OpenAI-compatible server against the official ``openai`` client, on a loopback port.

Every expected text is computed by calling an identical pipeline directly, so these tests pin
"the server returns exactly what the library generates" for each route and mode.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_support import FIXED_DRAFT, client, http, metric_value, reference, served
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig

MODEL = "tiny-target"
CHAT = [{"role": "user", "content": "你好"}]


def expected(reference, prompt: str, *, chat: bool = False, spec: SpeculativeConfig | None = None, **params):
    ids = reference.encode(prompt, chat=chat)
    return reference.engine.generate(ids, SamplingParams(**params), spec or FIXED_DRAFT)


def stream_completion(client, **kwargs):
    """Streamed text, finish reason, number of text chunks and usage of one completion."""
    text, finish, num_chunks, usage = "", None, 0, None
    for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            num_chunks += bool(choice.text)
            finish = choice.finish_reason or finish
    return text, finish, num_chunks, usage


def stream_chat(client, **kwargs):
    text, finish, num_chunks, usage, roles = "", None, 0, None, []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            text += choice.delta.content or ""
            num_chunks += bool(choice.delta.content)
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    return text, finish, num_chunks, usage


# ----- completions and chat, streaming and not -----


def test_completion_greedy_equals_library(client, reference):
    want = expected(reference, "hi", max_tokens=30)
    got = client.completions.create(model=MODEL, prompt="hi", max_tokens=30, temperature=0)
    assert got.choices[0].text == want.text
    assert "你好🙂世界" in got.choices[0].text  # multi-byte characters split across tokens
    assert got.choices[0].finish_reason == "length"
    assert got.object == "text_completion" and got.model == MODEL


def test_chat_greedy_equals_library(client, reference):
    want = expected(reference, "你好", chat=True, max_tokens=30)
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == "length"


def test_completion_token_id_prompt(client, reference):
    ids = reference.encode("hi")
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected(reference, "hi", max_tokens=12).text


def test_eos_ends_with_stop(client):
    got = client.completions.create(model=MODEL, prompt="bye.", max_tokens=10, temperature=0)  # "." -> EOS
    assert (got.choices[0].text, got.choices[0].finish_reason, got.usage.completion_tokens) == ("", "stop", 0)


@pytest.mark.parametrize("max_tokens", [1, 7, 40])
def test_streamed_completion_equals_non_streamed(client, max_tokens):
    whole = client.completions.create(model=MODEL, prompt="hi", max_tokens=max_tokens, temperature=0)
    text, finish, num_chunks, _ = stream_completion(client, prompt="hi", max_tokens=max_tokens, temperature=0)
    assert (text, finish) == (whole.choices[0].text, whole.choices[0].finish_reason)
    if max_tokens == 40:
        assert 1 < num_chunks < whole.usage.completion_tokens  # several tokens per accepted block


@pytest.mark.parametrize("max_tokens", [3, 5, 8, 33])  # ends inside and after split characters
def test_streamed_chat_equals_non_streamed_multibyte(client, max_tokens):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=max_tokens, temperature=0)
    text, finish, _, _ = stream_chat(client, messages=CHAT, max_tokens=max_tokens, temperature=0)
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason == "length"
    if max_tokens == 33:
        assert "你好🙂世界" in text


def test_streamed_sampling_equals_non_streamed(client):
    args = dict(messages=CHAT, max_tokens=40, temperature=0.8, seed=5)
    whole = client.chat.completions.create(model=MODEL, **args)
    assert stream_chat(client, **args)[0] == whole.choices[0].message.content


# ----- stop strings -----


@pytest.mark.parametrize(
    "stop, text",
    [
        ("🙂", "Hello 你好"),  # the emoji's bytes are two tokens
        (["界", "nothing"], "Hello 你好🙂世"),  # earliest of several
        ("好🙂世", "Hello 你"),  # spans four tokens
        ("lo 你", "Hel"),  # held back while it might still be a stop string
    ],
)
def test_stop_strings(client, stop, text):
    got = client.completions.create(model=MODEL, prompt="hi", max_tokens=30, temperature=0, stop=stop)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (text, "stop")
    assert stream_completion(client, prompt="hi", max_tokens=30, temperature=0, stop=stop)[:2] == (text, "stop")


# ----- sampling: seeds, concurrency -----


def test_seed_reproducible_and_equal_to_library(client, reference):
    runs = [
        client.completions.create(model=MODEL, prompt="hi", max_tokens=24, temperature=0.8, seed=seed).choices[0].text
        for seed in (1, 1, 2)
    ]
    assert runs[0] == runs[1] != runs[2]
    assert runs[0] == expected(reference, "hi", max_tokens=24, temperature=0.8, seed=1).text


def test_parallel_requests_equal_sequential(client):
    def run(seed):
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0.8, seed=seed)
        return out.choices[0].message.content

    sequential = [run(11), run(12)]
    with ThreadPoolExecutor(2) as pool:
        parallel = list(pool.map(run, [11, 12]))
    assert parallel == sequential
    assert sequential[0] != sequential[1]


def test_penalties_change_sampling_like_library(client, reference):
    args = dict(max_tokens=20, temperature=0.8, seed=3, presence_penalty=1.5, frequency_penalty=0.5)
    got = client.completions.create(model=MODEL, prompt="hi", extra_body={"repetition_penalty": 1.3}, **args)
    assert got.choices[0].text == expected(reference, "hi", repetition_penalty=1.3, **args).text


# ----- usage and the speculative extension -----


def test_usage_fields_equal_library_metrics(client, reference):
    want = expected(reference, "hi", max_tokens=30)
    usage = client.completions.create(model=MODEL, prompt="hi", max_tokens=30, temperature=0).usage
    spec = want.metrics.spec
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(reference.encode("hi")),
        30,
        len(reference.encode("hi")) + 30,
    )
    assert (usage.num_drafts, usage.num_draft_tokens, usage.num_accepted_tokens) == (
        spec.num_drafts,
        spec.num_draft_tokens,
        spec.num_accepted_tokens,
    )
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # the draft agrees only partly
    assert usage.acceptance_rate == pytest.approx(spec.num_accepted_tokens / spec.num_draft_tokens)
    assert usage.mean_acceptance_length == pytest.approx(1 + spec.num_accepted_tokens / spec.num_drafts)
    assert usage.ttft_ms > 0 and usage.tpot_ms > 0  # queue_ms: test_metrics_counting (one request alone waits ~0)


def test_stream_include_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0).usage
    _, _, _, usage = stream_chat(
        client, messages=CHAT, max_tokens=20, temperature=0, stream_options={"include_usage": True}
    )
    assert (usage.completion_tokens, usage.num_draft_tokens, usage.num_accepted_tokens) == (
        whole.completion_tokens,
        whole.num_draft_tokens,
        whole.num_accepted_tokens,
    )
    assert stream_chat(client, messages=CHAT, max_tokens=5, temperature=0)[3] is None  # not asked: no usage


@pytest.mark.parametrize(
    "speculative, num_drafts_zero, max_per_draft",
    [
        ({"method": "none"}, True, 0),  # plain decoding: nothing drafted
        ({"num_speculative_tokens": 2}, False, 2),
        ({"method": "draft", "num_speculative_tokens": 7}, False, 7),
    ],
)
def test_speculative_extension(client, reference, speculative, num_drafts_zero, max_per_draft):
    got = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=30, temperature=0, extra_body={"speculative": speculative}
    )
    assert got.choices[0].text == expected(reference, "hi", max_tokens=30).text  # lossless either way
    assert (got.usage.num_drafts == 0) == num_drafts_zero
    assert got.usage.num_draft_tokens <= max_per_draft * got.usage.num_drafts


# ----- models, health, metrics, schema -----


def test_models_health_openapi(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = http.get("/health").json()
    assert (health["status"], health["model"], health["audit"]["rate"]) == ("ok", MODEL, 0.0)
    schema = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    assert "422" not in schema["paths"]["/v1/completions"]["post"]["responses"]


def test_metrics_counters_move_by_the_request(client, served):
    names = [
        "verispec_spec_decode_num_drafts_total",
        "verispec_spec_decode_num_draft_tokens_total",
        "verispec_spec_decode_num_accepted_tokens_total",
        "verispec_generation_tokens_total",
    ]
    before = [metric_value(served.url, n) for n in names]
    finished = metric_value(served.url, "verispec_request_success_total", finish_reason="length")
    ttft_count = metric_value(served.url, "verispec_time_to_first_token_seconds_count")
    usage = client.completions.create(model=MODEL, prompt="hi", max_tokens=25, temperature=0).usage
    after = [metric_value(served.url, n) for n in names]
    moved = [a - b for a, b in zip(after, before)]
    assert moved == [usage.num_drafts, usage.num_draft_tokens, usage.num_accepted_tokens, usage.completion_tokens]
    assert metric_value(served.url, "verispec_request_success_total", finish_reason="length") == finished + 1
    assert metric_value(served.url, "verispec_time_to_first_token_seconds_count") == ttft_count + 1
    assert metric_value(served.url, "verispec_spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert metric_value(served.url, "verispec_requests_in_flight") == 0


def kernel_info(text: str) -> tuple[dict, float]:
    (sample,) = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "verispec_kernel_info"]
    return sample.labels, sample.value


def test_metrics_name_the_runner_and_its_kernels(served, reference, tmp_path, monkeypatch):
    from gguf_models import write_gguf_model
    from verispec.engine.loader import SpeculativePipeline
    from verispec.runners.cpu.int8_ops import default_kernel
    from verispec.runners.kernels import gguf_kernels, kernel_isa
    from verispec.runners.select import RunnerOptions
    from verispec.server import create_app

    assert kernel_info(httpx.get(f"{served.url}/metrics").text) == (
        {"runner": "torch"},
        1.0,
    )  # torch picks its own kernels
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    gguf = SpeculativePipeline.load(
        str(write_gguf_model(tmp_path / "target.gguf")), None, runners=RunnerOptions(kind="gguf")
    )
    int8 = SpeculativePipeline(reference.target, None, runners=RunnerOptions(kind="int8"))
    for pipe, labels in [
        (
            gguf,
            {"runner": "gguf", "kernel_isa": kernel_isa(), "cpu_features": gguf_kernels().cpu_features()},
        ),  # the path that runs
        (int8, {"runner": "int8", "int8_kernel": default_kernel()}),  # oneDNN's VNNI product or torch._int_mm
    ]:
        assert kernel_info(create_app(pipe).state.verispec.metrics.exposition()[0].decode()) == (labels, 1.0)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL, prompt="hi", suffix="!")
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0).choices[0].text


def test_seed_gives_plain_text_under_every_method_alone_and_in_parallel(client):
    def run(method: str, sampling: str | None = None) -> str:
        extra = {"speculative": {"method": method, "num_speculative_tokens": 3}}
        if sampling is not None:
            extra["sampling"] = sampling
        out = client.completions.create(
            model=MODEL, prompt="hi", max_tokens=24, temperature=0.8, top_p=0.9, seed=7, extra_body=extra
        )
        assert out.system_fingerprint.startswith("verispec-")  # version and model digest
        return out.choices[0].text

    methods = ["none", "draft", "ngram", "suffix", "auto"]
    alone = [run(m) for m in methods]
    with ThreadPoolExecutor(len(methods)) as pool:
        parallel = list(pool.map(run, methods))
    assert alone == parallel == [alone[0]] * len(methods)
    assert run("none", "rejection") != alone[0] or run("draft", "rejection") != alone[0]  # another mode, other draws
