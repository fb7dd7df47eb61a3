"""TransformersRunner: KV rollback equals a fresh prefill; protocol edge cases."""

import pytest
import torch

from verispec.runners import Runner, prefill
from verispec.runners.torch_runner import TransformersRunner

CONTEXT = [3, 14, 15, 92, 65, 35, 89, 79]
DRAFT = [32, 38, 46, 26, 43]


@pytest.mark.parametrize(
    "num_rejected",
    [0, 2, 5],  # none rejected (truncate is a no-op), some, all drafted tokens rejected
)
def test_rollback_equals_fresh_prefill(target_model, num_rejected):
    runner = TransformersRunner(target_model)
    prefill(runner, CONTEXT)
    runner.forward(DRAFT)
    keep = len(CONTEXT) + len(DRAFT) - num_rejected
    runner.truncate(keep)
    assert runner.num_cached_tokens == keep
    next_token = [7]
    after_rollback = runner.forward(next_token)

    fresh = TransformersRunner(target_model)
    expected = fresh.forward((CONTEXT + DRAFT)[:keep] + next_token, num_logits=1)
    assert torch.allclose(after_rollback, expected, atol=1e-5, rtol=1e-5)


def test_forward_returns_rows_for_each_token(target_model):
    runner = TransformersRunner(target_model)
    logits = runner.forward(CONTEXT)
    assert logits.shape == (len(CONTEXT), target_model.config.vocab_size) and logits.dtype == torch.float32
    assert runner.forward([1, 2, 3], num_logits=1).shape == (1, target_model.config.vocab_size)


def test_truncate_zero_empties_and_bounds_are_checked(target_model):
    runner = TransformersRunner(target_model)
    assert isinstance(runner, Runner)
    runner.forward(CONTEXT)
    with pytest.raises(ValueError):
        runner.truncate(len(CONTEXT) + 1)
    runner.truncate(0)
    assert runner.num_cached_tokens == 0
    # a fresh start after emptying gives the same logits as a new runner
    assert torch.allclose(runner.forward(CONTEXT[:3]), TransformersRunner(target_model).forward(CONTEXT[:3]), atol=1e-6)


def test_forward_past_context_window_is_refused(target_model):
    runner = TransformersRunner(target_model, max_context_length=10)
    runner.forward(CONTEXT)
    with pytest.raises(ValueError, match="context length"):
        runner.forward([1, 2, 3])
    assert runner.num_cached_tokens == len(CONTEXT)
