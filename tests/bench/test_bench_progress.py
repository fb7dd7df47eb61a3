"""Progress on stderr for long commands (issue 29): bench says prompt i of n, the participant and
its decode tokens/s so far, --quiet hides it, --json keeps stdout pure JSON; advise and datastore
build say how far they got. No timing assertions: every line is asked for (LINE_EVERY_S = 0)."""

import io
import json
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

import verispec.progress as progress
from gguf_models import MIXED, write_gguf_model
from helpers import single_thread
from server_support import save_tiny_pair, tiny_pipeline
from verispec.bench.command import run_and_report
from verispec.bench.run import BenchConfig
from verispec.bench.workload import parse_jsonl
from verispec.cli import app

PROMPTS = [
    {"prompt": "Hello 你好", "category": "greeting"},
    {"prompt": "abc abc", "category": "code"},
    {"turns": ["世界é!"], "category": "chat"},
]
RATE = re.compile(r"(torch|int8):(none|draft) \d+\.\d decode tok/s so far")


@pytest.fixture(autouse=True)
def every_line(monkeypatch, tmp_path):
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)  # a line per run: no dependence on speed
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))


def bench(console, show_progress=True, warmup=False):
    items = parse_jsonl([json.dumps(p) for p in PROMPTS])
    config = BenchConfig(methods=("none", "draft"), peers=(), max_tokens=16, warmup=warmup)
    return run_and_report(
        tiny_pipeline(),
        items,
        config,
        None,
        workload="tiny",
        dtype="float32",
        console=console,
        show_progress=show_progress,
    )


def test_bench_lines_name_each_prompt_the_method_and_a_rate(capsys):
    bench(Console(stderr=True, force_terminal=False), warmup=True)
    captured = capsys.readouterr()
    assert captured.out == ""  # progress never on stdout
    lines = [line for line in captured.err.splitlines() if line.startswith("verispec: bench run ")]
    assert any("warm-up (untimed) torch:draft" in line for line in lines)
    done = [line for line in lines if RATE.search(line)]
    assert len(done) == 3 * 2  # one line per timed run
    for index in (1, 2, 3):
        for method in ("none", "draft"):
            assert any(f"prompt {index}/3 " in line and f"torch:{method} · torch:{method} " in line for line in done), (
                index,
                method,
            )
    assert done[-1].startswith("verispec: bench run 6/6 · ")


def test_quiet_bench_says_nothing(capsys):
    bench(Console(stderr=True, force_terminal=False), show_progress=False)
    assert "bench run" not in capsys.readouterr().err


def test_a_terminal_gets_a_bar():
    screen = io.StringIO()
    bench(Console(file=screen, force_terminal=True, width=160))
    assert "prompt 3/3" in screen.getvalue() and "6/6" in screen.getvalue()


def test_steps_say_what_runs_after_the_last_step(capsys):
    with progress.steps("thing", 2, every_s=0) as shown:
        shown.after = "sorting"
        shown.running("a")
        shown.finished("a", "1 so far")
        shown.finished("b", "2 so far")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("verispec: thing 0/2 · running a (")
    assert err[1].startswith("verispec: thing 1/2 · a · 1 so far (")
    assert err[-1].startswith("verispec: thing 2/2 · then sorting (")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), PROMPTS[:2])


def test_cli_bench_json_stdout_stays_json(model_dirs):
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--prompts",
            str(model_dirs / "prompts.jsonl"),
            "--methods",
            "none,draft",
            "--peers",
            "none",
            "--max-tokens",
            "8",
            "--no-warmup",
            "--json",
            "--target",
            str(model_dirs / "target"),
            "--draft",
            str(model_dirs / "draft"),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # the whole of stdout: one JSON object
    assert data["schema"] == "verispec.bench" and len(data["records"]) == 2 * 2
    runs = [line for line in result.stderr.splitlines() if line.startswith("verispec: bench run ")]
    assert any("prompt 1/2 " in line for line in runs) and any("prompt 2/2 " in line for line in runs)
    assert any(RATE.search(line) for line in runs)
    quiet = CliRunner().invoke(
        app,
        [
            "bench",
            "--prompts",
            str(model_dirs / "prompts.jsonl"),
            "--methods",
            "none",
            "--peers",
            "none",
            "--max-tokens",
            "4",
            "--no-warmup",
            "--json",
            "--quiet",
            "--target",
            str(model_dirs / "target"),
            "--draft",
            "none",
        ],
    )
    assert quiet.exit_code == 0, quiet.output
    assert json.loads(quiet.stdout)["schema"] == "verispec.bench" and "bench run" not in quiet.stderr


def test_cli_advise_says_its_runs(model_dirs):
    result = CliRunner().invoke(
        app,
        [
            "advise",
            "--prompts",
            str(model_dirs / "prompts.jsonl"),
            "--methods",
            "draft",
            "--max-tokens",
            "8",
            "--max-k",
            "2",
            "--json",
            "--target",
            str(model_dirs / "target"),
            "--draft",
            str(model_dirs / "draft"),
        ],
    )
    assert result.exit_code == 0, result.output
    json.loads(result.stdout.strip().splitlines()[-1])
    assert "verispec: advise run 4/4 · " in result.stderr and "then timing the target's verify passes" in result.stderr


def test_cli_datastore_build_says_file_i_of_n(tmp_path):
    target = write_gguf_model(tmp_path / "target.gguf", MIXED)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text("ab!c " * (i + 1))
    result = CliRunner().invoke(
        app, ["datastore", "build", str(corpus), "--out", str(tmp_path / "ds"), "--target", str(target)]
    )
    assert result.exit_code == 0, result.output
    assert "verispec: datastore file 3/3 · tokenized " in result.stderr
    assert "then sorting the suffixes of " in result.stderr and result.stdout == ""


def test_cli_models_fetch_unknown_name_still_a_user_error():
    result = CliRunner().invoke(app, ["models", "fetch", "no-such-model"])  # not a terminal: the line-mode wrapper
    assert result.exit_code == 2 and "error:" in result.stderr and result.stdout == ""
