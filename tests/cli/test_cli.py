"""The command line on tiny local checkpoints: JSON output, exactness, and clear user errors."""

import importlib
import json
import socket
import sys
from contextlib import contextmanager

import pytest
from typer.testing import CliRunner

from verispec.cli import app

runner = CliRunner()


def run_json(checkpoints, *extra):
    args = ["generate", "def fib(n):", "--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"])]
    result = runner.invoke(app, args + ["--json", "--max-tokens", "24", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_json_none_and_draft_give_identical_token_ids(checkpoints):
    plain = run_json(checkpoints, "--method", "none")
    speculative = run_json(checkpoints, "--method", "draft", "-k", "3", "--schedule", "constant")
    assert speculative["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) > 0
    assert speculative["text"] == plain["text"]
    spec = speculative["metrics"]["spec"]
    assert spec["num_drafts"] > 0 and spec["acceptance_rate"] is not None
    assert [m["role"] for m in speculative["models"]] == ["target", "draft"]
    assert plain["metrics"]["spec"]["num_drafts"] == 0


def test_prompt_from_stdin_streams_text_and_stats(checkpoints):
    args = [
        "generate",
        "--target",
        str(checkpoints["target"]),
        "--draft",
        str(checkpoints["draft"]),
        "--max-tokens",
        "8",
    ]
    result = runner.invoke(app, args, input="print(1)")
    assert result.exit_code == 0, result.output
    assert "acceptance rate" in result.output and "TTFT" in result.output


def test_the_streamed_text_ends_its_line_before_stderr_says_more(checkpoints, monkeypatch):
    # issue 54, item 8: --compare-plain's progress line ran into the text ("returnverispec: plain decoding")
    generate_command = importlib.import_module("verispec.cli.generate")  # the package's `generate` is the function

    @contextmanager
    def said_at_once(what, why, console):  # as announce_slow says it once a step takes long
        print(f"verispec: {what} ({why}) ...", file=sys.stderr, flush=True)
        yield

    monkeypatch.setattr(generate_command, "working", said_at_once)
    args = ["generate", "def f():", "--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"])]
    result = runner.invoke(app, args + ["--max-tokens", "6", "--compare-plain"])
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith("\n") and result.stdout.count("\n") >= 1
    text = result.stdout[:-1]  # the generated text, then the one newline generate writes
    assert text + "\nverispec: plain decoding of the same prompt (--compare-plain)" in result.output, result.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "-1"], "temperature must be 0 (greedy) or in"),  # impossible parameter
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--method", "magic"], "unknown method"),
        (["-k", "0"], "num_speculative_tokens"),
        (["--dtype", "int3"], "dtype"),
        (["--target", "/nonexistent/model.gguf"], "not found"),  # wrong path
    ],
)
def test_user_errors_exit_2_without_traceback(checkpoints, extra, message):
    args = ["generate", "x = 1", "--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"])]
    result = runner.invoke(app, args + extra)
    assert result.exit_code == 2
    assert "error:" in result.output and message in result.output
    assert "Traceback" not in result.output


def test_incompatible_draft_is_refused(checkpoints):
    args = ["generate", "x = 1", "--target", str(checkpoints["target"]), "--draft", str(checkpoints["other"])]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "draft" in result.output and "Traceback" not in result.output


def test_prompt_over_context_length(checkpoints):
    prompt = "a" * 300  # one byte per token; tiny models have 256 positions
    result = runner.invoke(app, ["generate", prompt, "--target", str(checkpoints["target"]), "--method", "none"])
    assert result.exit_code == 2 and "context window" in result.output


def test_tree_method_from_the_command_line_equals_plain(checkpoints):
    plain = run_json(checkpoints, "--method", "none")
    tree = run_json(checkpoints, "--method", "tree", "-k", "6", "--schedule", "constant")
    assert tree["token_ids"] == plain["token_ids"]
    assert tree["metrics"]["spec"]["num_drafts"] > 0


def test_user_errors_prints_the_message_verbatim_and_exits_2():
    import typer

    from verispec.cli.common import user_errors
    from verispec.errors import InvalidParameterError

    app = typer.Typer()

    @app.command()
    def fail(kind: str) -> None:
        with user_errors(OSError):
            raise InvalidParameterError("pip install 'verispec[ray]'") if kind == "user" else OSError("disk full")

    result = runner.invoke(app, ["user"])
    assert result.exit_code == 2 and "error: pip install 'verispec[ray]'" in result.output  # "[ray]" is not markup
    assert runner.invoke(app, ["os"]).output.strip() == "error: disk full"


def test_serve_passes_the_prefill_budget_to_load(monkeypatch):
    import uvicorn

    from server_support import tiny_pipeline
    from verispec.engine.loader import SpeculativePipeline

    seen = {}

    def load(cls, *args, **kwargs):
        seen.update(kwargs)
        return tiny_pipeline()

    monkeypatch.setattr(SpeculativePipeline, "load", classmethod(load))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    result = runner.invoke(app, ["serve", "--max-num-batched-tokens", "64", "--port", str(free_port())])
    assert result.exit_code == 0, result.output
    assert seen["max_num_batched_tokens"] == 64


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "{busy}"], "error: cannot listen on 127.0.0.1:{busy}: the port is in use: stop what listens"),
        (["--host", "no-such-host.invalid"], "error: --host no-such-host.invalid: not an address to listen on"),
        (["--host", "192.0.2.1"], "error: cannot listen on 192.0.2.1:8000: the address is not one of this machine"),
        (["--port", "99999"], "--port': Input should be less than or equal to 65535"),  # was bound as 34463
    ],
)
def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(monkeypatch, args, message):
    from verispec.engine.loader import SpeculativePipeline

    def load(cls, *args, **kwargs):
        raise AssertionError("loaded the models before checking the address")

    monkeypatch.setattr(SpeculativePipeline, "load", classmethod(load))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        result = runner.invoke(app, ["serve", "--draft", "none", *(a.format(busy=port) for a in args)])
    assert result.exit_code == 2, result.output
    assert message.format(busy=port) in " ".join(result.output.split()) and "Traceback" not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["advise", "--export", "nope"],
        ["advise", "--cached-prompt-fraction", "1"],
        ["bench", "--prefill-tokens", "0"],
        ["serve", "--log-level", "loud"],
    ],
)
def test_argument_checks_are_user_errors(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and result.output.startswith("error: --") and "Traceback" not in result.output
