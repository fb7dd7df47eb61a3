"""verispec bench and advise on GGUF files: each measures the runner it is asked for, and bench
compares several runners in one run (results.json, report.md and the printed summary name the
kernels that ran). The GGUF files are the ``files`` of tests/cli/conftest.py, as in test_gguf_cli.py."""

from __future__ import annotations

import json

import pytest

from cli_support import cli
from helpers import single_thread
from verispec.cli import app
from verispec.runners.kernels import gguf_kernels, kernel_isa

pytestmark = pytest.mark.usefixtures("home")  # every test in a $VERISPEC_HOME of its own


def test_bench_and_advise_measure_the_runner_asked_for(files, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ab!c", "category": "code"}\n{"prompt": "!!ab", "category": "code"}\n')
    models = ["--target", str(files["target"]), "--draft", str(files["draft"])]
    out = tmp_path / "results"
    bench = cli.invoke(
        app,
        [
            "bench",
            "--prompts",
            str(prompts),
            "--methods",
            "none,draft,ngram",
            "--peers",
            "transformers",
            "--max-tokens",
            "8",
            "--no-warmup",
            "--out",
            str(out),
            *models,
        ],
    )
    assert bench.exit_code == 0, bench.output
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["runner"] == "gguf"  # the default, auto, on GGUF files
    assert data["exactness"]["all_equal"] is True
    skipped = [r["status"] for r in data["runners"] if r["family"] == "transformers"]
    assert skipped and all("holds no torch model" in status for status in skipped)  # said, not silently dropped
    exported = tmp_path / "vllm.json"
    advise = cli.invoke(
        app,
        [
            "advise",
            "--prompts",
            str(prompts),
            "--max-tokens",
            "8",
            "--max-k",
            "4",
            "--runner",
            "gguf",
            "--json",
            "--export",
            "vllm",
            "--export-file",
            str(exported),
            *models,
        ],
    )
    assert advise.exit_code == 0, advise.output
    advice = json.loads(advise.stdout.strip().splitlines()[-1])
    assert [v["category"] for v in advice["verdicts"]] == ["code", "all"]
    setup, overall = json.loads(exported.read_text()), advice["verdicts"][-1]
    assert setup["tool"] == "vllm" and setup["config"]["model"] == models[1]  # a local file is passed through
    spec = setup["config"]["speculative_config"]
    if overall["method"] is None:  # NO-GO: plain decoding
        assert spec is None
    else:
        assert spec["method"] == {"draft": "draft_model", "ngram": "ngram"}[overall["method"]]
        assert spec["num_speculative_tokens"] == overall["num_speculative_tokens"]
    assert "vllm serve" in advise.output
    bad = cli.invoke(app, ["advise", "--prompts", str(prompts), "--export", "tgi", *models])
    assert bad.exit_code == 2 and "--export must be one of vllm, sglang, transformers" in bad.output


def test_bench_compares_several_runners_in_one_run(files, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ab!c", "category": "code"}\n{"prompt": "!!ab", "category": "chat"}\n')
    out = tmp_path / "results"
    bench = cli.invoke(
        app,
        [
            "bench",
            "--prompts",
            str(prompts),
            "--runner",
            "gguf,int8,torch",
            "--methods",
            "none,draft",
            "--peers",
            "transformers",
            "--max-tokens",
            "8",
            "--no-warmup",
            "--curves",
            "--out",
            str(out),
            "--target",
            str(files["target"]),
            "--draft",
            str(files["draft"]),
        ],
    )
    assert bench.exit_code == 0, bench.output
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["runner"] == "gguf,int8,torch"
    names = {r["runner"] for r in data["records"]}
    assert {
        "gguf:none",
        "gguf:draft",
        "int8:none",
        "int8:draft",
        "torch:none",
        "torch:draft",
        "transformers:plain",
    } <= names
    assert data["exactness"]["all_equal"] is True  # every method equals plain decoding of its own runner
    statuses = {r["name"]: r["status"] for r in data["runners"]}
    assert statuses["transformers:plain"] == "ok"  # the peers run on the torch runner's model
    rows = {(r["runner"], r["category"]): r for r in data["summary"]}
    assert rows[("gguf:none", "all")]["speedup_vs_reference"] == 1.0  # the first runner's plain is the reference
    assert rows[("int8:none", "all")]["speedup"] == 1.0  # each against its own plain decoding
    assert set(data["memory"]["by_runner"]) == {"gguf", "int8", "torch"}
    assert {m["runner"] for m in data["models"]} == {"gguf", "int8", "torch"}
    for kind in ("gguf", "int8", "torch"):
        curve = data["curves"][kind]
        assert set(curve["target"]) == {"1", "2", "4", "8", "16"} and all(v > 0 for v in curve["target"].values())
        assert list(curve["draft"]) == ["1"]
    report = (out / "report.md").read_text()
    assert "## Cost of one target pass" in report and "| gguf |" in report
    from verispec.runners.cpu.int8_ops import default_kernel

    assert {(r["family"], r["kernel_isa"]) for r in data["records"]} == {
        ("gguf", kernel_isa()),
        ("int8", None),
        ("torch", None),
        ("transformers", None),
    }  # each gguf record names its path
    assert (data["environment"]["kernel_isa"], data["environment"]["int8_kernel"]) == (kernel_isa(), default_kernel())
    assert data["environment"]["cpu_features"] == gguf_kernels().cpu_features()
    assert f"gguf kernels {kernel_isa()}" in report.splitlines()[2]  # the header line of report.md
    assert f"gguf kernels {kernel_isa()}" in bench.output  # and of the printed summary
    twice = cli.invoke(
        app,
        [
            "bench",
            "--prompts",
            str(prompts),
            "--runner",
            "gguf,auto",
            "--peers",
            "none",
            "--target",
            str(files["target"]),
            "--draft",
            str(files["draft"]),
        ],
    )
    assert twice.exit_code == 2 and "gguf runner twice" in twice.output
    unknown = cli.invoke(
        app, ["bench", "--prompts", str(prompts), "--runner", "gguf,vllm", "--target", str(files["target"])]
    )
    assert unknown.exit_code == 2 and "unknown runner vllm" in unknown.output


def test_a_sampled_coupled_bench_checks_every_method_against_plain(files, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ab!c", "category": "code"}\n{"prompt": "!!ab", "category": "chat"}\n')
    out = tmp_path / "results"
    common = ["bench", "--prompts", str(prompts), "--methods", "none,draft,ngram,auto", "--peers", "none"]
    common += ["--max-tokens", "12", "--no-warmup", "--temperature", "0.9", "--seed", "5"]
    common += ["--target", str(files["target"]), "--draft", str(files["draft"])]
    bench = cli.invoke(app, [*common, "--out", str(out)])
    assert bench.exit_code == 0, bench.output
    data = json.loads((out / "results.json").read_text())
    assert data["exactness"] == {"greedy": False, "compared": True, "all_equal": True, "mismatches": []}
    marks = {
        r["runner"]: r["matches_plain"] for r in data["records"] if r["prompt_id"] == data["records"][0]["prompt_id"]
    }
    assert marks == {"gguf:none": None, "gguf:draft": True, "gguf:ngram": True, "gguf:auto": True}
    assert "sampled tokens (coupled, same seed) equal plain decoding" in " ".join(bench.output.split())
    rejection = cli.invoke(app, [*common, "--sampling", "rejection", "--out", str(tmp_path / "rejection")])
    assert rejection.exit_code == 0, rejection.output
    data = json.loads((tmp_path / "rejection" / "results.json").read_text())
    assert data["exactness"]["compared"] is False  # the text depends on the drafter: nothing to compare


def test_bench_refuses_unknown_methods_before_loading_and_says_what_loads_a_drafter(files, tmp_path, monkeypatch):
    from verispec.bench import command

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ab!c"}\n')
    models = ["--prompts", str(prompts), "--target", str(files["target"]), "--draft", "none", "--max-tokens", "4"]
    load = command.load_pipelines

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded the models before checking --methods and --peers")

    monkeypatch.setattr(command, "load_pipelines", no_loading)
    for option, message in [
        (["--methods", "none,foo"], "error: unknown method foo; choose from none, auto, suffix, ngram"),
        (["--peers", "bar"], "error: unknown peer bar; choose from transformers"),
    ]:
        result = cli.invoke(app, ["bench", *models, *option])
        assert result.exit_code == 2 and result.output.startswith(message), result.output
    monkeypatch.setattr(command, "load_pipelines", load)
    for command_name in ("bench", "advise"):
        result = cli.invoke(app, [command_name, *models, "--methods", "eagle,draft"])
        lines = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert "method eagle, draft needs a drafter the gguf runner did not load" in lines[0]
        assert lines[0].endswith(
            "; load a head with --eagle-head (a file verispec train-head writes, or a published EAGLE-3 folder); "
            "load a draft model with --draft"
        )
