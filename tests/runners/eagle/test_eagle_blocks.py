"""An EAGLE head's linear layers in GGUF blocks (runners/eagle/blocks.py): each layer close to its
float32 original, the drafts of a quantized trained head still accepted, and the output still equal
to plain decoding token for token (the target verifies whatever the head proposes)."""

import copy

import pytest
import torch
from torch import nn

from eagle_support import engine_with, generate_all, gguf_head
from gguf_models import write_gguf_model
from helpers import VOCAB
from verispec.errors import InvalidParameterError
from verispec.proposers.factory import DrafterOptions, build_drafters
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.eagle.blocks import HEAD_LINEARS, BlockLinear, quantize_head_


def relative_error(got, want):
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("quantization, bound", [("q8_0", 0.02), ("iq4_nl", 0.2)])
def test_each_quantized_layer_is_close_to_its_float_original(trained_head, quantization, bound):
    quantized = quantize_head_(copy.deepcopy(trained_head), quantization)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    errors = {}
    for name in HEAD_LINEARS:
        original, block = getattr(trained_head, name), getattr(quantized, name)
        assert isinstance(block, BlockLinear) and isinstance(original, nn.Linear)
        rows = x[:, : original.in_features].contiguous()
        with torch.no_grad():
            errors[name] = relative_error(block(rows), original(rows))
    assert max(errors.values()) < bound, errors
    assert min(errors.values()) > 0.0  # really quantized, not a float copy
    assert quantized.quantization == quantization


def test_a_quantized_head_drafts_nearly_as_well_and_the_output_stays_plain(target, trained_head):
    runner = Int8Runner.from_module(target, max_context_length=128)
    float_engine = engine_with(runner, trained_head.new_sequence(), VOCAB)
    plain = generate_all(float_engine, "none")
    floats = generate_all(float_engine, "eagle")
    quantized = quantize_head_(copy.deepcopy(trained_head), "q8_0")
    blocks = generate_all(engine_with(runner, quantized, VOCAB), "eagle")
    assert [r.token_ids for r in blocks] == [r.token_ids for r in plain]

    def accepted(results):
        return sum(r.metrics.spec.num_accepted_tokens for r in results) / sum(
            r.metrics.spec.num_draft_tokens for r in results
        )

    assert accepted(floats) > 0.15  # the trained head's figure (test_eagle_drafter: 0.263)
    assert accepted(blocks) >= 0.8 * accepted(floats)


def test_quantized_head_logits_rank_like_the_float_head(trained_head):
    features = torch.randn(6, 96, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(6)
    want, _ = trained_head.new_sequence()(ids, features=features)
    got, _ = quantize_head_(copy.deepcopy(trained_head), "q8_0").new_sequence()(ids, features=features)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 5 / 6


def test_bad_quantization_requests_are_refused(trained_head):
    with pytest.raises(InvalidParameterError, match="unknown head quantization"):
        quantize_head_(copy.deepcopy(trained_head), "q2_k")
    odd = copy.deepcopy(trained_head)
    odd.fc = nn.Linear(100, 32)
    with pytest.raises(InvalidParameterError, match="not a multiple of 32"):
        quantize_head_(odd, "q8_0")


def test_the_factory_quantizes_the_head_over_the_gguf_runner_only(tmp_path):
    gguf = GGUFRunner.from_file(write_gguf_model(tmp_path / "target.gguf"), max_context_length=64)
    gguf_head(gguf).save(tmp_path / "head.pt")
    loaded = type("Loaded", (), {"model": None, "context_length": 64})()

    def head_layer(choice, runner):
        options = DrafterOptions(eagle_head=tmp_path / "head.pt", head_quantization=choice, layer_skip_layers=0)
        return build_drafters(options, loaded, target_runner=runner)["eagle"].head.down_proj

    assert (
        isinstance(head_layer("auto", gguf), BlockLinear) and head_layer("auto", gguf).linear.parts[0][1] == 8
    )  # Q8_0
    assert isinstance(head_layer("none", gguf), nn.Linear)
    assert head_layer("iq4_nl", gguf).linear.parts[0][1] == 20  # IQ4_NL
    with pytest.raises(InvalidParameterError, match="unknown head quantization 'q3'"):
        DrafterOptions(eagle_head=tmp_path / "head.pt", head_quantization="q3")


def test_auto_leaves_the_head_in_float32_over_other_runners(target, trained_head, tmp_path):
    trained_head.save(tmp_path / "head.pt")
    loaded = type("Loaded", (), {"model": target, "context_length": 128})()
    options = DrafterOptions(eagle_head=tmp_path / "head.pt", layer_skip_layers=0)
    drafters = build_drafters(options, loaded, target_runner=Int8Runner.from_module(target, max_context_length=64))
    assert isinstance(drafters["eagle"].head.fc, nn.Linear)
