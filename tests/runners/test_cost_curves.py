"""Cost curves timed while the machine was busy: refused by the cache, not kept; a seeded curve
gives the controller its shape, the level comes from the run (the draft model was priced out)."""

import pytest

from verispec.algorithms.control import CostModel
from verispec.runners.costs import CostCache, CostCurve, keep_curve, seed_cost_model

KS = (1, 2, 4, 8, 16)


def curve(ms, runner="gguf:avx512@x"):
    return CostCurve(runner, "m", dict(zip(KS, ms)))


# Curves this project measured. Steady: Zen 4 AVX-512 and AVX2, llama.cpp (compute-bound from two
# rows), the Xeon's AVX-512 whose one-row pass was slower than its two-row one, a tiny test model.
STEADY = [
    [32.3, 34.2, 36.3, 50.6, 93.7],
    [39.4, 46.2, 59.9, 97.5, 171.4],
    [35.2, 64.2, 109.8, 225.0, 269.2],
    [68.9, 52.4, 59.6, 74.4, 115.7],
    [0.177, 0.182, 0.198, 0.233, 0.295],
]
# Timed while other processes held the two cores (found in a cost cache on 2026-12-05).
BUSY = [
    [40.59, 651.939, 2054.425],  # the 0.5B draft: 16x for twice the tokens
    [293.26, 68.19, 764.836, 2313.67],  # the 1.5B target: a two-token pass at 0.23x a one-token one
    [106.912, 134.975, 97.237, 164.891, 2123.879],  # 12.9x from 8 to 16 tokens
    [259.96, 12.283, 0.476, 0.58, 0.78],
]


@pytest.mark.parametrize("ms", STEADY)
def test_steady_curves_are_kept(ms):
    assert curve(ms).disturbed() is None


@pytest.mark.parametrize("ms", BUSY)
def test_curves_timed_on_a_busy_machine_are_named_disturbed(ms):
    assert "ms for" in curve(ms).disturbed()


def test_the_cache_measures_a_disturbed_curve_again_and_keep_curve_does_not_store_one(tmp_path, capsys):
    cache = CostCache(tmp_path, machine="m")
    cache.put("busy", curve(BUSY[2]))  # as an older verispec stored it
    keep_curve(cache, "steady", curve(STEADY[0]))
    assert cache.get("busy", "gguf:avx512@x") is None
    assert (
        "timed while the machine was busy (2123.88 ms for 16 tokens after 164.891 ms for 8)" in capsys.readouterr().err
    )
    assert cache.get("steady", "gguf:avx512@x").ms[16] == 93.7
    keep_curve(cache, "busy-again", curve(BUSY[0]))
    assert "were disturbed" in capsys.readouterr().err
    assert "busy-again" not in cache._read()


def test_a_seeded_curve_gives_the_shape_and_the_run_gives_the_level():
    """Seeded from a curve timed 3.4x slower than the machine runs now (106.9 ms plain), then 20
    plain steps at 31 ms: drafting k tokens is priced at the curve's shape of today's plain step.
    Before, the seeded absolute 135 ms for a 2-token pass stayed (4.3 plain steps), so a draft
    model of 0.3 plain steps a token never paid, never ran, and the seed was never corrected."""
    costs = CostModel()
    seed_cost_model(costs, curve([106.9, 135.0, 150.0, 170.0, 250.0]))
    for _ in range(20):
        costs.record_verify(0, 0.031)
    costs.record_draft_ratio("draft", 1, 0.0093, 0.031)
    plain = costs.plain_step_s()
    assert plain == pytest.approx((0.1069 + 20 * 0.031) / 21)  # the seed counts as one plain pass
    assert costs.verify_points()[1] == pytest.approx(135.0 / 106.9 * plain)
    step = costs.step_costs("draft", max_k=3)
    assert step[1] == pytest.approx(135.0 / 106.9 + 0.3)
    assert step[3] == pytest.approx(150.0 / 106.9 + 3 * 0.3)
    costs.record_verify(1, 0.033)  # a timed length replaces its seed
    assert costs.verify_points()[1] == pytest.approx(0.033)
