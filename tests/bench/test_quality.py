"""Quality figures against the float32 model: top-1 agreement and KL, as pure functions."""

import math

import pytest
import torch

from verispec.bench.quality import QualityResult, compare_logits


@pytest.mark.parametrize(
    "reference, logits, agreements, kl",
    [
        ([[0.0, 0.0]], [[0.0, 0.0]], 1, 0.0),  # identical: agree, no divergence
        (
            [[0.0, 0.0]],
            [[math.log(9.0), 0.0]],
            1,
            0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1),
        ),  # p=(.5,.5), q=(.9,.1)
        ([[2.0, 0.0], [0.0, 2.0]], [[0.0, 2.0], [0.0, 2.0]], 1, None),  # second row agrees, first does not
    ],
)
def test_compare_logits(reference, logits, agreements, kl):
    result = QualityResult("r")
    compare_logits(torch.tensor(reference), torch.tensor(logits), result)
    assert result.positions == len(reference) and result.top1_agreements == agreements
    if kl is not None:
        assert result.kl_sum == pytest.approx(kl, abs=1e-6)  # float32 logits
    assert result.to_dict()["top1_agreement"] == agreements / len(reference)


def test_padding_rows_beyond_the_reference_are_ignored():
    result = QualityResult("r")
    compare_logits(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0, 50.0]]), result)  # a wider logits row
    assert result.top1_agreements == 1 and result.kl_sum == pytest.approx(0.0)
