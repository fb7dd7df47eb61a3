"""What a user is told about the kernels: the path that ran (--json, the cost cache, bench),
and the plain warning, said once, where the gguf kernels would run on their portable path."""

import json

import pytest
from typer.testing import CliRunner

from cli_support import generate_json
from gguf_models import MIXED, perturbed_copy, write_gguf_model
from verispec.cli import app
from verispec.models.cache_files import read_checked
from verispec.runners.kernels import build_key, gguf_kernels, kernel_isa

cli = CliRunner()
pytestmark = pytest.mark.usefixtures("home")  # every test in a $VERISPEC_HOME of its own


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kernel-notices")
    target = write_gguf_model(directory / "target.gguf", MIXED)
    return {"target": target, "draft": perturbed_copy(target, directory / "draft.gguf", "output.weight", 0.3)}


def test_json_and_the_cost_cache_name_the_kernel_path(files, home, monkeypatch):
    from verispec.runners import notices

    data = generate_json(files, "--method", "none")
    assert (data["runner"], data["kernel_isa"], data["cpu_features"]) == (
        "gguf",
        kernel_isa(),
        gguf_kernels().cpu_features(),
    )
    best = kernel_isa()
    monkeypatch.setenv("VERISPEC_KERNEL_ISA", "portable")  # a slow host, simulated: the same bits, slowly
    monkeypatch.setattr(notices, "_SAID", set())
    args = [
        "generate",
        "ab!c",
        "--target",
        str(files["target"]),
        "--draft",
        str(files["draft"]),
        "--json",
        "--max-tokens",
        "8",
        "--runner",
        "gguf",
        "--method",
        "draft",
    ]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["kernel_isa"] == "portable"
    assert result.output.count("portable path") == 1 and "use --runner llamacpp" in result.output  # said once, plainly
    (costs,) = (home / "costs").glob("*.json")
    measured = {runner for entry in json.loads(read_checked(costs, "verispec-costs/1")).values() for runner in entry}
    build = build_key()
    assert measured == {f"gguf:{best}@{build}", f"gguf:portable@{build}"}  # one curve per kernel path (and build)


@pytest.mark.parametrize(
    "installed, chosen, advice",
    [
        (
            True,
            "llamacpp",
            "--runner auto uses llama.cpp instead",
        ),  # the faster runner is there: auto takes it, says why
        (False, "gguf", "use --runner llamacpp"),  # nothing faster installed: gguf, and the way to something faster
    ],
)
def test_auto_prefers_llama_cpp_to_the_portable_path(files, monkeypatch, capsys, installed, chosen, advice):
    from verispec.runners import llamacpp, notices
    from verispec.runners.choice import ModelFile, ModelFiles, choose_runner

    pair = ModelFiles(ModelFile("target", files["target"]), ModelFile("draft", files["draft"]))
    monkeypatch.setattr(notices, "_SAID", set())
    monkeypatch.setattr(llamacpp, "llama_cpp_available", lambda: installed)
    assert choose_runner("auto", pair).kind == "gguf"  # the CPU's best path: gguf, whatever is installed
    monkeypatch.setenv("VERISPEC_KERNEL_ISA", "portable")
    choice = choose_runner("auto", pair)
    assert choice.kind == chosen and choice.isa == ("portable" if chosen == "gguf" else None)
    assert "portable path" in choice.reasons[-1]
    choice.say()
    choose_runner("auto", pair).say()
    err = capsys.readouterr().err
    assert err.count("portable path") == 1 and advice in err


class PortableOnly:
    """The kernels as a CPU without AVX2, AVX-512 or NEON reports them."""

    def best_isa(self):
        return "portable"

    def supported_isas(self):
        return ["portable"]

    def cpu_features(self):
        return "sse4_2"


@pytest.mark.parametrize(
    "installed, advice",
    [
        (False, "use --runner llamacpp (pip install 'verispec[llamacpp]') or a CPU with AVX2 or NEON"),
        (True, "use --runner llamacpp (faster here, not token-identical under speculation)"),
    ],
)
def test_a_cpu_without_vector_kernels_is_told_what_is_faster(monkeypatch, installed, advice):
    from verispec.runners import kernels
    from verispec.runners.choice import kernel_facts
    from verispec.runners.notices import portable_gguf_warning, runner_label

    monkeypatch.setattr(kernels, "gguf_kernels", PortableOnly)
    monkeypatch.setattr(kernels, "_RESOLVED", {})
    monkeypatch.delenv("VERISPEC_KERNEL_ISA", raising=False)
    warning = portable_gguf_warning(llama_cpp_installed=installed)
    assert warning.startswith(
        "this CPU (features: sse4_2) runs the gguf kernels on their portable path, about 9x slower"
    )
    assert warning.endswith(advice)
    assert runner_label("gguf", kernel_facts("gguf")) == "gguf runner, portable kernels"


def test_bench_names_the_kernel_path_and_times_a_prefill(files):
    from rich.console import Console

    from verispec.bench.command import load_pipelines, run_and_report
    from verispec.bench.results import BenchResults
    from verispec.bench.run import BenchConfig
    from verispec.bench.workload import WorkloadItem

    console = Console(stderr=True, quiet=True)
    pipes, rss = load_pipelines(str(files["target"]), str(files["draft"]), "float32", console, ["gguf"])
    config = BenchConfig(methods=("none", "draft"), peers=(), max_tokens=4, warmup=False)
    results = run_and_report(
        pipes,
        [WorkloadItem("p0", "code", "ab!c", False)],
        config,
        None,
        workload="t",
        dtype="float32",
        rss=rss,
        console=console,
        prefill_tokens=(6,),
    )
    assert (results.environment["kernel_isa"], results.environment["cpu_features"]) == (
        kernel_isa(),
        gguf_kernels().cpu_features(),
    )
    assert sorted(results.prefill) == ["gguf"] and results.prefill["gguf"][6]["tokens_per_s"] > 0
    assert pipes["gguf"].target_runner.num_cached_tokens == 0  # the prefill leaves the cache empty
    assert BenchResults.from_dict(results.to_dict()).prefill == results.prefill
