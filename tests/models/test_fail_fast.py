"""Bad input refused before any model loads (issue 44, items 5-8): a file that is no GGUF model, an
incompatible draft (built-in ones judged before their download), a truncated GGUF named as such, an
explicit layer skip on a runner without a float model, an empty prompt; a prompt piped by ``echo``
asks what the same text as an argument asks."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gguf_models import DRAFT_LIKE, MIXED, TOKENS, perturbed_copy, write_gguf_model
from helpers import REPO
from verispec.cli import app
from verispec.engine.loader import SpeculativePipeline
from verispec.errors import IncompatibleDraftError, ModelIntegrityError
from verispec.models import loading
from verispec.models.gguf_file import read_gguf_header
from verispec.models.preflight import check_before_loading
from verispec.models.registry import BUILTIN_MODELS, BuiltinModel
from verispec.models.store import ModelStore

cli = CliRunner()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("fail-fast")
    target = write_gguf_model(directory / "target.gguf", MIXED)
    text = directory / "notes.gguf"
    text.write_text("not a model, only a file named .gguf\n" * 10)
    (directory / "not-a-model.txt").write_text("hello\n")
    other_tokens = TOKENS[:3] + [t.upper() if t.isalpha() else t for t in TOKENS[3:]][::-1]
    truncated = directory / "truncated.gguf"
    shutil.copy(target, truncated)
    with open(truncated, "r+b") as handle:
        handle.truncate(target.stat().st_size - 5000)
    return {
        "target": target,
        "text": text,
        "txt": directory / "not-a-model.txt",
        "truncated": truncated,
        "draft": perturbed_copy(target, directory / "draft.gguf", "output.weight", 0.3),
        "other": write_gguf_model(directory / "other.gguf", DRAFT_LIKE, seed=5, tokens=other_tokens),
    }


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """A home with no model in it and no read-only model folder: built-in models not downloaded."""
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    monkeypatch.delenv("VERISPEC_MODELS_READONLY", raising=False)
    return tmp_path


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any model load, or any download, fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded or downloaded before the checks")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr("verispec.engine.loader.load_model", refuse)
    monkeypatch.setattr(loading, "load_gguf_info", refuse)
    monkeypatch.setattr("verispec.engine.loader.load_gguf_info", refuse)
    monkeypatch.setattr(ModelStore, "_download", refuse)


def one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    text = result.output.strip()
    assert text.count("\n") == 0 and text.startswith("error: "), text  # one line (soft-wrapped, never split)
    for fragment in fragments:
        assert fragment in text, text
    return text


# --- item 5: every named file and the vocabularies checked before anything loads


def test_a_text_file_named_gguf_is_refused_before_the_target_loads(files, nothing_loads):
    result = cli.invoke(app, ["generate", "x", "--target", str(files["target"]), "--draft", str(files["text"])])
    one_line_error(result, f"{files['text']} is not a valid GGUF file", "magic bytes")


def test_a_draft_that_is_no_model_file_is_one_line(files, nothing_loads):
    result = cli.invoke(app, ["generate", "x", "--target", str(files["target"]), "--draft", str(files["txt"])])
    one_line_error(result, "is a file but not a .gguf model")


def test_an_incompatible_gguf_draft_is_refused_from_the_headers(files, nothing_loads):
    result = cli.invoke(app, ["generate", "x", "--target", str(files["target"]), "--draft", str(files["other"])])
    one_line_error(result, "draft vocabulary differs from the target's: id 3 is '!' in the target and '}' in the draft")


def test_a_built_in_draft_of_another_vocabulary_is_refused_before_its_download(files, nothing_loads, fresh_home):
    result = cli.invoke(app, ["generate", "x", "--target", str(files["target"]), "--draft", "smollm2-135m-instruct"])
    one_line_error(
        result,
        "the draft smollm2-135m-instruct has 49152 tokens",
        f"target {files['target']} 96",
        "nothing was downloaded",
    )
    assert not (fresh_home / "models" / "smollm2-135m-instruct").exists()


def vocabulary_only(path: Path, tokens: list[str]) -> Path:
    """A GGUF with a token list and nothing else (what the pre-load check reads)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "draft_tokens, message",
    [
        # one string changed, sizes equal: the size alone would pass
        (TOKENS[:-1] + ["zz"], f"id 95 is {TOKENS[-1]!r} in the target and 'zz' in the draft; the draft must use"),
        # the same tokens and one more: named by the id only the draft has
        (
            TOKENS + ["extra"],
            "id 96 is absent in the target and 'extra' in the draft (it has 97 tokens, the target 96)",
        ),
        (TOKENS[:-1], f"id 95 is {TOKENS[-1]!r} in the target and absent in the draft (it has 95 tokens"),
    ],
)
def test_a_draft_vocabulary_is_refused_naming_its_first_differing_token(
    files, nothing_loads, tmp_path, draft_tokens, message
):
    draft = vocabulary_only(tmp_path / "draft.gguf", draft_tokens)
    result = cli.invoke(app, ["generate", "x", "--target", str(files["target"]), "--draft", str(draft)])
    one_line_error(result, "error: draft vocabulary differs from the target's: " + message)


