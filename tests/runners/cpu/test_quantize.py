"""Int8 weight-only draft quantization: accuracy of the format, exactness, pipeline wiring."""

import pytest
import torch

from helpers import VocabTokenizer, default_pieces, make_engine, perturbed_copy, single_thread
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import DrafterOptions, SpeculativePipeline
from verispec.errors import InvalidParameterError
from verispec.models.loading import LoadedModel
from verispec.runners.cpu.quantize import Int8Linear, quantize_linear_layers, quantize_rows_int8


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(16, 32, generator=torch.Generator().manual_seed(0)),  # ordinary rows
        torch.zeros(3, 8),  # all-zero rows: scale 1, no division by zero
        torch.tensor([[1.0, -127.0, 0.5], [1e-6, 2e-6, -3e-6]]),  # rows of very different size
    ],
)
def test_rows_round_trip_within_half_a_step(weight):
    int8_weight, scales = quantize_rows_int8(weight)
    assert int8_weight.dtype == torch.int8 and scales.shape == (weight.shape[0],)
    error = (int8_weight.float() * scales[:, None] - weight).abs()
    assert torch.all(error <= scales[:, None] / 2 + 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_the_dequantized_weight(dtype):
    linear = torch.nn.Linear(32, 24).to(dtype)
    quantized = Int8Linear(linear)
    x = torch.randn(2, 5, 32, dtype=dtype)
    expected = torch.nn.functional.linear(x, quantized.int8_weight.to(dtype) * quantized.scales[:, None], linear.bias)
    out = quantized(x)
    assert out.shape == (2, 5, 24) and out.dtype == dtype
    assert torch.allclose(out.float(), expected.float(), atol=0.05 if dtype == torch.bfloat16 else 1e-4)


@pytest.fixture(scope="module")
def int8_draft(target_model):
    return quantize_linear_layers(perturbed_copy(target_model, noise=0.0, seed=0), "int8")


def test_quantized_model_stays_close(target_model, int8_draft):
    assert isinstance(int8_draft.lm_head, Int8Linear)
    tokens = torch.tensor([[5, 17, 33, 2, 9, 70, 3]])
    with torch.no_grad():
        exact, quantized = target_model(tokens).logits, int8_draft(tokens).logits
    assert (exact.argmax(-1) == quantized.argmax(-1)).float().mean() > 0.8


PROMPTS = [[5, 17, 33, 2, 9], [70, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_int8_draft_greedy_equals_plain(k, target_model, int8_draft):
    plain = make_engine(target_model)
    engine = make_engine(target_model, int8_draft)
    rates = []
    for prompt in PROMPTS:
        expected = plain.generate(prompt, SamplingParams(max_tokens=24), SpeculativeConfig(method="none")).token_ids
        out = engine.generate(
            prompt, SamplingParams(max_tokens=24), SpeculativeConfig(num_speculative_tokens=k, schedule="constant")
        )
        assert out.token_ids == expected
        rates.append(out.metrics.spec.acceptance_rate)
    assert min(rates) > 0.5  # the int8 copy of the target mostly agrees with it


def loaded(name, model):
    tokenizer = VocabTokenizer(default_pieces(model.config.vocab_size))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return LoadedModel(name, model, tokenizer, None, 0.0, size, (0,), 256, model.config.vocab_size)


def test_pipeline_quantizes_the_draft_and_builds_every_drafter(target_model):
    draft = loaded("draft", perturbed_copy(target_model, noise=0.1, seed=5))
    size_before = draft.param_bytes
    pipe = SpeculativePipeline(loaded("target", target_model), draft, DrafterOptions(draft_quantization="int8"))
    assert isinstance(pipe.draft.model.lm_head, Int8Linear) and pipe.draft.param_bytes < size_before / 2
    assert {"draft", "layer-skip", "ngram"} <= set(pipe.engine.proposers)
    assert not isinstance(target_model.lm_head, Int8Linear)  # the target is never quantized
    for method in ("draft", "ngram", "layer-skip", "auto"):
        out = pipe.engine.generate(
            [5, 17, 33, 5, 17],
            SamplingParams(max_tokens=8, ignore_eos=True),
            SpeculativeConfig(method=method, schedule="constant"),
        )
        assert len(out.token_ids) == 8


@pytest.mark.parametrize(
    "options, error",
    [
        (DrafterOptions(draft_quantization="int8"), "target model itself"),  # would quantize the target
        (DrafterOptions(layer_skip_layers=9), "layer-skip layers"),  # more layers than the target has
    ],
)
def test_pipeline_refuses(target_model, options, error):
    with pytest.raises(InvalidParameterError, match=error):
        SpeculativePipeline(loaded("target", target_model), loaded("draft", target_model), options)


def test_unknown_quantization_is_refused():
    with pytest.raises(InvalidParameterError):
        DrafterOptions(draft_quantization="int4")
