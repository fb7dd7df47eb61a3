"""The fault soak's pure parts (:mod:`verispec.server.soak_checks`, used by ``scripts/fault_soak.py``): the
seeded fault schedule, the counting of lost requests and of 5xx outside the kills, the check of a
kill's in-flight requests and the greedy comparison. No server."""

from __future__ import annotations

import pytest

from verispec.server.soak_checks import (
    INVALID_PARAMS,
    REQUEST_FAULTS,
    Fault,
    Outage,
    Outcome,
    by_kind,
    fault_schedule,
    greedy_mismatches,
    is_openai_error,
    kill_check,
    process_trends,
    rss_growth_mib,
    rss_trend_mib,
    tally,
    unexpected_answers,
)

# ----- the schedule -----


def test_a_seed_gives_the_same_schedule_and_another_seed_another():
    first = fault_schedule(seed=7, seconds=600, every_s=3.0, kills=1)
    assert first == fault_schedule(seed=7, seconds=600, every_s=3.0, kills=1)
    assert first != fault_schedule(seed=8, seconds=600, every_s=3.0, kills=1)


def test_the_schedule_for_seed_0_over_60_s():
    faults = fault_schedule(seed=0, seconds=60, every_s=3.0, kills=1)
    assert faults[:3] == [Fault(5.582, "greedy", 1), Fault(5.706, "invalid_params", 7), Fault(7.263, "greedy", 1)]
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
    assert [f for f in faults if f.kind == "kill"] == [Fault(30.252, "kill", 0)]  # one, in 40..80 % of the run
    assert len(faults) == 15


def test_the_schedule_covers_every_kind_on_a_long_run():
    faults = fault_schedule(seed=0, seconds=600, every_s=3.0, kills=2, kill_kind="replica_kill")
    kinds = {f.kind for f in faults}
    assert kinds == set(REQUEST_FAULTS) | {"replica_kill"}
    assert all(240 <= f.at_s <= 480 for f in faults if f.kind == "replica_kill")
    assert all(f.at_s < 570 for f in faults if f.kind != "replica_kill")  # none in the last 5 %
    assert {f.variant for f in faults if f.kind == "invalid_params"} == set(range(len(INVALID_PARAMS)))
    assert 150 <= sum(f.kind != "replica_kill" for f in faults) <= 250  # about 600 / 3


def test_every_greedy_prompt_is_probed_even_on_a_short_run():
    faults = fault_schedule(seed=3, seconds=5, every_s=100.0, kills=0, num_greedy=3)
    assert sorted(f.variant for f in faults if f.kind == "greedy") == [0, 1, 2]
    assert all(0.5 <= f.at_s <= 4.5 for f in faults)


@pytest.mark.parametrize(
    "seconds, every_s, kill_kind",
    [
        (0, 3.0, "kill"),  # no run
        (60, 0, "kill"),  # faults without a gap
        (60, 3.0, "sigterm"),  # not a kill the soak knows
    ],
)
def test_a_schedule_that_cannot_be_is_refused(seconds, every_s, kill_kind):
    with pytest.raises(ValueError):
        fault_schedule(seed=0, seconds=seconds, every_s=every_s, kills=1, kill_kind=kill_kind)


# ----- counting -----

KILL = Outage(kill_s=30.0, ready_s=45.0)
OUTCOMES = [
    Outcome("normal", 1.0, 3.0, "answered", 200, text="a"),
    Outcome("normal", 2.0, 4.0, "answered", 200, text="b"),
    Outcome("invalid_params", 5.0, 5.1, "http_error", 400, error_json=True),  # a refusal, not a fault
    Outcome("oversized_body", 6.0, 6.2, "http_error", 413, error_json=True),
    Outcome("normal", 10.0, 12.0, "http_error", 500, error_json=True),  # a 5xx nobody injected
    Outcome("normal", 20.0, 21.0, "stream_error", 200),  # an error event, no kill near
    Outcome("normal", 28.0, 30.5, "connection_error"),  # cut by the kill
    Outcome("normal", 35.0, 35.0, "connection_error"),  # refused while down
    Outcome("normal", 40.0, 40.5, "http_error", 503, error_json=True),  # during the outage: allowed
    Outcome("n16", 50.0, None),  # never answered: lost
    Outcome("greedy", 52.0, 232.0, "lost"),  # timed out: lost
    Outcome("disconnect", 55.0, 56.0, "closed", 200),
    Outcome("normal", 57.0, 58.0, "http_error", 502, error_json=False),  # a proxy's HTML page
]


