"""Draft-length control: the expected-speedup formula on known values, estimates, schedules."""

import pytest

from verispec.algorithms.control import (
    OUTPUT_LENGTH_HISTORY,
    PLAIN_STEP_WINDOW,
    AcceptanceEstimate,
    ControllerConfig,
    CostModel,
    best_draft_length,
    catch_up_pays,
    expected_tokens,
    interpolate,
)
from verispec.algorithms.schedules import CostModelSchedule, HeuristicSchedule


@pytest.mark.parametrize(
    "alpha, k, expected",
    [
        (0.8, 0, 1.0),  # no draft: the target's own token
        (0.8, 1, 1.8),  # 1 + alpha
        (0.5, 3, 1.875),  # 1 + 0.5 + 0.25 + 0.125
        (0.0, 5, 1.0),  # nothing is ever accepted
        (1.0, 5, 6.0),  # everything accepted: k + 1 (the limit of the formula)
    ],
)
def test_expected_tokens(alpha, k, expected):
    assert expected_tokens(alpha, k) == pytest.approx(expected)


def linear_costs(c, max_k):
    """cost(k) = k c + 1 in plain steps: draft cost c per token, verify cost flat in k."""
    return [1 + k * c for k in range(max_k + 1)]


@pytest.mark.parametrize(
    "alpha, c, max_k, best_k, speedup",
    [
        (0.8, 0.05, 16, 8, 3.09),  # the first known value
        (0.8, 0.05, 64, 8, 3.09),  # a larger cap changes nothing: the optimum is interior
        (0.6, 0.05, 16, 4, 1.92),  # the second known value
        (0.8, 0.05, 5, 5, 2.95),  # clamped to the cap
        (0.9, 0.0, 8, 8, 6.13),  # free drafts: draft as much as allowed
        (0.2, 0.5, 8, 0, 1.0),  # no k beats plain decoding: switch off
        (0.0, 0.0, 8, 0, 1.0),  # nothing accepted, free drafts: a tie goes to plain decoding
    ],
)
def test_best_draft_length_known_values(alpha, c, max_k, best_k, speedup):
    k, value = best_draft_length(alpha, linear_costs(c, max_k))
    assert k == best_k
    assert value == pytest.approx(speedup, abs=0.005)


def test_verify_cost_growing_with_k_shortens_the_draft():
    flat = best_draft_length(0.8, [1.0 + 0.05 * k for k in range(17)])[0]
    growing = best_draft_length(0.8, [1.0 + 0.05 * k + 0.2 * k for k in range(17)])[0]  # llama.cpp-like
    assert growing < flat


@pytest.mark.parametrize(
    "points, k, expected",
    [
        ({4: 2.0}, 0, 2.0),  # one point: flat
        ({4: 2.0}, 9, 2.0),
        ({1: 1.0, 5: 3.0}, 3, 2.0),  # between points: linear
        ({1: 1.0, 5: 3.0}, 0, 1.0),  # below the first point: its value
        ({1: 1.0, 5: 3.0}, 7, 4.0),  # past the last: the last slope
        ({1: 3.0, 5: 1.0}, 9, 1.0),  # a falling slope is not extrapolated
    ],
)
def test_interpolate(points, k, expected):
    assert interpolate(points, k) == pytest.approx(expected)


@pytest.mark.parametrize(
    "drafted, accepted, alpha",
    [
        (4, 4, 0.5 + 0.5 * (1 - 0.5**4)),  # four tested tokens, all accepted
        (4, 2, (0.5 + 0.5 * 0.75) * 0.5),  # two accepted, one rejected, one never judged
        (4, 0, 0.25),  # first rejected: one tested token
        (0, 0, 0.5),  # a plain step tells nothing
    ],
)
def test_acceptance_estimate_counts_only_tested_tokens(drafted, accepted, alpha):
    estimate = AcceptanceEstimate(prior=0.5, weight=0.5)
    estimate.update(drafted, accepted)
    assert estimate.alpha == pytest.approx(alpha)


def test_heuristic_schedule():
    schedule = HeuristicSchedule(max_k=8)
    ks = []
    for drafted, accepted in [(8, 3), (7, 0), (6, 6), (8, 8), (8, 1), (7, 1)] + [(1, 0)] * 8:
        ks.append(schedule.next_k())
        schedule.update(drafted, accepted)
    # starts at the cap; -1 after a partial accept, +2 after a full one (capped at 8); never below 1
    assert ks == [8, 7, 6, 8, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1]


