"""`verispec generate --method ngram|layer-skip|draft|auto` on tiny local checkpoints."""

import json

import pytest
from typer.testing import CliRunner

from helpers import perturbed_copy, single_thread, tiny_qwen2
from server_support import build_tokenizer, save_checkpoint
from verispec.cli import app

runner = CliRunner()
PROMPT = "def f(x): return x\ndef f(x): return x\ndef f(x):"  # repeats: n-gram lookup matches


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-methods")
    tokenizer = build_tokenizer()  # byte-level BPE, like Qwen's
    target = tiny_qwen2(seed=0, vocab_size=len(tokenizer))
    return {
        "target": save_checkpoint(root / "target", target, tokenizer),
        "draft": save_checkpoint(root / "draft", perturbed_copy(target, noise=0.3, seed=2), tokenizer),
    }


def run(checkpoints, *extra, expect=0):
    args = ["generate", PROMPT, "--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"])]
    result = runner.invoke(app, args + ["--json", "--max-tokens", "20", "--layer-skip-layers", "1", *extra])
    assert result.exit_code == expect, result.output
    return json.loads(result.stdout.strip().splitlines()[-1]) if expect == 0 else result.output


@pytest.mark.parametrize(
    "extra",
    [
        ["--method", "draft"],
        ["--method", "ngram", "--min-ngram", "1"],
        ["--method", "layer-skip", "--schedule", "heuristic"],
        ["--method", "auto"],  # the default method and schedule (cost)
        ["--method", "auto", "--draft", "none"],  # n-gram backed up by layer skip
        ["--method", "draft", "--draft-quantization", "int8", "--runner", "torch", "--schedule", "constant", "-k", "3"],
        ["--method", "draft", "--draft-stop-threshold", "0.5"],
    ],
)
def test_every_method_gives_plain_decodings_tokens(checkpoints, extra):
    plain = run(checkpoints, "--method", "none")
    out = run(checkpoints, *extra)
    assert out["token_ids"] == plain["token_ids"] and len(out["token_sources"]) == len(out["token_ids"])
    spec = out["metrics"]["spec"]
    assert sum(d["num_drafts"] for d in spec["per_drafter"].values()) == spec["num_drafts"]
    assert "chosen_k_histogram" in spec and "predicted_speedup" in spec


def test_auto_is_the_default_and_reports_per_drafter_stats(checkpoints):
    result = runner.invoke(
        app,
        [
            "generate",
            PROMPT,
            "--target",
            str(checkpoints["target"]),
            "--draft",
            str(checkpoints["draft"]),
            "--max-tokens",
            "12",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "method=auto" in result.output and "chosen k histogram" in result.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--schedule", "magic"], "unknown schedule"),
        (["--draft-stop-threshold", "1.5"], "draft_stop_threshold"),
        (["--draft-quantization", "int3"], "unknown draft quantization"),
        (["--min-ngram", "3", "--max-ngram", "2"], "min_ngram"),
        (["--method", "draft", "--draft", "none"], "needs its drafter"),
    ],
)
def test_bad_drafter_options_exit_2(checkpoints, extra, message):
    output = run(checkpoints, *extra, expect=2)
    assert "error:" in output and message in output and "Traceback" not in output
