"""Sampling parameters and the logits pipeline (penalties, temperature, top-k, top-p)."""

import pytest
import torch

from verispec.algorithms.sampling import SamplingParams, apply_penalties, logits_to_probs, process_logits
from verispec.errors import InvalidParameterError


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},  # negative temperature
        {"temperature": 1e-39},  # would overflow float32 logits to inf/NaN: use 0 for greedy
        {"repetition_penalty": 1e-300},  # likewise
        {"top_p": 0.0},  # empty nucleus
        {"top_p": 1.5},
        {"top_k": -1},
        {"max_tokens": 0},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"stop": ("",)},  # an empty stop string would stop immediately
    ],
)
def test_invalid_params_raise(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


def test_stop_accepts_str_and_list():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_top_k_keeps_k_most_likely():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs[0, 0] == 0 and probs[0, 3] == 0
    assert torch.allclose(probs[0, 1:3], torch.softmax(torch.tensor([3.0, 2.0]), 0))


def test_top_p_keeps_smallest_set_reaching_p():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs_in.log()
    # mass before each sorted token: 0, .5, .8, .95 -> top_p=0.8 keeps the first two
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))
    # a tiny top_p (even one that is 0 in float32) still keeps the most likely token
    for top_p in (0.01, 1e-46):
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(torch.tensor([[0.0, 2.0]]), -1))


def test_greedy_has_no_distribution():
    with pytest.raises(InvalidParameterError):
        logits_to_probs(torch.zeros(1, 3), SamplingParams())
    rows = process_logits(torch.tensor([[0.0, 2.0, 1.0]]), SamplingParams(), [], [])
    assert rows.greedy_token_ids.tolist() == [1] and rows.probs is None


def test_repetition_penalty_rows_see_the_draft_prefix():
    # row i is penalised for prompt + output + draft[:i]: row 0 sees token 2 (prompt),
    # row 1 additionally sees draft token 1.
    logits = torch.tensor([[2.0, 2.0, 2.0, -1.0]] * 2)
    params = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, params, prompt_token_ids=[2], output_token_ids=[3], appended_token_ids=[1])
    assert out.tolist() == [[2.0, 2.0, 1.0, -2.0], [2.0, 1.0, 1.0, -2.0]]


def test_frequency_and_presence_count_output_tokens_only():
    logits = torch.zeros(2, 3)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = apply_penalties(logits, params, prompt_token_ids=[0], output_token_ids=[1, 1], appended_token_ids=[2])
    # token 0 only in the prompt: untouched; token 1 twice: -(0.5*2 + 1); token 2 from row 1 on
    assert out.tolist() == [[0.0, -2.0, 0.0], [0.0, -2.0, -1.5]]


def test_penalised_rows_equal_sequential_plain_steps():
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    prompt, output, draft = [1, 2], [3, 3], [4, 5, 3]
    batched = apply_penalties(logits, params, prompt, output, draft)
    for i in range(4):
        single = apply_penalties(logits[i : i + 1], params, prompt, output + draft[:i])
        assert torch.equal(batched[i], single[0])
