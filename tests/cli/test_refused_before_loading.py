"""A prompt over the context window and ``--chat`` on a model without a chat template are refused
from the GGUF header and the tokenizer, before any weights load (issue 54, item 4: they were
refused after both models loaded, ~25 s and ~5 s)."""

import pytest
from typer.testing import CliRunner

from gguf_models import MIXED, write_gguf_model
from helpers import tiny_qwen2
from server_support import build_tokenizer, save_checkpoint
from verispec.cli import app
from verispec.engine import loader
from verispec.engine.loader import PromptCheck, SpeculativePipeline
from verispec.errors import ContextLengthError, InvalidParameterError

cli = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("refused-first")
    tokenizer = build_tokenizer()  # byte-level BPE with a chat template
    return {
        "gguf": write_gguf_model(root / "target.gguf", MIXED),  # context 512, no chat template
        "checkpoint": save_checkpoint(root / "checkpoint", tiny_qwen2(seed=0, vocab_size=len(tokenizer)), tokenizer),
    }


@pytest.fixture
def no_weights(monkeypatch):
    """Reading any weights (a runner built, a torch model loaded) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the prompt was checked")

    monkeypatch.setattr(loader, "build_runners", refuse)
    monkeypatch.setattr(loader, "load_model", refuse)


def refused(result, fragment: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "weights were loaded" not in result.output, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("error: "))
    assert fragment in line, line
    return line


@pytest.mark.parametrize(
    "runner, extra, fragment",
    [
        # 600 one-byte tokens in the file's 512-token trained context
        ("gguf", ["a" * 600], "the prompt has 600 tokens but the context window is 512: shorten it"),
        # the prompt fits, the answer does not
        ("gguf", ["a" * 10, "--max-tokens", "600"], "max_tokens is 600 (610 in all) but the context window is 512"),
        # --max-context cuts the window below the trained context
        ("gguf", ["a" * 100, "--max-context", "64"], "the prompt has 100 tokens but the context window is 64"),
        # the torch runner's window is the trained context: the header's, read without the weights
        ("torch", ["a" * 600], "the prompt has 600 tokens but the context window is 512"),
    ],
)
def test_a_prompt_past_the_window_is_refused_before_the_weights_load(models, no_weights, runner, extra, fragment):
    args = ["generate", *extra, "--target", str(models["gguf"]), "--method", "none", "--runner", runner]
    refused(cli.invoke(app, args), fragment)


def test_chat_without_a_template_is_refused_before_the_weights_load(models, no_weights):
    args = ["generate", "hello", "--chat", "--target", str(models["gguf"]), "--method", "none", "--runner", "gguf"]
    refused(cli.invoke(app, args), f"{models['gguf'].name} has no chat template: drop --chat")


def test_a_checkpoint_folder_is_checked_from_its_tokenizer_files(models, no_weights):
    # tiny_qwen2 has 256 positions; its chat template adds the turn's tokens to the prompt's
    args = ["generate", "a" * 300, "--target", str(models["checkpoint"]), "--method", "none", "--runner", "torch"]
    refused(cli.invoke(app, args), "the prompt has 300 tokens but the context window is 256")
    args = ["generate", "a" * 250, "--chat", "--target", str(models["checkpoint"]), "--method", "none"]
    line = refused(cli.invoke(app, args + ["--runner", "torch"]), "but the context window is 256")
    assert "the prompt has 250 tokens" not in line  # counted through the template, as the pipeline counts it


def test_the_library_load_takes_the_same_check(models, no_weights):
    with pytest.raises(ContextLengthError, match="context window is 512"):
        SpeculativePipeline.load(str(models["gguf"]), None, check_prompt=PromptCheck("a" * 600))
    with pytest.raises(InvalidParameterError, match="no chat template"):
        SpeculativePipeline.load(str(models["gguf"]), None, check_prompt=PromptCheck("hi", chat=True))


def test_a_prompt_that_fits_loads(models):
    args = ["generate", "a" * 10, "--target", str(models["gguf"]), "--method", "none", "--max-tokens", "2"]
    result = cli.invoke(app, args + ["--runner", "gguf", "--max-context", "64"])
    assert result.exit_code == 0, result.output


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]], ids=["generate", "serve"])
@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--method", "eagle"], "--method eagle needs --eagle-head FILE"),  # serve skipped this check once
        (["--eagle-head", "no-such-head"], "--eagle-head no-such-head: no such file or folder"),
        (["--head-quantization", "q2"], "unknown head quantization 'q2'"),
        (["--runner", "bogus"], "unknown runner 'bogus'"),
    ],
)
def test_generate_and_serve_refuse_the_same_mistakes_before_loading(no_weights, command, extra, fragment):
    # one check (verispec.cli.options.PipelineOptions.check_before_loading) for every command
    args = [*command, "--draft", "none", *extra]
    if command == ["serve"]:
        args += ["--port", str(free_port())]
    refused(cli.invoke(app, args), fragment)
