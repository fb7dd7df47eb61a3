"""Reduced-vocabulary draft head (FR-Spec): the kept set, zero draft mass outside it, lossless output."""

import pytest
import torch

from helpers import CharTokenizer, default_pieces, single_thread
from verispec.algorithms.sampling import SamplingParams, logits_to_probs
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.cpu.reduced_vocab import coverage, rank_counts, select_vocabulary, token_counts

PROMPTS = [[5, 17, 33, 2, 9], [70, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.mark.parametrize(
    "counts, size, always, expected",
    [
        ([5, 0, 9, 9, 1], 2, (), [2, 3]),  # the two most frequent
        ([5, 0, 9, 9, 1], 1, (), [2]),  # tie on count: lower id first
        ([5, 0, 9, 9, 1], 1, (1,), [1, 2]),  # always-kept ids (EOS) come on top of size
        ([0, 0, 0, 0, 0], 3, (), [0, 1, 2]),  # no counts at all: lowest ids
    ],
)
def test_select_vocabulary(counts, size, always, expected):
    assert select_vocabulary(torch.tensor(counts), size, always).tolist() == expected


@pytest.mark.parametrize("size, always", [(0, ()), (6, ()), (2, (5,))])  # empty, too large, unknown id
def test_select_vocabulary_refuses_bad_input(size, always):
    with pytest.raises(ValueError):
        select_vocabulary(torch.ones(5), size, always)


def test_counts_rank_and_coverage():
    counts = token_counts([[1, 1, 2], [2, 2, 7, 99]], vocab_size=8)  # 99 is outside and ignored
    assert counts.tolist() == [0, 2, 3, 0, 0, 0, 0, 1]
    assert coverage(counts, torch.tensor([1, 2])) == pytest.approx(5 / 6)
    assert select_vocabulary(rank_counts(8), 3).tolist() == [0, 1, 2]


def test_reduced_head_gives_minus_inf_outside_and_same_logits_inside(target_model):
    kept = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89])
    full = Int8Runner.from_module(target_model).forward(PROMPTS[2])
    reduced = Int8Runner.from_module(target_model, head_token_ids=kept).forward(PROMPTS[2])
    assert reduced.shape == full.shape
    assert torch.equal(reduced[:, kept], full[:, kept])
    outside = torch.ones(full.shape[1], dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(reduced[:, outside]).all()
    draft_probs = logits_to_probs(reduced, SamplingParams(temperature=0.8))
    assert draft_probs[:, outside].sum() == 0 and torch.allclose(draft_probs.sum(-1), torch.ones(len(PROMPTS[2])))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_with_reduced_draft_head_equals_plain(target_model, k):
    pieces = CharTokenizer(default_pieces(target_model.config.vocab_size))
    target = Int8Runner.from_module(target_model, max_context_length=128)
    kept = select_vocabulary(rank_counts(target.vocab_size), 48)  # half the vocabulary
    drafter = DraftModelProposer(Int8Runner.from_module(target_model, max_context_length=128, head_token_ids=kept))
    engine = SpeculativeEngine(target, pieces, eos_token_ids=(), proposers={"draft": drafter})
    params = SamplingParams(max_tokens=30)
    for prompt in PROMPTS:
        plain = engine.generate(prompt, params, SpeculativeConfig(method="none")).token_ids
        out = engine.generate(prompt, params, SpeculativeConfig(num_speculative_tokens=k, schedule="constant"))
        assert out.token_ids == plain
        drafted_outside = [t for t in out.token_ids if t not in set(kept.tolist())]
        assert out.metrics.spec.acceptance_rate < 1.0 or not drafted_outside  # it cannot draft those


def test_sampling_with_reduced_draft_head_keeps_target_distribution(target_model):
    """The draft can only propose even ids; odd ids must still come out at the target's rate."""
    pieces = CharTokenizer(default_pieces(target_model.config.vocab_size))
    target = Int8Runner.from_module(target_model, max_context_length=64)
    kept = torch.arange(0, target.vocab_size, 2)
    drafter = DraftModelProposer(Int8Runner.from_module(target_model, max_context_length=64, head_token_ids=kept))
    engine = SpeculativeEngine(target, pieces, eos_token_ids=(), proposers={"draft": drafter})
    prompt, params = PROMPTS[0], SamplingParams(temperature=2.0, max_tokens=2)
    first = int(target.forward(prompt, num_logits=1).argmax())  # condition on the likeliest first token
    target_probs = logits_to_probs(target.forward([first]), params)[0]
    seconds = []
    for seed in range(300):
        out = engine.generate(
            prompt,
            SamplingParams(temperature=2.0, max_tokens=2, seed=seed),
            SpeculativeConfig(num_speculative_tokens=1, schedule="constant"),
        )
        if out.token_ids[0] == first:
            seconds.append(out.token_ids[1])  # decided by verifying the draft's one token
    expected_odd = float(target_probs[1::2].sum())
    observed_odd = sum(t % 2 for t in seconds) / len(seconds)
    tolerance = 4 * (expected_odd * (1 - expected_odd) / len(seconds)) ** 0.5 + 0.01
    assert len(seconds) > 30 and abs(observed_odd - expected_odd) < tolerance