def measured_costs(draft_token_s, verify_s):
    costs = CostModel()
    for k, seconds in verify_s.items():
        costs.record_verify(k, seconds)
    costs.record_draft("draft", 4, 4 * draft_token_s)
    return costs


def test_step_costs_in_plain_steps():
    costs = measured_costs(0.01, {0: 0.1, 4: 0.2})
    assert costs.step_costs("draft", 4) == pytest.approx([1.0, 1.35, 1.7, 2.05, 2.4])
    assert costs.step_costs("ngram", 4) is None  # that drafter was never timed


def test_batched_step_costs_price_every_request_drafting_against_none():
    # A pass is flat up to 8 rows and then compute-bound (+10 ms a row): batch of 4 requests.
    costs = measured_costs(0.002, {0: 0.08, 3: 0.08, 7: 0.08, 11: 0.12, 15: 0.16})
    # k = 1 for all: 8 rows (key 7) over 4 rows (key 3) = 1.0; k = 2: 12 rows = 1.5; k = 3: 2.0;
    # drafting: 4 requests x k tokens x 2 ms over the 80 ms plain pass.
    assert costs.step_costs("draft", 3, batch_size=4) == pytest.approx([1.0, 1.1, 1.7, 2.3])
    # Alone, the same curve is flat for the request's own few rows.
    assert costs.step_costs("draft", 3) == pytest.approx([1.0, 1.025, 1.05, 1.075])


def test_cost_schedule_switches_off_in_a_compute_bound_batch():
    costs = measured_costs(0.002, {0: 0.03, 7: 0.035, 15: 0.07, 23: 0.105, 39: 0.175})  # 8 requests
    assert cost_schedule(0.7, costs, max_k=4).next_k(batch_size=1) > 0  # alone: drafting pays
    # 8 requests: every drafted token of each adds 8 rows to a compute-bound pass.
    assert cost_schedule(0.7, costs, max_k=4).next_k(batch_size=8) == 0


def cost_schedule(alpha, costs, max_k=16, **config):
    return CostModelSchedule("draft", max_k, AcceptanceEstimate(alpha, 0.2), costs, ControllerConfig(**config))


def test_cost_schedule_drafts_the_cap_until_timed_then_the_best_k():
    assert cost_schedule(0.8, CostModel()).next_k() == 16  # nothing measured yet: explore
    schedule = cost_schedule(0.8, measured_costs(0.005, {0: 0.1}))  # c = 0.05, flat verify
    assert schedule.next_k() == 8
    assert schedule.last_predicted_speedup == pytest.approx(3.09, abs=0.005)


def test_cost_schedule_switches_off_and_probes_again():
    schedule = cost_schedule(0.2, measured_costs(0.05, {0: 0.1}), probe_interval=4, probe_length=1)  # c = 0.5
    ks = [schedule.next_k() for _ in range(10)]
    # a hopeless drafter: 4 plain steps, one 1-token probe, 4 plain steps, a probe ...
    assert ks == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


def test_probes_that_succeed_switch_speculation_back_on():
    alpha = AcceptanceEstimate(prior=0.2, weight=0.2)
    costs = measured_costs(0.02, {0: 0.1})  # c = 0.2
    schedule = CostModelSchedule("draft", 8, alpha, costs, ControllerConfig(probe_interval=2))
    ks = []
    for _ in range(20):
        k = schedule.next_k()
        ks.append(k)
        alpha.update(k, k)  # the drafter has become good: every probe is accepted
    assert ks[:3] == [0, 0, 1]  # off, off, probe
    assert ks[-1] > 1 and 0 not in ks[-5:]  # back on with longer drafts


