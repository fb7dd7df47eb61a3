"""The first run on GGUF files: auto picks the gguf runner, --compare-plain, what the stats report,
an incompatible draft refused before any weight is read, int8 read straight from the GGUF, help text.
bench and advise over the same files are tests/cli/test_gguf_bench_cli.py's."""

import re

import gguf
import pytest
import torch

from cli_support import cli, generate_json
from helpers import TESTS, single_thread
from verispec.cli import app
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.kernels import gguf_kernels, kernel_isa

pytestmark = pytest.mark.usefixtures("home")  # every test in a $VERISPEC_HOME of its own


def test_compare_plain_measures_both_and_checks_the_tokens(files):
    data = generate_json(files, "--method", "draft", "-k", "4", "--compare-plain")
    assert data["runner"] == "gguf"  # auto: a CPU and GGUF files the gguf runner supports
    comparison = data["compare_plain"]
    assert comparison["identical"] is True
    assert comparison["plain_decode_tokens_per_s"] > 0 and comparison["speculative_decode_tokens_per_s"] > 0
    assert comparison["measured_speedup"] == pytest.approx(
        comparison["speculative_decode_tokens_per_s"] / comparison["plain_decode_tokens_per_s"]
    )


@pytest.mark.parametrize(
    "sampling, expected",
    [
        (["--seed", "3"], True),  # coupled (the default): a seed gives plain decoding's tokens, so they are compared
        (["--seed", "3", "--sampling", "rejection"], None),  # the draws depend on the drafts: not comparable
        ([], None),  # no seed: each run draws its own
    ],
)
def test_sampling_comparison_compares_the_tokens_only_where_a_seed_fixes_them(files, sampling, expected):
    data = generate_json(files, "--method", "draft", "--temperature", "0.8", "--compare-plain", *sampling)
    assert data["compare_plain"]["identical"] is expected


def test_models_report_the_runner_load_time_and_held_bytes(files):
    from verispec.runners.cpu.gguf_weights import GGUFWeights

    data = generate_json(files, "--method", "none")
    target = data["models"][0]
    held = GGUFWeights.from_file(files["target"], 512).nbytes()  # RoPE tables for the context length, 512
    assert target["param_bytes"] == held != files["target"].stat().st_size  # packed blocks, not the file
    assert target["load_time_s"] > 0


def test_stats_table_labels_the_speedup_an_estimate(files):
    args = [
        "generate",
        "ab!c",
        "--target",
        str(files["target"]),
        "--draft",
        str(files["draft"]),
        "--max-tokens",
        "12",
        "--method",
        "draft",
    ]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "speedup estimate" in result.output and "realised speedup" not in result.output
    # the path that ran
    line = rf"loaded target target\.gguf \(gguf runner, {kernel_isa()} kernels, [0-9.]+ GiB\) in \d+\.\d s"
    assert re.search(line, " ".join(result.output.split()))


def test_incompatible_draft_is_refused_before_any_weight_is_read(files, monkeypatch):
    from verispec.runners.cpu import gguf_weights

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the tokenizer check")

    monkeypatch.setattr(gguf_weights.GGUFWeights, "from_file", no_weights)
    result = cli.invoke(
        app, ["generate", "ab", "--target", str(files["target"]), "--draft", str(files["other"]), "--max-tokens", "4"]
    )
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "Traceback" not in result.output


