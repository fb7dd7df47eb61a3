"""Quality audit: selection, the queue that never blocks a response, and the comparisons."""

import dataclasses

import pytest
import torch

from helpers import make_engine
from verispec.algorithms.sampling import SamplingParams
from verispec.bench.audit import QualityAuditor, describe_audit, first_difference, target_logprobs
from verispec.engine import SpeculativeConfig
from verispec.errors import InvalidParameterError

GREEDY = SamplingParams(max_tokens=12)
DRAFT = SpeculativeConfig(method="draft", num_speculative_tokens=4)
PROMPT = [3, 17, 42, 5]


@pytest.mark.parametrize(
    "ours, plain, expected",
    [
        ([1, 2, 3], [1, 2, 3], None),  # equal
        ([1, 9, 3], [1, 2, 3], 1),  # differs at token 1
        ([1, 2], [1, 2, 3], 2),  # ours stopped early: the missing token is the difference
        ([], [], None),
    ],
)
def test_first_difference(ours, plain, expected):
    assert first_difference(ours, plain) == expected


@pytest.mark.parametrize("rate, selected", [(0.0, 0), (1.0, 1000)])
def test_rate_zero_and_one(rate, selected):
    auditor = QualityAuditor(rate, seed=0)
    assert sum(auditor.select() for _ in range(1000)) == selected
    assert auditor.counts.requests == 1000


def test_rate_is_a_seeded_fraction():
    draws = [QualityAuditor(0.3, seed=7) for _ in range(2)]
    picks = [[a.select() for _ in range(2000)] for a in draws]
    assert picks[0] == picks[1]  # same seed, same requests audited
    assert 0.27 < sum(picks[0]) / 2000 < 0.33


@pytest.mark.parametrize("rate, max_pending", [(-0.1, 4), (1.5, 4), (0.5, 0)])
def test_bad_settings(rate, max_pending):
    with pytest.raises(InvalidParameterError):
        QualityAuditor(rate, max_pending=max_pending)


class CountingEngine:
    """Wraps an engine and counts generate calls (to see when the audit decodes)."""

    def __init__(self, engine):
        self.inner, self.target, self.calls = engine, engine.target, 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        return self.inner.generate(*args, **kwargs)


def test_submit_decodes_nothing_and_run_pending_audits_later(target_model, random_draft_model):
    engine = make_engine(target_model, random_draft_model)
    output = engine.generate(PROMPT, GREEDY, DRAFT)
    counting = CountingEngine(engine)
    auditor = QualityAuditor(1.0)
    assert auditor.submit(PROMPT, GREEDY, output, request_id="r1")
    assert counting.calls == 0 and auditor.num_pending == 1  # the response is not held up
    [result] = auditor.run_pending(counting)
    assert counting.calls == 1 and auditor.num_pending == 0
    assert result.agreed and result.first_difference is None  # speculative greedy == plain greedy
    assert (auditor.counts.audited, auditor.counts.agreed, auditor.counts.agreement_rate) == (1, 1, 1.0)
    assert describe_audit(result) == "output equals plain decoding token for token"


def test_a_full_queue_drops_the_audit_instead_of_waiting(target_model):
    engine = make_engine(target_model)
    output = engine.generate(PROMPT, GREEDY, SpeculativeConfig(method="none"))
    auditor = QualityAuditor(1.0, max_pending=1)
    assert auditor.submit(PROMPT, GREEDY, output)
    assert not auditor.submit(PROMPT, GREEDY, output)
    assert (auditor.counts.selected, auditor.counts.dropped, auditor.num_pending) == (2, 1, 1)


def test_a_differing_output_is_counted_with_where_it_differs(target_model):
    engine = make_engine(target_model)
    output = engine.generate(PROMPT, GREEDY, SpeculativeConfig(method="none"))
    wrong = dataclasses.replace(
        output, token_ids=output.token_ids[:3] + [(output.token_ids[3] + 1) % 96] + output.token_ids[4:]
    )
    auditor = QualityAuditor(1.0)
    result = auditor.audit(engine, PROMPT, GREEDY, wrong, request_id="bad")
    assert (result.agreed, result.first_difference) == (False, 3)
    assert auditor.counts.disagreements == [{"request": "bad", "first_difference": 3}]
    assert auditor.counts.agreement_rate == 0.0
    assert "DIFFERS" in describe_audit(result)


def test_target_logprobs_match_a_plain_forward(target_model):
    engine = make_engine(target_model)
    params = SamplingParams(temperature=0.7, max_tokens=6, seed=1)
    output = engine.generate(PROMPT, params, SpeculativeConfig(method="none"))
    got = target_logprobs(engine.target, PROMPT, output.token_ids, params)
    ids = torch.tensor([PROMPT + output.token_ids[:-1]])
    with torch.no_grad():
        logits = target_model(ids).logits[0, len(PROMPT) - 1 :]
    expected = torch.log_softmax(logits / 0.7, dim=-1)[
        torch.arange(len(output.token_ids)), torch.tensor(output.token_ids)
    ]
    assert torch.allclose(got, expected, atol=1e-4)
    assert engine.target.num_cached_tokens == 0
    with pytest.raises(InvalidParameterError):
        target_logprobs(engine.target, PROMPT, output.token_ids, GREEDY)


def test_sampling_audit_records_log_probabilities(target_model, partial_draft_model):
    engine = make_engine(target_model, partial_draft_model)
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=3)
    output = engine.generate(PROMPT, params, DRAFT)
    auditor = QualityAuditor(1.0)
    result = auditor.audit(engine, PROMPT, params, output)
    assert not result.greedy and result.agreed is None
    counts = auditor.counts
    assert (counts.sampled, counts.output_logprob_tokens) == (1, len(output.token_ids))
    assert counts.mean_output_logprob <= 0 and counts.mean_plain_logprob <= 0
    assert "log-prob" in describe_audit(result)