def test_tally_counts_lost_and_5xx_outside_the_kills():
    counts = tally(OUTCOMES, [KILL])
    assert counts["sent"] == 13
    assert counts["answered"] == 2
    assert counts["http_errors_by_status"] == {"400": 1, "413": 1, "500": 1, "502": 1, "503": 1}
    assert counts["stream_error_events"] == 1
    assert counts["connection_errors"] == 2
    assert counts["closed_by_client"] == 1
    assert counts["lost"] == 2
    assert counts["server_faults_outside_kills"] == 3  # the 500, the error event, the 502; not the 503
    assert counts["http_errors_without_openai_json"] == 1


def test_without_outages_the_503_is_a_fault_too():
    assert tally(OUTCOMES, [])["server_faults_outside_kills"] == 4


def test_by_kind_splits_results_and_statuses():
    table = by_kind(OUTCOMES)
    assert table["normal"] == {
        "answered": 2,
        "connection_error": 2,
        "http_500": 1,
        "http_502": 1,
        "http_503": 1,
        "sent": 8,
        "stream_error": 1,
    }
    assert table["n16"] == {"lost": 1, "sent": 1}


def test_bad_input_answered_and_short_n16_answers_are_unexpected():
    outcomes = [
        Outcome("over_context", 1.0, 2.0, "answered", 200),
        Outcome("invalid_params", 1.0, 2.0, "answered", 200, variant=3),
        Outcome("n16", 1.0, 2.0, "answered", 200, detail="16 choices"),
        Outcome("n16", 1.0, 2.0, "answered", 200, detail="1 choices"),
        Outcome("malformed_json", 1.0, 2.0, "http_error", 400),
    ]
    assert unexpected_answers(outcomes) == [
        "over_context (variant 0) answered 200",
        "invalid_params (variant 3) answered 200",
        "n16 answered with 1 choices",
    ]


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"error": {"message": "bad", "type": "invalid_request_error", "code": None}}, True),
        ({"error": "bad"}, False),  # a string, not OpenAI's object
        ({"detail": [{"msg": "field required"}]}, False),  # FastAPI's default 422
        ([1, 2], False),
    ],
)
def test_openai_error_shape(body, expected):
    assert is_openai_error(body) is expected


# ----- kills, greedy texts, RSS -----


def test_kill_check_needs_every_in_flight_request_to_end_within_5_s():
    in_flight = [
        Outcome("normal", 28.0, 30.1, "connection_error"),  # cut at once
        Outcome("normal", 29.0, 34.9, "http_error", 503, error_json=True),  # 4.9 s: in time
        Outcome("greedy", 29.5, 30.0, "answered", 200),  # its answer was already written
        Outcome("disconnect", 29.6, 30.2, "stream_error", 200),
    ]
    assert kill_check(in_flight, kill_s=30.0) == {
        "kill_s": 30.0,
        "in_flight": 4,
        "ended_in_time": 4,
        "late": [],
        "ok": True,
    }
    late = in_flight + [
        Outcome("normal", 29.0, 35.5, "connection_error"),  # 5.5 s: late
        Outcome("n16", 29.0, None),  # still hanging
        Outcome("normal", 29.0, 31.0, "http_error", 500, error_json=False),  # not OpenAI's JSON
    ]
    result = kill_check(late, kill_s=30.0)
    assert (result["in_flight"], result["ended_in_time"], result["ok"]) == (7, 4, False)
    assert result["late"][1] == "n16 sent at 29.0 s: unanswered at None"


