"""An EAGLE head stored as GGUF (runners/eagle_file.py): written and read back bit for bit with its
training record; a truncated file, a flipped weight byte, a model GGUF given as a head and saving a
quantized head are refused with a clear error."""

import copy

import pytest
import torch
from gguf_models import write_gguf_model
from helpers import tiny_qwen2

from verispec.errors import InvalidParameterError, ModelIntegrityError
from verispec.runners.eagle_blocks import quantize_head_
from verispec.runners.eagle_file import is_gguf
from verispec.runners.eagle_head import EagleHead


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(0)


@pytest.fixture
def head(target):
    head = EagleHead.from_target(target, draft_token_ids=torch.tensor([0, 3, 5, 7, 11, 13, 17, 19]), seed=4)
    head.training_record = {"command": "verispec train-head --target t", "seed": 4, "runs": [{"steps": 2, "held_out_top1": 0.25}]}
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
