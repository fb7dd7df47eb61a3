"""``--method auto`` and the schedules: exactness, drafter choice per step, sources, controller metrics."""

import time

import pytest

from helpers import BigramRunner, CharTokenizer, chain_table, make_engine, single_thread
from verispec.algorithms.control import ControllerConfig, CostModel
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.policy import drafter_order
from verispec.errors import InvalidParameterError
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.layer_skip import LayerSkipProposer

SERVING = [ord(c) % 96 for c in "serving " * 48]  # "serving " x 48, one token id per character
PROMPTS = {
    "serving": SERVING,
    "repeats": [5, 17, 33, 2, 9, 5, 17, 33, 2, 9, 5, 17],
    "no-repeats": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
}
GREEDY_32 = SamplingParams(max_tokens=32)


@pytest.mark.parametrize(
    "method, loaded, order",
    [
        ("none", ["ngram", "draft"], []),  # plain decoding
        ("auto", ["ngram", "draft", "layer-skip"], ["ngram", "draft"]),  # the draft model backs up n-gram
        ("auto", ["ngram", "layer-skip"], ["ngram", "layer-skip"]),  # ... else layer skip
        ("auto", ["ngram"], ["ngram"]),  # n-gram alone
        ("auto", ["ngram", "suffix", "draft"], ["suffix", "draft"]),  # suffix lookup (it subsumes n-gram's) first
        ("auto", ["suffix", "layer-skip"], ["suffix", "layer-skip"]),
        ("layer-skip", ["ngram", "layer-skip"], ["layer-skip"]),
    ],
)
def test_drafter_order(method, loaded, order):
    assert drafter_order(method, loaded) == order


def test_missing_drafter_is_refused():
    with pytest.raises(InvalidParameterError, match="needs its drafter"):
        drafter_order("layer-skip", ["ngram", "draft"])


@pytest.fixture(scope="module")
def plain_outputs(target_model):
    engine = make_engine(target_model, max_context_length=512)
    return {
        name: engine.generate(p, GREEDY_32, SpeculativeConfig(method="none")).token_ids for name, p in PROMPTS.items()
    }


@pytest.mark.parametrize("k", range(1, 9))
def test_auto_greedy_equals_plain(k, target_model, partial_draft_model, plain_outputs):
    engine = make_engine(target_model, partial_draft_model, max_context_length=512)
    for name, prompt in PROMPTS.items():
        out = engine.generate(prompt, GREEDY_32, SpeculativeConfig(method="auto", num_speculative_tokens=k))
        assert out.token_ids == plain_outputs[name], name
        used = out.metrics.spec.per_drafter
        if name == "serving":
            assert used["suffix"].num_drafts > 0  # lookups matched in the repeated text
        assert sum(s.num_drafts for s in used.values()) == out.metrics.spec.num_drafts


@pytest.mark.parametrize("schedule", ["constant", "heuristic", "cost"])
@pytest.mark.parametrize("method", ["draft", "ngram", "auto"])
def test_schedules_greedy_equal_plain(schedule, method, target_model, partial_draft_model, plain_outputs):
    engine = make_engine(target_model, partial_draft_model, max_context_length=512)
    for name, prompt in PROMPTS.items():
        spec = SpeculativeConfig(method=method, num_speculative_tokens=8, schedule=schedule)
        out = engine.generate(prompt, GREEDY_32, spec)
        assert out.token_ids == plain_outputs[name], (name, schedule)
        assert len(out.metrics.spec.chosen_k) > 0 and max(out.metrics.spec.chosen_k) <= 8


def test_auto_falls_back_to_layer_skip(target_model, plain_outputs):
    engine = make_engine(
        target_model, max_context_length=512, proposers={"layer-skip": LayerSkipProposer(target_model, 1)}
    )
    out = engine.generate(PROMPTS["no-repeats"], GREEDY_32, SpeculativeConfig(method="auto", num_speculative_tokens=4))
    assert out.token_ids == plain_outputs["no-repeats"]
    assert out.metrics.spec.per_drafter["layer-skip"].num_drafts > 0


# Bigram target that cycles 1 -> 2 -> 3 -> 1 after a start 4 -> 5 -> 6 -> 1; the draft model
# knows the whole chain. n-gram lookup can only match once the cycle is in the context.
CYCLE = {4: 5, 5: 6, 6: 1, 1: 2, 2: 3, 3: 1}


def cycle_engine(draft_type=DraftModelProposer, **kwargs):
    """Target and draft model both follow :data:`CYCLE` (``draft_type``: the draft's proposer)."""
    return SpeculativeEngine(
        BigramRunner(chain_table(CYCLE, 7)),
        CharTokenizer("0123456"),
        eos_token_ids=[0],
        proposers={"draft": draft_type(BigramRunner(chain_table(CYCLE, 7)))},
        **kwargs,
    )


