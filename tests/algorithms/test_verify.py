"""Greedy verification and modified rejection sampling on hand-built inputs."""

import pytest
import torch

from verispec.algorithms.verify import (
    accepted_prefix_length,
    greedy_verify,
    pad_vocab,
    rejection_sample,
    residual_distribution,
)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "mask, expected",
    [
        ([1, 0, 1, 0], 1),  # only the prefix counts: position 2 is unreachable after a rejection
        ([1, 1, 1, 1], 4),  # all accepted
        ([0, 1, 1, 1], 0),  # first rejected
        ([], 0),  # nothing drafted
        ([1, 1, 0], 2),
    ],
)
def test_accepted_prefix_length(mask, expected):
    assert accepted_prefix_length([bool(m) for m in mask]) == expected


@pytest.mark.parametrize(
    "draft, target, accepted, tokens, bonus",
    [
        ([5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8], True),  # full accept, 8 is the bonus token
        ([5, 6, 7], [5, 9, 7, 8], 1, [5, 9], False),  # mismatch at 1: target's 9 replaces 6
        ([5, 6, 7], [4, 6, 7, 8], 0, [4], False),  # first rejected: plain decoding's token
        ([], [3], 0, [3], True),  # no draft: one plain step
    ],
)
def test_greedy_verify(draft, target, accepted, tokens, bonus):
    result = greedy_verify(draft, torch.tensor(target))
    assert (result.num_accepted_tokens, result.token_ids, result.is_bonus) == (accepted, tokens, bonus)


def test_greedy_verify_rejects_wrong_row_count():
    with pytest.raises(ValueError):
        greedy_verify([1, 2], torch.tensor([1, 2]))


def test_rejection_accepts_when_target_at_least_draft():
    # target_probs[x] >= draft_probs[x] at every position: always accepted, then a bonus from row 2
    draft_probs = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    target_probs = torch.tensor([[0.2, 0.8, 0.0], [0.9, 0.1, 0.0], [0.0, 0.0, 1.0]])
    for seed in range(50):
        result = rejection_sample([1, 0], draft_probs, target_probs, gen(seed))
        assert result.token_ids == [1, 0, 2] and result.is_bonus


def test_rejection_always_rejects_token_target_gives_zero():
    # target gives token 0 probability 0: rejected; residual = normalize(max(0, t - d)) = token 2
    target_probs = torch.tensor([[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]])
    draft_probs = torch.tensor([[0.6, 0.4, 0.0]])
    for seed in range(50):
        result = rejection_sample([0], draft_probs, target_probs, gen(seed))
        assert result.num_accepted_tokens == 0 and result.token_ids == [2] and not result.is_bonus


def test_residual_formula():
    target = torch.tensor([0.1, 0.5, 0.4])
    draft = torch.tensor([0.3, 0.2, 0.5])
    # max(0, t - d) = [0, 0.3, 0] -> normalized [0, 1, 0]
    assert torch.allclose(residual_distribution(target, draft), torch.tensor([0.0, 1.0, 0.0]))
    target = torch.tensor([0.4, 0.4, 0.2])
    draft = torch.tensor([0.1, 0.2, 0.7])
    # [0.3, 0.2, 0] / 0.5
    assert torch.allclose(residual_distribution(target, draft), torch.tensor([0.6, 0.4, 0.0]))
    # equal distributions: no residual mass; the target itself is returned
    assert torch.equal(residual_distribution(target, target), target)


def test_one_hot_draft_accepts_with_target_probability():
    target_probs = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    accepted = sum(rejection_sample([0], None, target_probs, gen(s)).num_accepted_tokens for s in range(4000))
    assert abs(accepted / 4000 - 0.25) < 0.03
    # after rejecting token 0 the residual is the target without 0: always token 1
    for s in range(200):
        result = rejection_sample([0], None, target_probs, gen(s))
        if result.num_accepted_tokens == 0:
            assert result.token_ids == [1]


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_first_token_distribution_matches_target_over_20000_draws():
    """Sampling x ~ draft then verifying gives exactly target_probs at the first position."""
    draft_probs = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    target_probs = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    next_target = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    generator = gen(1234)
    counts = torch.zeros(5)
    num_draws = 20000
    for _ in range(num_draws):
        x = int(torch.multinomial(draft_probs, 1, generator=generator))
        result = rejection_sample([x], draft_probs[None], torch.stack([target_probs, next_target]), generator)
        counts[result.token_ids[0]] += 1
    # Std of each frequency is <= 0.0035; a TV of 0.02 is > 5 sigma away for this vocab.
    assert total_variation(counts, target_probs) < 0.02
    # ...and the test can fail: the draft's own distribution is far from the target's.
    assert 0.5 * float((draft_probs - target_probs).abs().sum()) > 0.3


def test_pad_vocab():
    probs = torch.tensor([[0.5, 0.5]])
    assert pad_vocab(probs, 4).tolist() == [[0.5, 0.5, 0.0, 0.0]]
    assert pad_vocab(probs, 2) is probs
    with pytest.raises(ValueError):
        pad_vocab(probs, 1)


def test_draft_token_beyond_target_vocab_is_rejected():
    # draft (width 4) proposes token 3; target has width 3 (padded with a zero column): rejected
    draft_probs = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    target_probs = pad_vocab(torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]]), 4)
    result = rejection_sample([3], draft_probs, target_probs, gen(0))
    assert result.num_accepted_tokens == 0 and result.token_ids[0] in (0, 1, 2)
