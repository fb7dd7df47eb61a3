"""``advise`` says when its sample is too small to decide, and what would do (issue 44, item 9);
its report goes to stdout, progress to stderr, as ``bench``'s does."""

import json
import math
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from verispec.bench.advise import Verdict
from verispec.bench.advise_sample import alpha_half_width, note_samples, sample_note, tokens_to_decide
from verispec.cli import app


def fit(alpha, tested, break_even, method="draft", category="all"):
    return SimpleNamespace(
        method=method, category=category, alpha=alpha, num_tested_tokens=tested, break_even_alpha=break_even
    )


@pytest.mark.parametrize(
    "alpha, tested, half",
    [
        (0.5, 100, 1.96 * 0.05),  # sqrt(.25 / 100) = .05
        (0.6, 8, 1.96 * math.sqrt(0.24 / 8)),  # advise --max-tokens 8: +-0.34
        (1.0, 8, 1.96 * math.sqrt((1 / 9) * (8 / 9) / 8)),  # all accepted is not a certainty
    ],
)
def test_alpha_half_width(alpha, tested, half):
    assert alpha_half_width(alpha, tested) == pytest.approx(half)


@pytest.mark.parametrize(
    "alpha, break_even, needed",
    [
        (0.5, 0.3, 25),  # 1.96^2 * .25 / .2^2 = 24.01
        (0.6, 0.3, 11),  # 1.96^2 * .24 / .09 = 10.24
        (0.5, 0.49, 385),  # a near tie is sized to tell them apart by 0.05: 1.96^2 * .25 / .0025
    ],
)
def test_tokens_to_decide(alpha, break_even, needed):
    assert tokens_to_decide(alpha, break_even) == needed


@pytest.mark.parametrize(
    "fits, num_prompts, per_limit, limit, max_tokens, expected",
    [
        # 8 new tokens, one prompt: prefill dominates and alpha +-0.34 straddles break-even
        (
            [fit(0.6, 8, 0.3)],
            1,
            1,
            1,
            8,
            "sample too small to decide: 8 new tokens a prompt, where prefill dominates the measured speedup; "
            "draft's α 0.60 ± 0.34 from 8 tested tokens straddles its break-even 0.30; try --limit 1 --max-tokens 64",
        ),
        # long enough answers, but alpha 0.40 +-0.10 from 96 tokens sits on break-even 0.35:
        # 1.96^2 * .24 / .05^2 = 369 tested tokens, 96 a prompt -> 4 prompts per category, 2 categories -> --limit 2
        (
            [fit(0.4, 96, 0.35)],
            1,
            2,
            1,
            64,
            "sample too small to decide: draft's α 0.40 ± 0.10 from 96 tested tokens straddles its break-even 0.35; "
            "try --limit 2 --max-tokens 64",
        ),
        ([fit(0.6, 400, 0.3)], 10, 1, 10, 64, ""),  # 0.60 +- 0.05, far from 0.30: decided
        ([fit(None, 0, None)], 1, 1, 1, 128, ""),  # never drafted: nothing to size
    ],
)
def test_sample_note(fits, num_prompts, per_limit, limit, max_tokens, expected):
    assert sample_note(fits, num_prompts, per_limit, limit, max_tokens) == expected


def test_note_samples_pools_every_prompt_for_all():
    verdicts = [Verdict("qa", "NO-GO", None, None, ""), Verdict("all", "NO-GO", None, None, "")]
    fits = [fit(0.6, 400, 0.3, category="qa"), fit(0.45, 40, 0.4, category="all")]
    note_samples(verdicts, fits, ["qa", "qa", "coding"], 64)
    assert verdicts[0].sample == ""
    # 1.96^2 * .2475 / .05^2 = 381 tested tokens at 40 per 3 prompts -> 29 prompts, 2 categories -> --limit 15
    assert verdicts[1].sample.endswith("try --limit 15 --max-tokens 64")


def test_cli_advise_report_is_on_stdout_and_says_the_sample_is_too_small(model_dirs):
    result = CliRunner().invoke(
        app,
        [
            "advise",
            "--prompts",
            str(model_dirs / "prompts.jsonl"),
            "--methods",
            "draft",
            "--limit",
            "1",
            "--max-tokens",
            "8",
            "--max-k",
            "2",
            "--target",
            str(model_dirs / "target"),
            "--draft",
            str(model_dirs / "draft"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "verdict per category" in result.stdout and "verdict per category" not in result.stderr
    assert "advise run" in result.stderr and "advise run" not in result.stdout  # progress stays on stderr
    assert "(sample too small)" in result.stdout
    assert "all: sample too small to decide: 8 new tokens a prompt" in " ".join(result.stdout.split())
    with_json = CliRunner().invoke(
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
    assert with_json.exit_code == 0, with_json.output
    advice = json.loads(with_json.stdout)  # the whole of stdout: the JSON; the report went to stderr
    assert advice["verdicts"][-1]["sample"].startswith("sample too small to decide: 8 new tokens a prompt")
    assert "verdict per category" in with_json.stderr


def test_cli_bench_report_is_on_stdout(model_dirs, tmp_path):
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
            "4",
            "--no-warmup",
            "--out",
            str(tmp_path),
            "--target",
            str(model_dirs / "target"),
            "--draft",
            str(model_dirs / "draft"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "all prompts" in result.stdout and "wrote " in result.stdout
    assert "bench run" in result.stderr and "bench run" not in result.stdout