def test_help_names_the_llamacpp_extra():
    result = cli.invoke(app, ["generate", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "llamacpp extra" in text and "needs verispec" not in text


def test_skip_reasons_name_commands_that_exist():
    import typer.main

    root = typer.main.get_command(app)
    paths = sorted(TESTS.rglob("*.py"))
    assert len(paths) > 90  # every test folder, not only this one
    for path in paths:
        for words in re.findall(r"reason=[^\n]*?\(verispec ([a-z][a-z -]*)", path.read_text()):
            command = root
            for word in words.split()[:2]:  # "models fetch": a group and its command
                if not hasattr(command, "commands"):
                    break
                assert word in command.commands, f"{path.name}: a skip reason names 'verispec {words}'"
                command = command.commands[word]


@pytest.mark.parametrize("name", ["target", "llama"])
def test_int8_runner_reads_the_gguf_directly(files, name):
    from verispec.models.gguf_file import read_gguf_header
    from verispec.runners.cpu.gguf_runner import GGUFRunner
    from verispec.runners.cpu.gguf_weights import GGUFLoader
    from verispec.runners.cpu.int8_gguf import int8_weights_from_gguf
    from verispec.runners.cpu.int8_ops import quantize_weight_rows

    int8 = Int8Runner(int8_weights_from_gguf(files[name], 256), max_context_length=256)
    # the kernels' one-pass re-quantization equals quantize_weight_rows of the de-quantized rows
    loader = GGUFLoader(read_gguf_header(files[name]))
    raw, info = loader.rows("blk.0.ffn_down.weight", 512)
    expected = quantize_weight_rows(torch.from_numpy(gguf.quants.dequantize(raw.numpy(), info.qtype)))
    got = gguf_kernels().requantize_int8(raw.contiguous().view(-1), info.qtype, raw.shape[0], 512)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    int8_logits = int8.forward(prompt)
    gguf_logits = GGUFRunner.from_file(files[name], max_context_length=256).forward(prompt)
    assert (int8_logits - gguf_logits).abs().max() <= 0.05 * gguf_logits.abs().max()  # two quantizations of one model
    int8.truncate(len(prompt) - 4)
    rows = torch.cat([int8.forward([t]) for t in prompt[-4:]])
    assert torch.equal(rows, int8_logits[-4:])  # batch-invariant, read from the GGUF as from torch


def test_int8_head_from_the_gguf_in_row_ranges(files, monkeypatch):
    """The int8 LM head is re-quantized and packed range by range (to bound peak memory): the
    logits equal one whole-matrix head's, and a reduced (FR-Spec) head keeps exactly its rows."""
    from verispec.errors import InvalidParameterError
    from verispec.runners.cpu import int8_gguf
    from verispec.runners.cpu.int8_gguf import int8_weights_from_gguf

    prompt = [11, 12, 13, 14, 15]
    whole = Int8Runner(int8_weights_from_gguf(files["target"], 64), max_context_length=64).forward(prompt)
    monkeypatch.setattr(int8_gguf.RowChunks, "CHUNK_ROWS", 7)  # several ranges, the last one short
    weights = int8_weights_from_gguf(files["target"], 64)
    assert len(weights.lm_head.parts) > 2
    assert torch.equal(Int8Runner(weights, max_context_length=64).forward(prompt), whole)
    kept = torch.tensor([0, 3, 6, 7, 8, 20, 21])
    reduced = Int8Runner(
        int8_weights_from_gguf(files["target"], 64, head_token_ids=kept), max_context_length=64
    ).forward(prompt)
    assert torch.equal(reduced[:, kept], whole[:, kept])
    with pytest.raises(InvalidParameterError, match="strictly increasing"):
        int8_weights_from_gguf(files["target"], 64, head_token_ids=torch.tensor([3, 1]))


def test_files_with_one_tokenizer_share_one_tokenizer_object(files, tmp_path):
    from verispec.models.gguf_file import read_gguf_header
    from verispec.models.gguf_tokenizer import cached_tokenizer

    target, again, draft = (cached_tokenizer(read_gguf_header(files[n])) for n in ("target", "target", "draft"))
    assert target is again is draft  # same tokenizer digest: built (or loaded) once per process
    elsewhere = cached_tokenizer(read_gguf_header(files["target"]), tmp_path / "other-cache")
    assert elsewhere is not target and elsewhere.get_vocab() == target.get_vocab()


def test_int8_gguf_path_through_the_pipeline(files):
    from verispec.runners.cpu.int8_ops import default_kernel

    data = generate_json(files, "--method", "draft", "--runner", "int8", "--compare-plain")
    assert data["runner"] == "int8" and data["compare_plain"]["identical"] is True
    assert data["int8_kernel"] == default_kernel() and "kernel_isa" not in data  # int8's product; no gguf kernels ran


def test_auto_falls_back_when_the_kernels_cannot_build(files, monkeypatch, capsys):
    from verispec.errors import InvalidParameterError
    from verispec.runners import kernels, notices
    from verispec.runners.choice import ModelFile, ModelFiles, choose_runner

    def no_compiler():
        raise InvalidParameterError("the gguf runner compiles its kernels once, and no C++ compiler ('c++') was found")

    pair = ModelFiles(ModelFile("target", files["target"]), ModelFile("draft", files["draft"]))
    monkeypatch.setattr(kernels, "gguf_kernels", no_compiler)
    monkeypatch.setattr(notices, "_SAID", set())
    choice = choose_runner("auto", pair)
    assert choice.kind != "gguf" and "no C++ compiler" in choice.reasons[0]
    choice.say()
    assert "no C++ compiler" in capsys.readouterr().err  # said, not a silent change of runner
    monkeypatch.undo()
    assert choose_runner("auto", pair).kind == "gguf"


def test_int8_cache_gives_the_same_weights_and_skips_requantizing(files, tmp_path, monkeypatch):
    """The second load reads the int8 matrices from the cache (re-quantizing is made to fail) and
    gives bit-identical logits; a reduced head is cut from the cached full head; a cache that does
    not match its index, or a changed GGUF file, is re-quantized."""
    import json
    import os
    import shutil

    from verispec.models.cache_files import read_checked
    from verispec.runners.cpu import int8_gguf
    from verispec.runners.cpu.int8_gguf import int8_weights_from_gguf

    model = tmp_path / "model.gguf"
    shutil.copy(files["target"], model)
    cache = tmp_path / "int8"
    prompt = [11, 12, 13, 14, 15]
    first = Int8Runner(int8_weights_from_gguf(model, 64, cache_dir=cache), max_context_length=64).forward(prompt)
    assert torch.equal(first, Int8Runner(int8_weights_from_gguf(model, 64), max_context_length=64).forward(prompt))
    (data,) = cache.glob("model-int8-*.bin")
    assert data.with_suffix(".json").is_file() and not list(cache.glob("*.tmp*"))

    class NoRequantize:
        def __getattr__(self, name):
            if name == "requantize_int8":
                raise AssertionError("re-quantized although the cache holds the matrices")
            return getattr(gguf_kernels(), name)

    with monkeypatch.context() as patched:
        patched.setattr(int8_gguf, "loaded_kernels", lambda: NoRequantize())
        cached = Int8Runner(int8_weights_from_gguf(model, 64, cache_dir=cache), max_context_length=64)
        assert torch.equal(cached.forward(prompt), first)
        kept = torch.tensor([0, 3, 6, 7, 8, 20, 21])
        reduced = Int8Runner(
            int8_weights_from_gguf(model, 64, head_token_ids=kept, cache_dir=cache), max_context_length=64
        )
        assert torch.equal(reduced.forward(prompt)[:, kept], first[:, kept])
    with open(data, "r+b") as f:  # truncated: the index no longer matches, so it is rewritten
        f.truncate(data.stat().st_size - 1)
    assert torch.equal(
        Int8Runner(int8_weights_from_gguf(model, 64, cache_dir=cache), max_context_length=64).forward(prompt), first
    )
    entries = json.loads(read_checked(data.with_suffix(".json"), "verispec-weights/1"))["matrices"].values()
    assert data.stat().st_size == sum(a["nbytes"] for arrays in entries for a in arrays)  # whole again
    os.utime(model, ns=(0, 0))  # a changed file: a new cache replaces the old one
    Int8Runner(int8_weights_from_gguf(model, 64, cache_dir=cache), max_context_length=64)
    (renewed,) = cache.glob("model-int8-*.bin")
    assert renewed != data


def test_an_unwritable_weight_cache_only_costs_time(files, tmp_path, capsys):
    from verispec.runners.cpu.int8_gguf import int8_weights_from_gguf

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    prompt = [11, 12, 13]
    logits = Int8Runner(int8_weights_from_gguf(files["target"], 64, cache_dir=blocked), max_context_length=64).forward(
        prompt
    )
    assert torch.equal(
        logits, Int8Runner(int8_weights_from_gguf(files["target"], 64), max_context_length=64).forward(prompt)
    )
    assert "not caching derived weights" in capsys.readouterr().err and blocked.read_text() == ""


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--draft", "none", "--draft-vocab", "16"], "they need --draft MODEL"),  # no draft model: was ignored
        (["--method", "ngram", "--draft-vocab", "16"], "they need --draft MODEL"),  # the draft is not loaded
        (["--draft-vocab-corpus", "README.md"], "give --draft-vocab"),  # a corpus without a size: was ignored
    ],
)
def test_a_reduced_draft_vocabulary_without_its_draft_model_is_refused(files, extra, message):
    args = ["generate", "ab!c", "--target", str(files["target"]), "--draft", str(files["draft"]), "--max-tokens", "4"]
    result = cli.invoke(app, args + extra)
    assert result.exit_code == 2 and result.output.startswith("error: --draft-vocab") and message in result.output
    assert "loaded" not in result.output  # refused before loading


def test_a_reduced_draft_vocabulary_with_its_draft_model_runs(files):
    data = generate_json(files, "--method", "draft", "--draft-vocab", "48", "--compare-plain")
    assert data["compare_plain"]["identical"] is True