def test_auto_records_which_drafter_produced_each_token():
    out = cycle_engine().generate(
        [4], SamplingParams(max_tokens=20), SpeculativeConfig(method="auto", num_speculative_tokens=3)
    )
    assert out.token_ids == [5, 6, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    sources = out.token_sources
    assert len(sources) == len(out.token_ids) and sources[0] == "target"
    # no 2-gram repeats at first: the draft model drafts; once "1 2 3 1" is there, suffix lookup takes over
    assert sources[1:4] == ["draft"] * 3 and sources[4] == "target"
    assert "suffix" in sources[5:]
    per_drafter = out.metrics.spec.per_drafter
    for name in ("draft", "suffix"):
        assert sources.count(name) == per_drafter[name].num_accepted_tokens
        assert per_drafter[name].acceptance_rate == 1.0


def test_cost_schedule_switches_off_a_hopeless_drafter():
    """A draft model that is always wrong and (per the measured costs) expensive: plain steps + probes."""
    wrong = {a: (b % 6) + 1 for a, b in CYCLE.items()}  # never the target's token
    engine = SpeculativeEngine(
        BigramRunner(chain_table(CYCLE, 7)),
        CharTokenizer("0123456"),
        eos_token_ids=[0],
        proposers={"draft": DraftModelProposer(BigramRunner(chain_table(wrong, 7)))},
        controller=ControllerConfig(probe_interval=4),
    )
    for k in range(9):
        engine.cost_model.record_verify(k, 0.010)  # measured before: any target pass 10 ms,
    engine.cost_model.record_draft("draft", 1, 0.005)  # a drafted token 5 ms
    engine.cost_model.draft_ratio["draft"] = 0.5  # the same, as the per-step ratio (else the first real sample sets it)
    engine.cost_model.weight = 0.0  # freeze the costs: the bigram doubles take microseconds
    out = engine.generate(
        [4], SamplingParams(max_tokens=30), SpeculativeConfig(method="draft", num_speculative_tokens=8, schedule="cost")
    )
    chosen = out.metrics.spec.chosen_k
    # the prior alpha (0.6) and, after one rejection, 0.54 (weight 0.1) make one drafted token look
    # worthwhile (1.6 / 1.5, 1.54 / 1.5) ...
    assert chosen[:2] == [1, 1]
    assert chosen[2:] == ([0] * 4 + [1]) * 5 + [0]  # ... then off, with a 1-token probe every 5th step
    assert out.metrics.spec.acceptance_rate == 0.0
    assert out.metrics.spec.predicted_speedup is not None and out.metrics.spec.predicted_speedup < 1.1


def test_acceptance_estimate_carries_to_the_next_request():
    engine = cycle_engine()
    for k in range(4):
        engine.cost_model.record_verify(k, 0.010)  # frozen costs: drafting is cheap (c = 0.05)
    engine.cost_model.record_draft("draft", 1, 0.0005)
    engine.cost_model.draft_ratio["draft"] = (
        0.05  # frozen too: a first real-time sample of microsecond doubles is noise
    )
    engine.cost_model.weight = 0.0
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=3, schedule="cost")
    engine.generate([4], SamplingParams(max_tokens=12), spec)
    first = engine.cost_model.last_alpha["draft"]
    assert first > 0.6  # the draft model was always right: above the configured prior
    # a new request starts from that estimate, not from the prior, and keeps rising
    engine.generate([4], SamplingParams(max_tokens=12), spec)
    assert engine.cost_model.last_alpha["draft"] > first


class SlowFirstProposer(DraftModelProposer):
    """A draft model whose first proposal of a request is slow, as a real draft's prefill is."""

    def propose(self, request, num_speculative_tokens):
        if not self.cached_token_ids:
            time.sleep(0.2)
        return super().propose(request, num_speculative_tokens)


def test_draft_cost_is_measured_in_steady_state_only():
    engine = cycle_engine(SlowFirstProposer)
    out = engine.generate(
        [4], SamplingParams(max_tokens=8), SpeculativeConfig(method="draft", num_speculative_tokens=2)
    )
    assert out.metrics.draft_ms > 200  # the slow first proposal did happen ...
    assert engine.cost_model.draft_token_s["draft"] < 0.02  # ... but is not a per-token cost


