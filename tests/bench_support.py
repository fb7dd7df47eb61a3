"""Synthetic benchmark records (``tests/bench/test_bench_figures.py``, ``test_bench_plots.py``): a
run's per-prompt record and the speculative statistics it carries; the end-to-end tests' two
prompts (``tests/bench/test_bench_e2e.py``; ``model_dirs`` of ``tests/bench/conftest.py``)."""

from verispec.bench.records import RunRecord

PROMPTS = [
    {"prompt": "Hello 你好", "category": "greeting"},
    {"turns": ["世界é!"], "category": "chat"},
]


def record(runner, prompt, tps, category="c", spec=None, tokens=(1, 2, 3), forwards=3, decode=None):
    family, method = runner.split(":")
    return RunRecord(
        prompt_id=prompt,
        category=category,
        runner=runner,
        family=family,
        method=method,
        prompt_tokens=5,
        output_tokens=len(tokens),
        finish_reason="length",
        ttft_ms=10.0,
        tpot_ms=5.0,
        decode_tokens_per_s=decode if decode is not None else tps,
        total_tokens_per_s=tps,
        e2e_ms=100.0,
        draft_ms=0.0,
        target_ms=90.0,
        num_target_forwards=forwards,
        spec=spec or {},
        token_ids=list(tokens),
    )


def spec(drafts, drafted, accepted, per_position, by_bucket):
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "num_bonus_tokens": 0,
        "num_recovered_tokens": drafts,
        "accepted_per_position": per_position[0],
        "drafted_per_position": per_position[1],
        "accepted_length_histogram": [],
        "accepted_by_output_bucket": by_bucket[0],
        "drafted_by_output_bucket": by_bucket[1],
    }