def test_a_replica_kill_lets_the_other_replicas_answer_their_requests_in_full():
    in_flight = [
        Outcome("normal", 28.0, 30.2, "http_error", 503, error_json=True),  # on the killed replica: 503 at once
        Outcome("normal", 28.5, 30.2, "stream_error", 200),  # its stream ended with an error event
        Outcome("n16", 20.0, 60.0, "answered", 200),  # on a replica that lived: answered later
        Outcome("normal", 29.0, 70.0, "http_error", 503, error_json=True),  # an error 40 s later: late
        Outcome("greedy", 29.0, None),  # never ended: late
    ]
    result = kill_check(in_flight, kill_s=30.0, others_may_answer=True)
    assert (result["ended_in_time"], result["answered_by_others"], len(result["late"]), result["ok"]) == (
        2,
        1,
        2,
        False,
    )
    assert kill_check(in_flight[:3], kill_s=30.0, others_may_answer=True)["ok"]
    assert not kill_check(in_flight[:3], kill_s=30.0)["ok"]  # a server kill: nothing may answer later


def test_greedy_probes_must_equal_the_idle_servers_texts():
    reference = {0: "def f():", 1: "return 1"}
    probes = [
        Outcome("greedy", 3.0, 4.0, "answered", 200, text="def f():", variant=0),
        Outcome("greedy", 5.0, 6.0, "answered", 200, text="return 2", variant=1),  # differs
        Outcome("greedy", 7.0, 8.0, "connection_error", variant=1),  # killed: no text to compare
    ]
    assert greedy_mismatches(reference, probes) == ["greedy prompt 1 at 5.0 s: 'return 2' != 'return 1'"]
    assert greedy_mismatches(reference, probes[:1]) == []


def test_rss_growth_counts_from_the_first_sample_after_the_first_minute():
    mib = 2**20
    samples = [(0.0, 100 * mib), (30.0, 900 * mib), (60.0, 1000 * mib), (120.0, 1010 * mib), (180.0, 1012 * mib)]
    assert rss_growth_mib(samples) == 12.0
    assert rss_growth_mib(samples[:3]) is None  # one sample after the warm-up: no growth to speak of


def test_rss_trend_compares_medians_of_the_minute_after_warm_up_and_the_last_minute():
    mib = 2**20
    # a flat process whose in-flight KV swings by 60 MiB from one 5 s sample to the next
    swinging = [(float(t), (1800 + (60 if (t // 5) % 2 else 0)) * mib) for t in range(0, 600, 5)]
    assert rss_growth_mib(swinging) == 60.0  # one sample low, the last one high
    assert rss_trend_mib(swinging) == 0.0
    # the same swings on a process that grows 0.2 MiB/s: the trend sees the growth
    growing = [(t, rss + int(0.2 * t * mib)) for t, rss in swinging]
    assert rss_trend_mib(growing) == 96.0  # 0.2 MiB/s x (567.5 - 87.5) s between the windows' middles
    assert rss_trend_mib(swinging[:36]) is None  # 175 s: the last minute would overlap the second
    assert rss_trend_mib(swinging[:37]) == 0.0


def test_each_process_trend_counts_from_its_own_first_sample():
    mib = 2**20
    # a replica there from the start grows 5 MiB; one started at 300 s (after a kill) stays flat
    samples = [(float(t), {"ServeReplica:1": 100 * mib + (5 * mib if t >= 240 else 0)}) for t in range(0, 310, 10)]
    samples += [(float(t), {"ServeReplica:1": 105 * mib, "ServeReplica:2": 90 * mib}) for t in range(310, 620, 10)]
    trends = process_trends(samples)
    assert trends == {"ServeReplica:1": 5.0, "ServeReplica:2": 0.0}
    assert process_trends([(0.0, {"raylet:3": mib}), (10.0, {"raylet:3": 2 * mib})]) == {"raylet:3": None}
    # a Ray worker's title is set after it starts: the same pid, one series, its last label
    renamed = [(float(t), {("raylet:9" if t < 30 else "ServeReplica:9"): mib}) for t in range(0, 400, 10)]
    assert process_trends(renamed) == {"ServeReplica:9": 0.0}