def frozen_cycle_engine(output_lengths, **kwargs):
    """The cycle target and draft with frozen measured costs: a target pass 10 ms, a drafted token
    0.5 ms, feeding the draft 8 tokens it has not seen 50 ms (5 plain steps); ``output_lengths``:
    the engine's earlier requests."""
    engine = cycle_engine(**kwargs)
    costs = engine.cost_model
    for k in range(9):
        costs.record_verify(k, 0.010)
    costs.record_draft("draft", 1, 0.0005)
    costs.draft_ratio["draft"] = 0.05
    costs.record_catch_up("draft", 8, 0.050)
    for length in output_lengths:
        costs.record_output_length(length)
    costs.weight = 0.0
    return engine


COST_SPEC = SpeculativeConfig(method="draft", num_speculative_tokens=4, schedule="cost")
NO_REPEATS = [4, 5, 6, 1, 2]  # 5 prompt tokens: the draft's first proposal feeds 6


def test_a_draft_whose_prefill_a_short_answer_cannot_repay_sits_out():
    engine = frozen_cycle_engine([8] * 4)  # answers have been 8 tokens long
    params = SamplingParams(max_tokens=8)
    plain = engine.generate(NO_REPEATS, params, SpeculativeConfig(method="none"), learn=False)
    state = engine.start(NO_REPEATS, params, COST_SPEC, learn=False)
    while not state.finished:
        engine.step([state])
    assert state.output.token_ids == plain.token_ids
    assert state.output.metrics.spec.num_draft_tokens == 0  # 7 tokens at ~1.9x save ~3.3 steps, the prefill costs 5
    assert state.policy.num_declined_catch_ups == 6  # every step with room to draft (the last has none)


def test_a_draft_whose_prefill_a_long_answer_repays_drafts_from_the_first_step():
    engine = frozen_cycle_engine([100] * 4)
    params = SamplingParams(max_tokens=40)
    plain = engine.generate(NO_REPEATS, params, SpeculativeConfig(method="none"), learn=False)
    out = engine.generate(NO_REPEATS, params, COST_SPEC)
    assert out.token_ids == plain.token_ids
    assert out.token_sources[1] == "draft"  # 39 tokens at ~1.9x save ~18 steps > 5
    assert out.metrics.spec.acceptance_rate == 1.0


def test_without_catch_up_pricing_the_draft_drafts_from_the_first_step():
    engine = frozen_cycle_engine([8] * 4, controller=ControllerConfig(price_catch_up=False))
    out = engine.generate(NO_REPEATS, SamplingParams(max_tokens=8), COST_SPEC)
    assert out.token_sources[1] == "draft"  # steady steps alone make 4 tokens at 0.05 each worth it


def test_user_chosen_draft_lengths_draft_whatever_the_prefill_costs():
    engine = frozen_cycle_engine([8] * 4)
    params = SamplingParams(max_tokens=8)
    out = engine.generate(
        NO_REPEATS, params, SpeculativeConfig(method="draft", num_speculative_tokens=4, schedule="constant")
    )
    assert out.token_sources[1] == "draft"  # the constant schedule is the user's choice, not priced


def test_only_users_requests_teach_output_lengths():
    engine = cycle_engine()
    engine.generate(NO_REPEATS, SamplingParams(max_tokens=6), learn=False)  # a warm-up
    assert list(engine.cost_model.output_lengths) == []
    engine.generate(NO_REPEATS, SamplingParams(max_tokens=6))
    engine.generate(NO_REPEATS, SamplingParams(max_tokens=9), SpeculativeConfig(method="none"))
    assert list(engine.cost_model.output_lengths) == [6, 9]


class SlowCatchUpProposer(DraftModelProposer):
    """A draft model whose proposals take 10 ms per unseen context token fed beyond 3, as a
    real draft's prefill grows with the tokens it feeds."""

    def propose(self, request, num_speculative_tokens):
        rows = self.catch_up_rows(request)
        if rows >= 4:
            time.sleep(0.010 * rows)
        return super().propose(request, num_speculative_tokens)


def test_a_catch_up_is_timed_beyond_the_steady_cost():
    engine = cycle_engine(SlowCatchUpProposer)
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=2, schedule="constant")
    engine.generate(NO_REPEATS, SamplingParams(max_tokens=8), spec)
    assert "draft" not in engine.cost_model.catch_up_s  # the first request's first proposal: no steady cost yet
    assert engine.cost_model.draft_token_s["draft"] < 0.005  # steady proposals feed 1-2 tokens: no sleep
    engine.generate([1, 2, 3, 4, 5, 6, 4, 5], SamplingParams(max_tokens=8), spec)  # 9 tokens the draft has not seen
    ((bucket, seconds),) = engine.cost_model.catch_up_s["draft"].items()
    assert bucket == 8 and seconds >= 0.5 * 0.090 * 8 / 9  # slept 90 ms feeding 9 tokens, scaled to the bucket of 8


