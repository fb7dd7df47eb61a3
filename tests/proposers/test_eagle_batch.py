"""Several requests drafting with one EAGLE head in shared passes (``EagleProposer.propose_batch``,
``forward_heads``): each request gets the drafts it would get alone, bit for bit where the head's
linear layers run on the batch-invariant block kernels; heads of other weights are refused (the
engine's batched steps, one head pass per draft step: test_eagle_drafter.py)."""

import pytest
import torch

from verispec.algorithms.sampling import SamplingParams
from verispec.errors import InvalidParameterError
from verispec.proposers import DraftRequest
from verispec.proposers.eagle import EagleProposer
from verispec.runners.eagle.blocks import quantize_head_
from verispec.runners.eagle.head import EagleHead
from verispec.runners.eagle.passes import HeadCall, forward_heads
from verispec.runners.torch_runner import TransformersRunner


@pytest.fixture(scope="module")
def head(trained_head):
    """The trained head (this module's own instance) with its linear layers as Q8_0 blocks on the
    gguf kernels (batch-invariant)."""
    return quantize_head_(trained_head, "q8_0")


def fed(target, head, context):
    runner = TransformersRunner(target, max_context_length=128)
    runner.capture_features(head.shape.feature_layers)
    runner.forward(context)
    proposer = EagleProposer(head.new_sequence())
    proposer.observe_features(runner.last_features[:-1], 0)
    return proposer


CONTEXTS = [[5, 17, 33, 2, 9, 40, 41], [70, 3, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [88, 12]]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)])
def test_a_batch_drafts_what_each_request_drafts_alone(target, head, params):
    def requests():
        return [DraftRequest(c[:2], c[2:], params, torch.Generator().manual_seed(i)) for i, c in enumerate(CONTEXTS)]

    ks = [4, 1, 3, 5]
    alone = [fed(target, head, c).propose(r, k) for c, r, k in zip(CONTEXTS, requests(), ks)]
    batch = EagleProposer.propose_batch([(fed(target, head, c), r, k) for c, r, k in zip(CONTEXTS, requests(), ks)])
    assert [len(a.draft_token_ids) for a in alone] == ks  # every chain ran to its length
    for a, b in zip(alone, batch):
        assert a.draft_token_ids == b.draft_token_ids
        assert (a.draft_probs is None) == (b.draft_probs is None)
        if a.draft_probs is not None:
            assert torch.equal(a.draft_probs, b.draft_probs)  # bit for bit


def test_one_pass_scores_several_heads_rows_as_each_alone(target, head):
    heads = [head.new_sequence() for _ in range(3)]
    features = [torch.randn(n, head.fc.in_features, generator=torch.Generator().manual_seed(n)) for n in (3, 1, 5)]
    alone = [h.new_sequence()(list(range(1, f.shape[0] + 1)), features=f) for h, f in zip(heads, features)]
    together = forward_heads([HeadCall(h, list(range(1, f.shape[0] + 1)), features=f) for h, f in zip(heads, features)])
    for (la, ha), (lt, ht) in zip(alone, together):
        assert torch.equal(la, lt) and torch.equal(ha, ht)
    assert [h.num_cached_tokens for h in heads] == [3, 1, 5]  # each call's rows in its own cache
    other = EagleHead.from_target(target, seed=1)
    with pytest.raises(InvalidParameterError, match="share their weights"):
        forward_heads([HeadCall(heads[0], [1], features=features[1]), HeadCall(other, [1], features=features[1])])
