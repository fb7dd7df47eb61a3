"""Per-drafter counters, chosen-k history and predicted vs realised speedup."""

import pytest

from verispec.metrics import SpecDecodeStats


def test_per_drafter_counts_use_the_shared_definitions():
    stats = SpecDecodeStats()
    stats.record(4, 4, drafter="ngram")  # full accept
    stats.record(4, 1, drafter="draft")
    stats.record(2, 0, drafter="draft")
    stats.record(0, 0)  # a plain step: nobody's draft
    ngram, draft = stats.per_drafter["ngram"], stats.per_drafter["draft"]
    assert (ngram.num_drafts, ngram.acceptance_rate, ngram.mean_acceptance_length) == (1, 1.0, 5.0)
    assert (draft.num_drafts, draft.acceptance_rate, draft.mean_acceptance_length) == (2, 1 / 6, 1.5)
    assert stats.num_drafts == 3 and stats.acceptance_rate == pytest.approx(5 / 10)


def test_chosen_k_and_speedups():
    stats = SpecDecodeStats()
    stats.record_control(8, predicted=(3.0, 1.5), realised=(5.0, 1.6))
    stats.record_control(0, predicted=(1.0, 1.0), realised=(1.0, 1.1))
    stats.record_control(4, predicted=None, realised=(2.0, 1.0))  # costs not measured yet: no pair
    assert stats.chosen_k == [8, 0, 4]
    assert stats.chosen_k_histogram == [1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert stats.predicted_speedup == pytest.approx(4.0 / 2.5)
    assert stats.realised_speedup == pytest.approx(6.0 / 2.7)
    assert SpecDecodeStats().predicted_speedup is None


def test_merge_and_to_dict_carry_the_new_fields():
    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.record(3, 2, drafter="ngram")
    a.record_control(3, (2.0, 1.0), (3.0, 1.0))
    b.record(3, 3, drafter="ngram")
    b.record(2, 1, drafter="draft")
    b.record_control(2, (2.0, 1.0), (2.0, 1.0))
    a.merge(b)
    assert a.per_drafter["ngram"].num_accepted_tokens == 5 and a.per_drafter["draft"].num_drafts == 1
    assert a.chosen_k == [3, 2] and a.realised_speedup == pytest.approx(2.5)
    data = a.to_dict()
    assert data["per_drafter"]["ngram"]["acceptance_rate"] == pytest.approx(5 / 6)
    assert data["chosen_k_histogram"] == [0, 0, 1, 1] and data["predicted_speedup"] == pytest.approx(2.0)
