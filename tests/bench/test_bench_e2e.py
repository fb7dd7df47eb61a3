"""End to end on tiny models: bench (injected pipeline and CLI), results.json round trip, advise,
and the audit of ``generate``. Every file the issue asks for must come out."""

import json

import pytest
from typer.testing import CliRunner

from bench_support import PROMPTS
from server_support import tiny_pipeline
from verispec.bench.command import REPORT_FILE, RESULTS_FILE, run_and_report
from verispec.bench.plots import PLOT_FILES
from verispec.bench.results import SCHEMA_VERSION, BenchResults, ResultsFormatError, read_results
from verispec.bench.run import BenchConfig
from verispec.bench.workload import parse_jsonl
from verispec.cli import app
from verispec.runners.notices import int8_warning

TOP_KEYS = {
    "schema",
    "schema_version",
    "created_at",
    "output_bucket_tokens",
    "config",
    "environment",
    "models",
    "memory",
    "runners",
    "records",
    "summary",
    "exactness",
    "audit",
    "plots",
    "curves",
    "prefill",
    "quality",
}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    items = parse_jsonl([json.dumps(p) for p in PROMPTS])
    config = BenchConfig(
        methods=("none", "draft", "ngram"), peers=("transformers", "llama.cpp"), max_tokens=16, audit_rate=1.0
    )
    results = run_and_report(tiny_pipeline(), items, config, out, workload="tiny", dtype="float32")
    return out, results


def test_bench_writes_every_file(bench_run):
    out, _ = bench_run
    for name in [RESULTS_FILE, REPORT_FILE, *PLOT_FILES.values()]:
        assert (out / name).stat().st_size > 0, name
    report = (out / REPORT_FILE).read_text()
    assert "![speedup_by_category](speedup_by_category.png)" in report
    assert "| runner | greeting (1) | chat (1) | all (2) |" in report
    assert "| torch:none | " in report and " tok/s |" in report  # plain rows show their rate


def test_results_json_has_the_documented_keys_and_sane_values(bench_run):
    out, _ = bench_run
    data = json.loads((out / RESULTS_FILE).read_text())
    assert set(data) == TOP_KEYS
    assert (data["schema"], data["schema_version"]) == ("verispec.bench", SCHEMA_VERSION)
    runners = {r["name"]: r["status"] for r in data["runners"]}
    assert runners["torch:draft"] == runners["transformers:assisted"] == "ok"
    assert runners["llama.cpp:plain"].startswith(("skipped", "not installed"))  # tiny models are no GGUF
    assert len(data["records"]) == 2 * 6  # 2 prompts x (3 verispec + 3 transformers)
    assert data["exactness"] == {"greedy": True, "compared": True, "all_equal": True, "mismatches": []}
    for record in data["records"]:
        assert 1 <= record["output_tokens"] <= 16 and record["total_tokens_per_s"] > 0
        if record["method"] not in ("none", "plain"):
            assert record["matches_plain"] is True
        if record["family"] == "transformers":  # same models, same greedy rule: same tokens as verispec
            assert record["matches_reference"] is True
    rows = {(r["runner"], r["category"]): r for r in data["summary"]}
    assert set(c for _, c in rows) == {"greeting", "chat", "all"}
    assert rows[("torch:none", "all")]["speedup"] == pytest.approx(1.0)
    draft = rows[("torch:draft", "all")]
    assert 0 < draft["acceptance_rate"] < 1  # the tiny draft disagrees sometimes
    assert 1 < draft["mean_acceptance_length"] <= 6
    assert draft["exact_checked"] == draft["exact_equal"] == 2
    assert data["audit"]["audited"] == 4 and data["audit"]["agreed"] == 4  # 2 prompts x 2 speculative methods
    assert data["memory"]["draft_overhead_pct"] == pytest.approx(100.0)  # the tiny draft is the target's size
    assert data["config"]["methods"] == ["none", "draft", "ngram"]


def test_results_round_trip(bench_run, tmp_path):
    out, results = bench_run
    again = read_results(out / RESULTS_FILE)
    assert again.to_dict() == json.loads(json.dumps(results.to_dict()))
    newer = results.to_dict() | {"schema_version": SCHEMA_VERSION + 1}
    with pytest.raises(ResultsFormatError, match="version"):
        BenchResults.from_dict(newer)
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ResultsFormatError, match="not JSON"):
        read_results(tmp_path / "x.json")


def test_cli_bench_and_advise(model_dirs, tmp_path):
    runner = CliRunner()
    models = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    out = tmp_path / "results"
    bench = runner.invoke(
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
            "--out",
            str(out),
            *models,
        ],
    )
    assert bench.exit_code == 0, bench.output
    data = json.loads((out / RESULTS_FILE).read_text())
    # auto on a CPU: the int8 runner where its kernel is exact (AVX-512 VNNI), else the torch runner (said once)
    kind = "int8" if int8_warning(auto=True) is None else "torch"
    assert {r["runner"] for r in data["records"]} == {f"{kind}:none", f"{kind}:draft"}
    assert data["memory"]["rss_after_draft_bytes"] is not None
    advise = runner.invoke(
        app,
        [
            "advise",
            "--prompts",
            str(model_dirs / "prompts.jsonl"),
            "--max-tokens",
            "8",
            "--max-k",
            "4",
            "--memory-budget",
            "1",
            "--gpu-cost-per-month",
            "1000",
            "--json",
            *models,
        ],
    )
    assert advise.exit_code == 0, advise.output
    advice = json.loads(advise.stdout.strip().splitlines()[-1])
    assert [v["category"] for v in advice["verdicts"]] == ["greeting", "chat", "all"]
    assert all(v["decision"] in ("GO", "GO with n-gram only", "NO-GO") for v in advice["verdicts"])
    assert advice["memory"]["fits"] is True and advice["cost"]["before_per_million_tokens"] > 0
    assert {row["k"] for row in advice["table"]} == {1, 2, 3, 4}
    # measured at the fixed draft length the predictions assume: the draft model drafted every step
    (draft_fit,) = [f for f in advice["fits"] if f["method"] == "draft" and f["category"] == "all"]
    assert draft_fit["coverage"] == pytest.approx(0.8)  # 4 of 5 steps: the last had no room to draft


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "nope"], "unknown workload"),
        (["--methods", "teleport"], "unknown method"),
        (["--peers", "vllm"], "unknown peer"),
    ],
)
def test_cli_bench_user_errors_exit_2(model_dirs, args, message, tmp_path):
    models = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    workload = [] if "--workload" in args else ["--prompts", str(prompts)]  # no dependence on ../shared
    result = CliRunner().invoke(app, ["bench", *args, *workload, *models])
    assert result.exit_code == 2 and message in result.output


def test_cli_generate_audits_after_the_response(model_dirs):
    models = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    result = CliRunner().invoke(
        app, ["generate", "Hello", "--method", "draft", "--max-tokens", "8", "--audit-rate", "1", *models]
    )
    assert result.exit_code == 0, result.output
    assert "audit: output equals plain decoding token for token" in result.output
    assert result.output.index("verispec · method") < result.output.index("audit:")  # stats (after the text) first