@pytest.mark.parametrize(
    "outcome, expected",
    [
        # off, off, probe (accepted) -> one follow-up probe -> off again: the cost model still says
        # no, however often probes are accepted (alpha stays at 0.2 here)
        ("accept", [0, 0, 1, 1, 0, 0, 1, 1, 0]),
        ("reject", [0, 0, 1, 0, 0, 1, 0, 0, 1]),  # a rejected probe has no follow-up
    ],
)
def test_an_accepted_probe_is_followed_by_one_more(outcome, expected):
    """A back-to-back probe re-measures the drafter's steady-state cost, once."""
    schedule = cost_schedule(0.2, measured_costs(0.05, {0: 0.1}), probe_interval=2, probe_length=1)  # c = 0.5
    ks = []
    for _ in expected:
        k = schedule.next_k()
        ks.append(k)
        if k:
            schedule.update(k, k if outcome == "accept" else 0)
    assert ks == expected


@pytest.mark.parametrize(
    "verify_s, expected",
    [
        ({0: 0.1, 4: 0.2}, [1.0, 1.25, 1.5, 1.75, 2.0]),  # grows with k: interpolated
        ({0: 0.2, 2: 0.1}, [1.0, 1.0, 1.0, 1.0, 1.0]),  # timings taken under different load: clamped
        ({0: 0.1, 1: 0.15, 2: 0.12, 4: 0.2}, [1.0, 1.5, 1.5, 1.6, 2.0]),  # a dip is not believed
    ],
)
def test_verify_ratios_never_fall_below_plain_or_with_k(verify_s, expected):
    costs = CostModel(verify_s=dict(verify_s))
    assert costs.verify_ratios(4) == pytest.approx(expected)


def test_the_plain_step_is_the_mean_of_many_plain_passes_not_of_the_last_few():
    costs = CostModel()
    for _ in range(99):
        costs.record_verify(0, 0.040)
    costs.record_verify(0, 0.140)  # one slow pass (another process woke up) ...
    assert costs.plain_step_s() == pytest.approx(0.041)  # ... moves it by 1 ms (an EWMA of 0.3: by 30 ms)
    costs.record_verify(2, 0.060)
    costs.record_verify(2, 0.070)
    assert costs.verify_s[2] == pytest.approx(0.063)  # drafted passes: EWMA per length, as before
    assert costs.plain_step_s() == pytest.approx(0.041)
    for _ in range(PLAIN_STEP_WINDOW):
        costs.record_verify(0, 0.030)
    assert costs.plain_step_s() == pytest.approx(0.030)  # older passes leave the window


def test_a_seeded_plain_step_counts_as_one_pass_and_weight_zero_freezes_it():
    costs = CostModel(verify_s={0: 0.050})
    costs.record_verify(0, 0.030)
    assert costs.plain_step_s() == pytest.approx(0.040)
    costs.weight = 0.0
    costs.record_verify(0, 0.010)
    assert costs.plain_step_s() == pytest.approx(0.040)


def test_draft_cost_relative_to_the_same_steps_target_pass_survives_a_slowdown():
    costs = measured_costs(0.01, {0: 0.1})  # calm: draft token 10 ms, plain step 100 ms
    costs.verify_s[0] = 0.5  # the plain step was last timed during a 5x slowdown ...
    assert costs.step_costs("draft", 1)[1] == pytest.approx(1.02)  # ... absolute times mislead (c = 0.02)
    costs.record_draft_ratio("draft", 2, 0.02, 0.1)  # a step timed as a whole: 10 ms per token / 100 ms pass
    assert costs.step_costs("draft", 1)[1] == pytest.approx(1.1)  # c = 0.1 whatever the slowdown


@pytest.mark.parametrize(
    "speedup, remaining, cost, pays",
    [
        (1.25, 100, 3.0, True),  # saves 100 - 80 = 20 plain steps, the catch-up costs 3
        (1.25, 10, 3.0, False),  # saves 2: a short answer does not repay the draft's prefill
        (1.5, 9.1, 3.0, True),  # saves 3.03
        (1.5, 8.9, 3.0, False),  # saves 2.97
        (1.0, 1000, 0.1, False),  # a drafter that saves nothing never pays for catching up
        (0.8, 1000, 0.0, False),
    ],
)
def test_catch_up_pays_when_the_rest_of_the_answer_repays_it(speedup, remaining, cost, pays):
    assert catch_up_pays(speedup, remaining, cost) is pays


