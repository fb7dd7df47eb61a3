"""Metric definitions on synthetic acceptance vectors."""

import pytest

from verispec.algorithms.verify import accepted_prefix_length
from verispec.metrics import RequestMetrics, RequestTimes, SpecDecodeStats


def test_accepts_1010_with_k4_count_only_first_token():
    stats = SpecDecodeStats()
    stats.record(4, accepted_prefix_length([True, False, True, False]))
    assert stats.num_accepted_tokens == 1
    assert stats.acceptance_rate == 0.25
    assert stats.mean_acceptance_length == 2.0
    assert stats.accepted_per_position == [1, 0, 0, 0]
    assert stats.accepted_length_histogram == [0, 1, 0, 0, 0]
    assert stats.num_recovered_tokens == 1 and stats.num_bonus_tokens == 0


@pytest.mark.parametrize(
    "steps, rate, mean_len, per_position, histogram",
    [
        ([(4, 4), (4, 0)], 0.5, 3.0, [1.0 / 2, 1.0 / 2, 1.0 / 2, 1.0 / 2], [1, 0, 0, 0, 1]),  # all, none
        ([(3, 2), (2, 2)], 4 / 5, 3.0, [1.0, 1.0, 0.0], [0, 0, 2, 0]),  # shorter last draft
        ([(0, 0), (2, 1)], 0.5, 2.0, [1.0, 0.0], [0, 1, 0]),  # a plain step is not a draft
    ],
)
def test_stats_table(steps, rate, mean_len, per_position, histogram):
    stats = SpecDecodeStats()
    for drafted, accepted in steps:
        stats.record(drafted, accepted)
    assert stats.acceptance_rate == pytest.approx(rate)
    assert stats.mean_acceptance_length == pytest.approx(mean_len)
    assert stats.acceptance_rate_per_position == pytest.approx(per_position)
    assert stats.accepted_length_histogram == histogram


def test_no_drafts_means_no_rates():
    stats = SpecDecodeStats()
    assert stats.acceptance_rate is None and stats.mean_acceptance_length is None


def test_record_rejects_impossible_counts():
    with pytest.raises(ValueError):
        SpecDecodeStats().record(2, 3)


def test_merge_adds_counters():
    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.record(2, 2)
    b.record(4, 1)
    a.merge(b)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (2, 6, 3)
    assert a.accepted_per_position == [2, 1, 0, 0] and a.drafted_per_position == [2, 2, 1, 1]


def test_request_metrics_from_times():
    times = RequestTimes(start=10.0, first_token=10.5, end=12.5, draft_s=0.4, target_s=1.6, num_target_forwards=5)
    m = RequestMetrics.from_times(times, prompt_tokens=7, output_tokens=5, spec=SpecDecodeStats())
    assert m.ttft_ms == pytest.approx(500.0)
    assert m.tpot_ms == pytest.approx(500.0)  # 2 s for 4 tokens after the first
    assert m.decode_tokens_per_s == pytest.approx(2.0)
    assert m.total_tokens_per_s == pytest.approx(5 / 2.5)
    assert m.e2e_ms == pytest.approx(2500.0)
    assert (m.draft_ms, m.target_ms) == (pytest.approx(400.0), pytest.approx(1600.0))


def test_single_token_has_no_tpot():
    times = RequestTimes(start=0.0, first_token=1.0, end=1.0)
    m = RequestMetrics.from_times(times, 3, 1, SpecDecodeStats())
    assert m.tpot_ms is None and m.decode_tokens_per_s is None and m.ttft_ms == pytest.approx(1000.0)


def test_acceptance_by_output_position_bucket():
    stats = SpecDecodeStats()
    stats.record(4, 4, output_position=0)
    stats.record(4, 1, output_position=63)  # still bucket 0 (0-63)
    stats.record(4, 0, output_position=130)  # bucket 2 (128-191)
    assert stats.accepted_by_output_bucket == [5, 0, 0]
    assert stats.drafted_by_output_bucket == [8, 0, 4]


def _output_with(stats):
    from types import SimpleNamespace

    return SimpleNamespace(metrics=SimpleNamespace(spec=stats))


def test_generate_says_when_speculation_lost_on_the_request():
    from verispec.cli.generate_stats import slowdown_hint

    lost = SpecDecodeStats()
    lost.record(4, 0)
    lost.record_control(4, predicted=(4.0, 3.5), realised=(1.0, 1.3))  # one token for 1.3 plain steps
    hint = slowdown_hint(_output_with(lost), "auto")
    assert hint is not None and "0.77x plain decoding" in hint and "estimated from its step times" in hint
    assert "acceptance rate 0.00" in hint and "--method none" in hint
    measured = slowdown_hint(_output_with(lost), "auto", {"measured_speedup": 0.81})
    assert "0.81x plain decoding on this request (measured against plain decoding" in measured
    assert slowdown_hint(_output_with(lost), "auto", {"measured_speedup": 1.2}) is None  # the measurement wins
    paid = SpecDecodeStats()
    paid.record(4, 4)
    paid.record_control(4, predicted=(5.0, 1.4), realised=(5.0, 1.4))
    assert slowdown_hint(_output_with(paid), "draft") is None
    assert slowdown_hint(_output_with(SpecDecodeStats()), "auto") is None  # nothing drafted
    assert slowdown_hint(_output_with(lost), "none") is None
