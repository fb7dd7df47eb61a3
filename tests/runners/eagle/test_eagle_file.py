"""An EAGLE head stored as GGUF (runners/eagle/file.py): written and read back bit for bit with its
training record; a truncated file, a flipped weight byte, a model GGUF given as a head and saving a
quantized head are refused with a clear error."""

import copy

import pytest
import torch

from gguf_models import write_gguf_model
from helpers import tiny_qwen2
from verispec.errors import InvalidParameterError, ModelIntegrityError
from verispec.runners.eagle.blocks import quantize_head_
from verispec.runners.eagle.file import is_gguf
from verispec.runners.eagle.head import EagleHead


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(0)


@pytest.fixture
def head(target):
    head = EagleHead.from_target(target, draft_token_ids=torch.tensor([0, 3, 5, 7, 11, 13, 17, 19]), seed=4)
    head.training_record = {
        "command": "verispec train-head --target t",
        "seed": 4,
        "runs": [{"steps": 2, "held_out_top1": 0.25}],
    }
    return head


def test_a_gguf_head_reads_back_bit_for_bit(head, target, tmp_path):
    head.save(tmp_path / "head.gguf")
    assert is_gguf(tmp_path / "head.gguf") and not (tmp_path / "head.gguf.partial").exists()
    loaded = EagleHead.load(tmp_path / "head.gguf", target)
    mine, theirs = head.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) and mine[name].dtype == theirs[name].dtype for name in mine)
    assert loaded.shape == head.shape and loaded.training_record == head.training_record
    features = torch.randn(3, loaded.fc.in_features, generator=torch.Generator().manual_seed(0))
    want, _ = head.new_sequence()(torch.tensor([1, 2, 3]), features=features)
    got, _ = loaded.new_sequence()(torch.tensor([1, 2, 3]), features=features)
    assert torch.equal(got, want)


def test_a_damaged_gguf_head_is_refused(head, target, tmp_path):
    head.save(tmp_path / "head.gguf")
    data = (tmp_path / "head.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelIntegrityError, match="cut.gguf"):
        EagleHead.load(tmp_path / "cut.gguf", target)
    flipped = bytearray(data)
    flipped[-5] ^= 0x40  # inside the last tensor's data
    (tmp_path / "flipped.gguf").write_bytes(bytes(flipped))
    with pytest.raises(ModelIntegrityError, match="do not match the sha256"):
        EagleHead.load(tmp_path / "flipped.gguf", target)


def test_a_model_gguf_is_not_a_head(target, tmp_path):
    model = write_gguf_model(tmp_path / "model.gguf")
    with pytest.raises(ModelIntegrityError, match="architecture 'qwen2', not an EAGLE head"):
        EagleHead.load(model, target)


def test_a_quantized_head_is_not_saved(head, tmp_path):
    with pytest.raises(InvalidParameterError, match="quantized to q8_0 for inference"):
        quantize_head_(copy.deepcopy(head), "q8_0").save(tmp_path / "head.gguf")
    assert not (tmp_path / "head.gguf").exists()


@pytest.mark.parametrize("weights, tolerance", [("f16", 2e-3), ("q8_0", 2e-2)])
def test_f16_and_q8_0_files_are_smaller_and_read_back_close(head, target, tmp_path, weights, tolerance):
    head.save(tmp_path / "f32.gguf")
    head.save(tmp_path / f"{weights}.gguf", weights)
    loaded = EagleHead.load(tmp_path / f"{weights}.gguf", target)
    assert (tmp_path / f"{weights}.gguf").stat().st_size < 0.6 * (tmp_path / "f32.gguf").stat().st_size
    for name, value in head.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == value.dtype
        if name == "d2t" or value.dim() < 2:
            assert torch.equal(got, value)  # the vocabulary map and the norms stay exact
        else:
            scale = value.abs().max()
            assert 0 < (got - value).abs().max() <= tolerance * scale, name  # rounded, by at most a step


def test_unknown_file_weights_are_refused(head, tmp_path):
    with pytest.raises(InvalidParameterError, match="f32, f16, q8_0"):
        head.save(tmp_path / "head.gguf", "q4_k")


def test_a_damaged_q8_0_head_is_refused(head, target, tmp_path):
    head.save(tmp_path / "head.gguf", "q8_0")
    flipped = bytearray((tmp_path / "head.gguf").read_bytes())
    flipped[len(flipped) * 3 // 4] ^= 0x10  # inside a matrix's blocks (the file's end may be padding)
    (tmp_path / "flipped.gguf").write_bytes(bytes(flipped))
    with pytest.raises(ModelIntegrityError, match="do not match the sha256"):
        EagleHead.load(tmp_path / "flipped.gguf", target)


def test_a_shared_lm_head_is_not_stored_and_comes_back_from_the_target(target, tmp_path):
    ids = torch.tensor([0, 3, 5, 7, 11, 13, 17, 19])
    head = EagleHead.from_target(target, draft_token_ids=ids, seed=4, lm_head_from_target=True)
    rows = target.get_output_embeddings().weight.detach()[ids].float()
    assert torch.equal(head.lm_head.weight, rows) and not head.lm_head.weight.requires_grad
    assert torch.equal(head.norm.weight, target.model.norm.weight.float())  # starts as the target's final norm
    assert "lm_head.weight" not in head.stored_state()
    for suffix in (".gguf", ".pt"):
        head.save(tmp_path / f"head{suffix}")
        loaded = EagleHead.load(tmp_path / f"head{suffix}", target)
        assert loaded.shape.lm_head_from_target is True
        assert torch.equal(loaded.lm_head.weight, rows) and not loaded.lm_head.weight.requires_grad
        assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in head.state_dict().items())
    own = EagleHead.from_target(target, draft_token_ids=ids, seed=4)
    own.save(tmp_path / "own.gguf")
    assert (tmp_path / "head.gguf").stat().st_size < (tmp_path / "own.gguf").stat().st_size


def test_a_narrower_mlp(target):
    head = EagleHead.from_target(target, intermediate_size=24)
    assert head.gate_proj.out_features == head.up_proj.out_features == head.down_proj.in_features == 24
    assert head.shape.intermediate_size == 24
    with pytest.raises(InvalidParameterError, match="MLP width"):
        EagleHead.from_target(target, intermediate_size=0)
