"""The benchmark's arithmetic on synthetic per-prompt records."""

import math

import pytest

from bench_support import record, spec
from verispec.bench.figures import ALL, geometric_mean, mean, per_prompt_speedups, percent, ratios, summarize
from verispec.bench.records import mark_exactness
from verispec.bench.results import exactness


@pytest.mark.parametrize(
    "values, expected",
    [
        ([2.0, 8.0], 4.0),  # sqrt(16)
        ([1.0, 1.0, 1.0], 1.0),
        ([0.5, 2.0], 1.0),  # a 2x slowdown and a 2x speedup cancel
        ([3.0], 3.0),
        ([], None),
    ],
)
def test_geometric_mean(values, expected):
    assert geometric_mean(values) == (pytest.approx(expected) if expected is not None else None)


def test_geometric_mean_rejects_non_positive():
    with pytest.raises(ValueError):
        geometric_mean([1.0, 0.0])


@pytest.mark.parametrize(
    "part, whole, expected",
    [(1, 4, 25.0), (494, 1117, 100 * 494 / 1117), (3, 0, None), (0, 5, 0.0)],  # draft overhead style
)
def test_percent(part, whole, expected):
    assert percent(part, whole) == (pytest.approx(expected) if expected is not None else None)


def test_mean_and_ratios_skip_missing():
    assert mean([1.0, None, 3.0]) == 2.0 and mean([None]) is None
    assert ratios([1, 0, 3], [2, 0, 4]) == [0.5, None, 0.75]


RECORDS = [
    record("verispec:none", "p1", 10.0),
    record("verispec:draft", "p1", 20.0, spec=spec(2, 8, 6, ([2, 2, 1, 1], [2, 2, 2, 2]), ([6], [8]))),
    record("transformers:plain", "p1", 5.0),
    record("transformers:assisted", "p1", 10.0),
    record("verispec:none", "p2", 10.0, category="d"),
    record(
        "verispec:draft", "p2", 5.0, category="d", spec=spec(1, 4, 0, ([0, 0, 0, 0], [1, 1, 1, 1]), ([0, 0], [0, 4]))
    ),
    record("transformers:plain", "p2", 20.0, category="d"),
    record("transformers:assisted", "p2", 10.0, category="d"),
]


def test_speedup_is_per_prompt_against_plain_of_the_same_family():
    speedups = per_prompt_speedups(RECORDS)
    assert speedups[("verispec:draft", "p1")] == 2.0
    assert speedups[("transformers:assisted", "p1")] == 2.0  # over transformers plain (5), not verispec (10)
    assert speedups[("transformers:assisted", "p2")] == 0.5
    assert per_prompt_speedups(RECORDS, baseline="verispec:none")[("transformers:plain", "p2")] == 2.0


def test_summary_rows_pool_counters_and_take_geometric_means():
    rows = {(r.runner, r.category): r for r in summarize(RECORDS)}
    draft_all = rows[("verispec:draft", ALL)]
    assert draft_all.num_prompts == 2
    assert draft_all.speedup == pytest.approx(math.sqrt(2.0 * 0.5))  # per-prompt 2x and 0.5x -> 1x
    assert draft_all.acceptance_rate == pytest.approx(6 / 12)  # pooled, not the mean of 0.75 and 0
    assert draft_all.mean_acceptance_length == pytest.approx(1 + 6 / 3)
    assert draft_all.acceptance_per_position == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert draft_all.acceptance_by_output_bucket == [6 / 8, 0 / 4]  # bucket 1 only drafted by p2
    assert draft_all.tokens_per_target_forward == pytest.approx(1.0)
    assert rows[("verispec:draft", "c")].speedup == 2.0
    assert rows[("verispec:none", ALL)].acceptance_rate is None  # no drafts, no rate
    assert rows[("transformers:assisted", ALL)].speedup_vs_reference == pytest.approx(1.0)  # 10/10 and 10/10
    assert [r.category for r in summarize(RECORDS)][:4] == ["c"] * 4  # categories first, "all" last


def test_exactness_flags_and_mismatch_list():
    batch = [
        record("verispec:none", "p", 1.0),
        record("verispec:draft", "p", 1.0, tokens=(1, 2, 4)),
        record("transformers:plain", "p", 1.0),
        record("transformers:assisted", "p", 1.0),
    ]
    mark_exactness(batch)
    flags = {r.runner: (r.matches_plain, r.matches_reference) for r in batch}
    assert flags == {
        "verispec:none": (None, None),  # plain itself: nothing to compare
        "verispec:draft": (False, False),  # differs at token 3
        "transformers:plain": (None, True),  # checked against verispec plain as the reference only
        "transformers:assisted": (True, True),
    }
    assert exactness(batch, greedy=True) == {
        "greedy": True,
        "compared": True,
        "all_equal": False,
        "mismatches": [{"runner": "verispec:draft", "prompt_id": "p", "category": "c"}],
    }
    assert exactness(batch, greedy=False)["all_equal"] is None  # rejection sampling: nothing to compare
    assert exactness(batch, greedy=False, coupled=True)["all_equal"] is False  # coupled: the seed fixes the text
    summary = {(r.runner, r.category): r for r in summarize(batch)}
    assert (summary[("verispec:draft", ALL)].exact_checked, summary[("verispec:draft", ALL)].mismatched_prompts) == (
        1,
        ["p"],
    )


def test_sampled_records_are_compared_within_a_runner_family_only():
    batch = [
        record("verispec:none", "p", 1.0),
        record("verispec:draft", "p", 1.0),
        record("transformers:plain", "p", 1.0, tokens=(9, 9, 9)),
    ]
    mark_exactness(batch, across_runners=False)
    flags = {r.runner: (r.matches_plain, r.matches_reference) for r in batch}
    # the same seed, the same family: same text; another runner's logits (and text) may differ
    assert flags == {"verispec:none": (None, None), "verispec:draft": (True, None), "transformers:plain": (None, None)}