def test_expected_remaining_tokens_is_the_conditional_mean_of_recorded_lengths():
    costs = CostModel()
    assert costs.expected_remaining_tokens(0, 127) == 127  # nothing recorded: assume nothing
    for length in (20, 30, 100):
        costs.record_output_length(length)
    assert costs.expected_remaining_tokens(0, 127) == pytest.approx(50.0)  # (20 + 30 + 100) / 3
    assert costs.expected_remaining_tokens(25, 127) == pytest.approx(40.0)  # E[L - 25 | L > 25] = (5 + 75) / 2
    assert costs.expected_remaining_tokens(25, 10) == 10  # never more than the request may still emit
    assert costs.expected_remaining_tokens(100, 27) == 27  # longer than every recorded one: unknown
    for _ in range(OUTPUT_LENGTH_HISTORY):
        costs.record_output_length(8)
    assert costs.expected_remaining_tokens(0, 127) == pytest.approx(8.0)  # the oldest lengths are forgotten


def test_catch_up_cost_per_power_of_two_rows_in_plain_steps():
    costs = CostModel()
    assert costs.catch_up_cost("draft", 64) is None  # no target pass timed yet
    costs.record_verify(0, 0.020)
    assert costs.catch_up_cost("draft", 64) is None  # no catch-up timed yet
    costs.record_catch_up("draft", 60, 0.060)  # bucket 64, scaled to it: 0.064 s
    costs.record_catch_up("draft", 5, 0.010)  # bucket 4: 0.008 s
    assert set(costs.catch_up_s["draft"]) == {4, 64}
    assert costs.catch_up_cost("draft", 64) == pytest.approx(3.2)  # 64 ms over a 20 ms plain step
    assert costs.catch_up_cost("draft", 34) == pytest.approx((0.008 + 0.056 * 30 / 60) / 0.020)  # interpolated
    costs.record_catch_up("draft", 64, -0.010)  # a timing below the steady cost counts as free
    assert costs.catch_up_s["draft"][64] == pytest.approx(0.064 * 0.7)


def test_three_rejections_in_a_row_do_not_switch_a_good_draft_off_at_the_default_weight():
    # Costs an AVX2 host's engine measured in a HumanEval run (a drafted token 0.33 of a pass, 2 / 3
    # rows 1.2 / 1.4 plain passes): drafting pays above alpha ~0.53. A draft accepting ~80% meets 3
    # rejections in a row now and then; at the old weight 0.2 they push the estimate to 0.41 and
    # the request decodes plain until a probe (scripts/draft_length_sim.py: Spec-Bench qa 1.191 vs
    # 1.441 plain-step speedup at 0.2 and 0.1).
    costs = measured_costs(0.033, {0: 0.1, 1: 0.12, 2: 0.14, 3: 0.16})
    for weight, drafting in ((ControllerConfig().alpha_weight, True), (0.2, False)):
        alpha = AcceptanceEstimate(prior=0.8, weight=weight)
        for _ in range(3):
            alpha.update(1, 0)
        schedule = CostModelSchedule("draft", 4, alpha, costs, ControllerConfig())
        assert (schedule.next_k() > 0) is drafting, (weight, alpha.alpha)


def test_record_acceptance_counts_tested_tokens_from_the_prior():
    costs = CostModel()
    costs.record_acceptance("draft", 2, 1, weight=0.5, prior=0.6)  # accepted (0.8), then rejected (0.4)
    assert costs.last_alpha["draft"] == pytest.approx(0.4)
    costs.record_acceptance("draft", 3, 3, weight=0.5, prior=0.6)  # all accepted: 3 tested, no rejection
    assert costs.last_alpha["draft"] == pytest.approx(1 - 0.6 * 0.5**3)


def test_a_new_request_starts_from_many_requests_acceptance_not_the_last_few_tokens():
    config, costs = ControllerConfig(), CostModel()
    for _ in range(60):  # long answers, drafts of 4 all accepted
        costs.record_acceptance("draft", 4, 4, config.carried_alpha_weight, config.alpha_prior)
    request = AcceptanceEstimate(costs.last_alpha["draft"], config.alpha_weight)
    assert costs.last_alpha["draft"] > 0.95
    for _ in range(4):  # a short answer ends on four rejected 1-token drafts
        costs.record_acceptance("draft", 1, 0, config.carried_alpha_weight, config.alpha_prior)
        request.update(1, 0)
    assert request.alpha < 0.66  # that request's own estimate fell ...
    assert costs.last_alpha["draft"] > 0.88  # ... the next request's start barely moved