def test_a_draft_whose_steps_emit_a_small_share_of_the_answer_does_not_pay_its_prefill():
    engine = frozen_cycle_engine([100] * 4)
    engine.cost_model.coverage["draft"] = 0.2  # its steps have emitted a fifth of the answers after it caught up
    params = SamplingParams(max_tokens=40)
    plain = engine.generate(NO_REPEATS, params, SpeculativeConfig(method="none"), learn=False)
    out = engine.generate(NO_REPEATS, params, COST_SPEC)
    assert out.token_ids == plain.token_ids
    assert out.metrics.spec.num_draft_tokens == 0  # 39 x 0.2 tokens at ~1.9x save ~3.7 steps < 5 (at coverage 1: 18)


def test_coverage_is_recorded_for_users_requests_only():
    engine = cycle_engine()
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=2, schedule="constant")
    engine.generate(NO_REPEATS, SamplingParams(max_tokens=8), spec, learn=False)
    assert engine.cost_model.coverage == {}
    out = engine.generate([1, 2, 3, 6, 5], SamplingParams(max_tokens=8), spec)  # the draft catches up on all 6
    drafts = out.metrics.spec.per_drafter["draft"]
    assert drafts.num_accepted_tokens + drafts.num_drafts == 6  # two steps of 2 + 1; the last had no room
    # the first token is the prompt pass's, the catch-up came with the second: 6 of the last 7
    assert engine.cost_model.coverage == {"draft": pytest.approx(6 / 7)}


def test_cost_model_coverage_is_a_clamped_ewma_of_shares():
    costs = CostModel(weight=0.5)
    costs.record_coverage("draft", 3, 0)  # nothing emitted after the catch-up: no sample
    assert costs.coverage == {}
    costs.record_coverage("draft", 10, 40)
    assert costs.coverage["draft"] == pytest.approx(0.25)
    costs.record_coverage("draft", 50, 40)  # more than all: a share of 1
    assert costs.coverage["draft"] == pytest.approx(0.625)


def test_a_draft_priced_out_by_a_slow_measurement_is_still_probed_now_and_then():
    """A draft whose cost was measured while the machine was slow (a drafted token at 10 target
    passes: switched off) would have every probe's prefill priced out on short answers, and so
    never be measured again; every third priced-out probe (probe_interval 2) goes ahead, and a
    second probe follows it (a steady step: what re-measures the draft's own cost)."""
    engine = frozen_cycle_engine([8] * 4, controller=ControllerConfig(probe_interval=2))
    engine.cost_model.draft_ratio["draft"] = 10.0
    params = SamplingParams(max_tokens=8)
    plain = engine.generate(NO_REPEATS, params, SpeculativeConfig(method="none"), learn=False)
    outs = [engine.generate(NO_REPEATS, params, COST_SPEC) for _ in range(6)]
    assert all(out.token_ids == plain.token_ids for out in outs)
    drafts = [out.metrics.spec.per_drafter.get("draft") for out in outs]
    assert any(d is not None and d.num_drafts >= 2 for d in drafts)  # a probe and its follow-up
    assert sum(d.num_drafts for d in drafts if d is not None) <= 2 * len(outs)  # now and then, not every step


@pytest.mark.parametrize("output_lengths, max_tokens, drafts", [([8] * 4, 8, False), ([100] * 4, 40, True)])
def test_a_probe_pays_a_drafts_prefill_only_where_the_answer_would_repay_it(output_lengths, max_tokens, drafts):
    """A switched-off draft (acceptance estimate 0) is probed every third step; the probe's first
    proposal feeds the prompt (5 plain steps). Priced at the prior acceptance (0.6: ~1.5x), the
    rest of a short answer (~5 tokens) saves ~1.7 steps, of a long one ~12."""
    engine = frozen_cycle_engine(output_lengths, controller=ControllerConfig(probe_interval=2))
    engine.cost_model.last_alpha["draft"] = 0.0
    params = SamplingParams(max_tokens=max_tokens)
    plain = engine.generate(NO_REPEATS, params, SpeculativeConfig(method="none"), learn=False)
    state = engine.start(NO_REPEATS, params, COST_SPEC, learn=False)
    while not state.finished:
        engine.step([state])
    assert state.output.token_ids == plain.token_ids
    assert (state.output.metrics.spec.num_draft_tokens > 0) == drafts
    assert (state.policy.num_declined_catch_ups > 0) == (not drafts)
