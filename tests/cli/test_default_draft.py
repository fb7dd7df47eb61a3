"""A named target without ``--draft`` (issue 54, item 1): the built-in draft only where the target is
known to share its tokenizer, else no draft model, said on stderr; generate, serve, bench and advise
decide the same way before loading, and the refusal of a given incompatible draft names
``--draft none``."""

import dataclasses
import socket

import pytest
from typer.testing import CliRunner

from gguf_models import MIXED, write_gguf_model
from helpers import tiny_qwen2
from server_support import build_tokenizer, save_checkpoint
from verispec.cli import app
from verispec.engine.loader import SpeculativePipeline
from verispec.errors import VerispecError
from verispec.models.gguf_file import read_gguf_header
from verispec.models.preflight import default_draft
from verispec.models.registry import BUILTIN_MODELS, DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.models.store import ModelStore

cli = CliRunner()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return write_gguf_model(tmp_path_factory.mktemp("default-draft") / "target.gguf", MIXED)


class Stop(VerispecError):
    """Raised by the patched loader: the test has seen what would load."""


@pytest.fixture
def loads(monkeypatch):
    """Every (target, draft) SpeculativePipeline.load is asked for; loading itself stops the command."""
    asked: list[tuple[str, str | None]] = []

    def record(cls, target, draft=None, **kwargs):
        asked.append((target, draft))
        raise Stop("stopped before loading")

    monkeypatch.setattr(SpeculativePipeline, "load", classmethod(record))
    return asked


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_default_draft_by_target(tiny_target, tmp_path):
    store = ModelStore(home=tmp_path, readonly=())
    cases = [
        # the built-in pair: the built-in draft, nothing said
        (DEFAULT_TARGET, DEFAULT_DRAFT, None),
        # another family known from the registry (not downloaded): no draft model
        ("gemma-3-270m", None, "does not have gemma-3-270m's tokenizer"),
        ("smollm2-135m-instruct", None, "does not have smollm2-135m-instruct's tokenizer"),
        # the built-in draft named as the target: it would draft for itself
        (DEFAULT_DRAFT, None, "is the built-in draft itself"),
        # a GGUF file of another vocabulary, read from its header
        (str(tiny_target), None, "so auto drafts by lookup only"),
    ]
    for target, draft, reason in cases:
        chosen = default_draft(target, store=store)
        assert chosen.draft == draft, target
        if reason is None:
            assert chosen.reason is None
        else:
            assert reason in chosen.reason and "--draft MODEL" in chosen.reason, chosen.reason
    assert not (tmp_path / "models").exists()  # nothing downloaded


def test_a_target_of_the_built_in_drafts_tokenizer_keeps_it(tiny_target, tmp_path):
    # a registry whose built-in draft has the tiny file's token list: the file's header says it shares it
    digest = read_gguf_header(tiny_target).tokens_digest
    registry = dict(BUILTIN_MODELS)
    registry[DEFAULT_DRAFT] = dataclasses.replace(registry[DEFAULT_DRAFT], tokens_sha256=digest)
    chosen = default_draft(str(tiny_target), store=ModelStore(home=tmp_path, readonly=(), registry=registry))
    assert chosen.draft == DEFAULT_DRAFT
    assert chosen.reason == f"draft model: the built-in {DEFAULT_DRAFT}, which has {tiny_target}'s tokenizer"


def test_a_checkpoint_folder_is_not_given_the_built_in_draft(tmp_path):
    tokenizer = build_tokenizer()
    folder = save_checkpoint(tmp_path / "checkpoint", tiny_qwen2(seed=0, vocab_size=len(tokenizer)), tokenizer)
    chosen = default_draft(str(folder), store=ModelStore(home=tmp_path, readonly=()))
    assert chosen.draft is None and "is not known to have" in chosen.reason


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "def f():"],
        ["serve", "--port", "{port}"],
        ["bench", "--prompts", "{prompts}", "--limit", "1", "--peers", "none"],
        ["advise", "--prompts", "{prompts}"],
    ],
)
def test_a_named_target_without_a_draft_loads_no_draft_model(loads, command, tmp_path):
    prompts = tmp_path / "prompts.jsonl"  # a prompts file of its own: a clone need not have ../shared/data
    prompts.write_text('{"prompt": "def f():"}\n')
    args = [a.format(port=free_port(), prompts=prompts) for a in command] + ["--target", "gemma-3-270m"]
    result = cli.invoke(app, args)
    assert "stopped before loading" in result.output, result.output
    assert loads == [("gemma-3-270m", None)]
    assert "no draft model: the built-in draft qwen2.5-coder-0.5b-instruct does not have" in result.output


def test_the_built_in_pair_and_draft_none_say_nothing(loads):
    cli.invoke(app, ["generate", "def f():"])
    cli.invoke(app, ["generate", "def f():", "--target", "gemma-3-270m", "--draft", "none"])
    result = cli.invoke(app, ["generate", "def f():", "--target", "gemma-3-270m", "--method", "ngram"])
    assert loads == [(DEFAULT_TARGET, DEFAULT_DRAFT), ("gemma-3-270m", None), ("gemma-3-270m", None)]
    assert "no draft model" not in result.output  # a method that drafts by lookup only: nothing to say


def test_a_given_incompatible_draft_is_refused_naming_draft_none(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))  # neither model downloaded: judged from the registry
    monkeypatch.delenv("VERISPEC_MODELS_READONLY", raising=False)
    result = cli.invoke(app, ["generate", "x", "--target", "gemma-3-270m", "--draft", DEFAULT_DRAFT])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "draft vocabulary differs from the target's" in result.output
    assert "or give --draft none for no draft model" in result.output
    assert not (tmp_path / "models").exists()