def test_the_library_load_checks_before_loading(files, nothing_loads):
    with pytest.raises(IncompatibleDraftError, match="id 3 is '!' in the target"):
        SpeculativePipeline.load(str(files["target"]), str(files["other"]))
    with pytest.raises(ModelIntegrityError, match="not a valid GGUF file"):
        SpeculativePipeline.load(str(files["text"]), None)


def test_a_compatible_pair_passes_the_checks(files):
    check_before_loading(str(files["target"]), str(files["draft"]))  # same token list: no error
    check_before_loading(str(files["target"]), None)


def test_the_registry_records_each_built_in_token_list(user_verispec_home):
    target, draft, small = (
        BUILTIN_MODELS[name]
        for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
    )
    assert target.tokens_sha256 == draft.tokens_sha256 and target.vocab_size == draft.vocab_size == 151936
    assert small.tokens_sha256 != target.tokens_sha256 and small.vocab_size == 49152
    store = ModelStore(home=user_verispec_home)
    for name, entry in BUILTIN_MODELS.items():  # where a copy is on this machine: its header agrees
        path = store.model_path(name)
        if path.is_file():
            header = read_gguf_header(path)
            facts = (header.tokens_digest, header.metadata["tokenizer.ggml.tokens"])
            assert facts == (entry.tokens_sha256, entry.vocab_size)


def test_registry_judgement_never_downloads(files, tmp_path):
    def refuse(part, directory):
        raise AssertionError("downloaded")

    header = read_gguf_header(files["target"])
    same = BuiltinModel(
        "same", "qwen2", "Q4_K_M", "same.gguf", (), "0" * 64, 1, vocab_size=96, tokens_sha256=header.tokens_digest
    )
    other = BuiltinModel("other", "llama", "Q4_1", "other.gguf", (), "1" * 64, 1, vocab_size=50, tokens_sha256="f" * 64)
    store = ModelStore(home=tmp_path, readonly=(), registry={"same": same, "other": other}, downloader=refuse)
    check_before_loading(str(files["target"]), "same", store=store)
    with pytest.raises(IncompatibleDraftError, match="the draft other has 50 tokens and the target .* 96"):
        check_before_loading(str(files["target"]), "other", store=store)


# --- item 6: a truncated GGUF says so, with the sizes and how to fetch it again


def test_a_truncated_gguf_says_its_size_and_what_its_tensors_need(files, nothing_loads):
    size = files["truncated"].stat().st_size
    args = ["generate", "x", "--target", str(files["truncated"]), "--draft", "none", "--runner", "torch"]
    result = cli.invoke(app, args)
    one_line_error(
        result,
        f"{files['truncated']} is truncated: it has {size} bytes and its tensor table needs {size + 5000}",
        "download or copy it again",
    )


