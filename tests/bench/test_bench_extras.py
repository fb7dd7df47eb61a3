"""What bench measures besides decoding (prefill, quality) and the options it took over from the
former bench-runners command (draft quantization, reduced draft head, schedule)."""

import pytest
import torch
from typer.testing import CliRunner

from helpers import BigramRunner
from verispec.bench.extras import time_prefill
from verispec.bench.report import prefill_rows, quality_rows
from verispec.bench.run import BenchConfig
from verispec.cli import app
from verispec.errors import VerispecError


def test_a_timed_prefill_runs_once_from_an_empty_cache_and_empties_it_again(monkeypatch):
    from verispec.bench import extras

    clock = iter([10.0, 12.5])  # the prefill starts at 10 s and ends at 12.5 s
    monkeypatch.setattr(extras.time, "perf_counter", lambda: next(clock))
    runner = BigramRunner(torch.zeros(16, 16), max_context_length=64)
    runner.forward([1, 2, 3])
    entry = time_prefill(runner, list(range(10)))
    assert runner.num_cached_tokens == 0 and runner.num_forwards == 2  # one prefill, cache emptied again
    assert entry == {"seconds": 2.5, "tokens_per_s": 4.0}  # 10 tokens in 2.5 s


def test_prefill_and_quality_tables():
    header, rows = prefill_rows(
        {
            "gguf": {512: {"seconds": 2.0, "tokens_per_s": 256.0}},
            "llama.cpp": {"512": {"seconds": 1.0, "tokens_per_s": 512.0}},
        }
    )
    assert header == ["runner", "512 tokens: tok/s"] and rows == [["gguf", "256.0"], ["llama.cpp", "512.0"]]
    header, rows = quality_rows({"int8": {"positions": 64, "top1_agreement": 0.984375, "mean_kl_nats": 0.0012345}})
    assert rows == [["int8", "64", "0.9844", "0.00123"]]


def test_bench_schedule_reaches_every_participant(monkeypatch):
    from types import SimpleNamespace

    from verispec.bench import run
    from verispec.bench.run import build_participants

    monkeypatch.setattr(run, "kernel_facts", lambda kind: {})  # no kernel build for fake pipelines

    engine = SimpleNamespace(proposers={"draft": None, "ngram": None})
    pipe = SimpleNamespace(engine=engine, engine_with_own_suffix_cache=lambda: engine)
    pipes = {"gguf": pipe, "int8": pipe}
    config = BenchConfig(methods=("draft", "ngram"), peers=(), schedule="constant", num_speculative_tokens=7)
    participants, _ = build_participants(pipes, config)
    assert len(participants) == 6  # none, draft, ngram on each runner
    assert {(p.spec.schedule, p.spec.num_speculative_tokens) for p in participants} == {("constant", 7)}
    with pytest.raises(VerispecError, match="unknown schedule 'sometimes'"):
        BenchConfig(schedule="sometimes")


def test_bench_sampling_mode_reaches_every_prompts_params():
    # sampled runs carry the mode (coupled: a seed fixes the text; rejection: the drafts shape it)
    assert BenchConfig(temperature=0.7, sampling="rejection").params(3).sampling == "rejection"
    assert (
        BenchConfig(temperature=0.7).params(3).sampling == "coupled"
        and BenchConfig(temperature=0.7).params(3).seed == 3
    )
    with pytest.raises(VerispecError, match="sampling must be one of"):
        BenchConfig(sampling="sometimes")


def test_bench_passes_the_draft_options_to_every_pipeline(monkeypatch, tmp_path):
    from verispec.bench import command

    seen = {}

    def fake_load(target, draft, dtype, console, runners, *, drafters=None, options=None):
        seen.update(drafters=drafters, options=options, runners=runners)
        raise VerispecError("stop here")

    monkeypatch.setattr(command, "load_pipelines", fake_load)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--prompts",
            str(prompts),
            "--runner",
            "gguf,int8",
            "--draft-quantization",
            "q4_0",
            "--draft-vocab",
            "4096",
            "--draft-vocab-corpus",
            "a.txt",
        ],
    )
    assert result.exit_code == 2 and "error: stop here" in result.output
    assert seen["runners"] == ["gguf", "int8"]
    assert seen["drafters"].draft_quantization == "q4_0"
    assert (seen["options"].draft_vocab_size, seen["options"].draft_vocab_corpus) == (4096, ("a.txt",))
