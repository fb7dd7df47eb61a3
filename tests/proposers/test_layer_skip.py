"""Layer-skip self-speculation: shared weights, untouched target, consistent cache, exactness."""

import pytest
import torch

from helpers import make_engine, single_thread, tiny_qwen2
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.errors import InvalidParameterError
from verispec.proposers.layer_skip import LayerSkipProposer, early_exit_model
from verispec.runners import prefill
from verispec.runners.torch_runner import TransformersRunner

CONTEXT = [3, 14, 15, 92, 65, 35, 89, 79]


@pytest.fixture(scope="module")
def deep_target():
    return tiny_qwen2(seed=3, num_layers=4)


def test_shares_weights_and_leaves_the_target_untouched(deep_target):
    config_before = deep_target.config.to_dict()
    tensors_before = {name: t.data_ptr() for name, t in deep_target.state_dict().items()}
    shallow = early_exit_model(deep_target, 2)
    shallow_ptrs = {t.data_ptr() for t in shallow.state_dict().values()}
    assert shallow_ptrs <= set(tensors_before.values())  # nothing copied
    assert len(shallow.model.layers) == 2 and shallow.config.num_hidden_layers == 2
    TransformersRunner(shallow).forward(CONTEXT)
    assert deep_target.config.to_dict() == config_before  # the shared config was not rewritten
    assert deep_target.config.num_hidden_layers == 4 and len(deep_target.model.layers) == 4
    assert {name: t.data_ptr() for name, t in deep_target.state_dict().items()} == tensors_before


def test_full_depth_equals_the_target(deep_target):
    full = TransformersRunner(early_exit_model(deep_target, 4)).forward(CONTEXT)
    assert torch.equal(full, TransformersRunner(deep_target).forward(CONTEXT))


def test_early_exit_equals_a_truncated_model(deep_target):
    """First 2 layers + final norm + head == a 2-layer model holding the same weights."""
    two_layers = tiny_qwen2(seed=99, num_layers=2)
    state = {k: v for k, v in deep_target.state_dict().items() if ".layers.2." not in k and ".layers.3." not in k}
    two_layers.load_state_dict(state)
    expected = TransformersRunner(two_layers).forward(CONTEXT)
    assert torch.allclose(TransformersRunner(early_exit_model(deep_target, 2)).forward(CONTEXT), expected, atol=1e-6)


@pytest.mark.parametrize("num_rejected", [0, 2, 5])  # none rejected (no-op truncate), some, all
def test_rollback_equals_fresh_prefill(deep_target, num_rejected):
    draft = [32, 38, 46, 26, 43]
    runner = TransformersRunner(early_exit_model(deep_target, 2))
    prefill(runner, CONTEXT)
    runner.forward(draft)
    keep = len(CONTEXT) + len(draft) - num_rejected
    runner.truncate(keep)
    after = runner.forward([7])
    fresh = TransformersRunner(early_exit_model(deep_target, 2)).forward((CONTEXT + draft)[:keep] + [7], num_logits=1)
    assert torch.allclose(after, fresh, atol=1e-5)


@pytest.mark.parametrize("num_layers", [0, 5])
def test_layer_count_out_of_range_is_refused(deep_target, num_layers):
    with pytest.raises(InvalidParameterError):
        early_exit_model(deep_target, num_layers)


def test_unsupported_layout_is_refused():
    with pytest.raises(InvalidParameterError):
        early_exit_model(torch.nn.Linear(2, 2), 1)


PROMPTS = [[5, 17, 33, 2, 9, 5, 17, 33], [70, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY_32 = SamplingParams(max_tokens=32)


@pytest.fixture(scope="module")
def plain_outputs(deep_target):
    engine = make_engine(deep_target)
    return [engine.generate(p, GREEDY_32, SpeculativeConfig(method="none")).token_ids for p in PROMPTS]


@pytest.mark.parametrize("num_layers", [1, 2, 4])  # 1, 2 of 4: partial; 4: the target drafting for itself
@pytest.mark.parametrize("k", range(1, 9))
def test_layer_skip_greedy_equals_plain(num_layers, k, deep_target, plain_outputs):
    engine = make_engine(deep_target, proposers={"layer-skip": LayerSkipProposer(deep_target, num_layers)})
    for prompt, expected in zip(PROMPTS, plain_outputs):
        out = engine.generate(
            prompt, GREEDY_32, SpeculativeConfig(method="layer-skip", num_speculative_tokens=k, schedule="constant")
        )
        assert out.token_ids == expected
        if num_layers == 4:
            assert out.metrics.spec.acceptance_rate == 1.0
    assert deep_target.config.num_hidden_layers == 4


def test_layer_skip_acceptance_grows_with_depth(deep_target):
    rates = []
    for num_layers in (1, 3, 4):
        engine = make_engine(deep_target, proposers={"layer-skip": LayerSkipProposer(deep_target, num_layers)})
        stats = [
            engine.generate(p, GREEDY_32, SpeculativeConfig(method="layer-skip", schedule="constant")).metrics.spec
            for p in PROMPTS
        ]
        rates.append(sum(s.num_accepted_tokens for s in stats) / sum(s.num_draft_tokens for s in stats))
    assert rates[0] <= rates[1] <= rates[2] == 1.0


def test_draft_stop_threshold_shortens_drafts(deep_target, plain_outputs):
    engine = make_engine(deep_target, proposers={"layer-skip": LayerSkipProposer(deep_target, 1)})
    drafted = {}
    for threshold in (0.0, 0.9):
        spec = SpeculativeConfig(
            method="layer-skip", num_speculative_tokens=8, draft_stop_threshold=threshold, schedule="constant"
        )
        outs = [engine.generate(p, GREEDY_32, spec) for p in PROMPTS]
        assert [o.token_ids for o in outs] == plain_outputs  # still lossless
        drafted[threshold] = sum(o.metrics.spec.num_draft_tokens for o in outs) / sum(
            o.metrics.spec.num_drafts for o in outs
        )
    assert drafted[0.0] > 7 and drafted[0.9] < drafted[0.0]  # unsure drafts stop early