def test_a_truncated_built_in_file_names_the_fetch_command(files, tmp_path):
    copy = tmp_path / BUILTIN_MODELS["smollm2-135m-instruct"].file_name
    shutil.copy(files["truncated"], copy)
    with pytest.raises(ModelIntegrityError, match=r"`verispec models fetch smollm2-135m-instruct --force`"):
        read_gguf_header(copy)
    with pytest.raises(ModelIntegrityError, match="is truncated"):  # the torch path's own check, not numpy's reshape
        loading.load_model(str(copy))


# --- item 7: layer skip on a runner without a float model: one line, and a hint each command can follow


def test_explicit_layer_skip_on_the_gguf_runner_is_one_line(files):
    args = [
        "generate",
        "abc",
        "--target",
        str(files["target"]),
        "--draft",
        str(files["draft"]),
        "--method",
        "layer-skip",
        "--layer-skip-layers",
        "1",
        "--max-tokens",
        "4",
    ]
    result = cli.invoke(app, args)  # the first gguf test of a session also says it compiles the kernels
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.output
    assert errors[0].startswith("error: layer skip (layer_skip_layers=1) runs the first layers"), result.output
    assert errors[0].endswith("use --runner torch")


def test_layer_skip_with_zero_layers_is_refused_before_loading(files, nothing_loads):
    args = ["generate", "abc", "--target", str(files["target"]), "--method", "layer-skip", "--layer-skip-layers", "0"]
    one_line_error(cli.invoke(app, args), "nothing would draft")


def test_the_missing_layer_skip_hint_names_no_flag_serve_lacks():
    from verispec.engine.policy import drafter_order

    with pytest.raises(Exception) as caught:
        drafter_order("layer-skip", ["ngram", "suffix"])
    assert "--runner torch" in str(caught.value) and "--layer-skip-layers" not in str(caught.value)


def test_generate_help_says_what_auto_falls_back_to():
    result = cli.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    text = " ".join(result.output.split())
    assert "the faster of the EAGLE head and the draft model" in text
    assert "layer skip only on --runner torch without either" in text
    methods = (REPO / "docs" / "methods.md").read_text()
    assert "layer skip where it is loaded (`--runner torch`)" in " ".join(methods.split())


# --- item 8: prompts from stdin


def test_stdin_prompt_loses_the_newline_echo_adds(files, monkeypatch):
    prompts = []
    stream = SpeculativePipeline.stream

    def recording(self, prompt, *args, **kwargs):
        prompts.append(prompt)
        return stream(self, prompt, *args, **kwargs)

    monkeypatch.setattr(SpeculativePipeline, "stream", recording)
    base = ["generate", "--target", str(files["target"]), "--draft", str(files["draft"]), "--json", "--max-tokens", "6"]
    piped = cli.invoke(app, base, input="ab!c\n")
    given = cli.invoke(app, base[:1] + ["ab!c"] + base[1:])
    assert piped.exit_code == 0 and given.exit_code == 0, piped.output + given.output
    piped_data, given_data = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (piped, given))
    assert piped_data["metrics"]["prompt_tokens"] == given_data["metrics"]["prompt_tokens"]
    assert piped_data["token_ids"] == given_data["token_ids"]
    assert prompts == ["ab!c", "ab!c"]  # the tiny vocabulary has no newline token: the text itself is compared


@pytest.mark.parametrize("piped", ["\n", "", "\r\n"])
def test_an_empty_prompt_is_refused_before_loading(files, nothing_loads, piped):
    args = ["generate", "--target", str(files["target"]), "--draft", str(files["draft"])]
    result = cli.invoke(app, args, input=piped)
    one_line_error(result, "the prompt is empty")


def test_stdin_prompt_strips_one_newline_only():
    from verispec.cli.generate import stdin_prompt

    texts = ("def f():\n", "a\n\n", "a\r\n", "a", "  \n")
    assert [stdin_prompt(t) for t in texts] == ["def f():", "a\n", "a", "a", "  "]
