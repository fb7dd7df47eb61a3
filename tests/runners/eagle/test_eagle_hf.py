"""A head as the Hugging Face EAGLE-3 checkpoint vLLM and SGLang load (runners/eagle/hf.py,
bench/export_head.py, ``verispec export-head``): the checkpoint, read back by an independent
forward written from the engines' EAGLE-3 layer, scores exactly what the head scores; names,
offsets, layer ids and refusals."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from typer.testing import CliRunner

from gguf_models import VOCAB as GGUF_VOCAB
from gguf_models import write_gguf_model
from helpers import single_thread, tiny_qwen2
from verispec.bench.export_head import default_export_folder, export_head, trained_context
from verispec.cli import app
from verispec.errors import InvalidParameterError
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.eagle.blocks import quantize_head_
from verispec.runners.eagle.head import EagleHead, HeadShape
from verispec.runners.eagle.hf import hf_config, write_hf_checkpoint

LAYER_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{name}.weight"
    for name in (
        "input_layernorm",
        "hidden_norm",
        "post_attention_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
}


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(0, num_layers=6)  # 6 layers: verispec's default features are the engines' (2, 3, 3)


def head_of(target, shared: bool, layers=None, seed=3):
    draft_ids = torch.tensor([95, 3, 17, 40, 41, 42, 60, 7])  # not sorted: the offsets go both ways
    head = EagleHead.from_target(target, layers, draft_ids, seed=seed, intermediate_size=64, lm_head_from_target=shared)
    with torch.no_grad():  # norms away from 1 so a swapped norm shows
        for norm in (head.input_norm, head.hidden_norm, head.post_attention_norm, head.norm):
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return head


def reference_logits(tensors, config, embedding, features, token_ids):
    """The engines' EAGLE-3 draft forward (vLLM Eagle3LlamaForCausalLM / SGLang LlamaForCausalLMEagle3,
    written out): rows at positions 0..T-1, causal; full-vocabulary scores, -inf off the draft rows."""
    w = {name: t.float() for name, t in tensors.items()}
    eps, heads, kv_heads, dim = (
        config["rms_norm_eps"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )

    def rms(x, gain):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain

    rows = features.shape[0]
    hidden = features @ w["fc.weight"].T
    residual = hidden
    x = torch.cat(
        [
            rms(embedding(token_ids), w["midlayer.input_layernorm.weight"]),
            rms(hidden, w["midlayer.hidden_norm.weight"]),
        ],
        -1,
    )
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(rows, heads, dim)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(rows, kv_heads, dim)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(rows, kv_heads, dim)
    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(rows).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rope(t):
        first, second = t.chunk(2, -1)
        return t * cos + torch.cat([-second, first], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
    scores = scores.masked_fill(~torch.ones(rows, rows, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(rows, -1)
    hidden = residual + attended @ w["midlayer.self_attn.o_proj.weight"].T
    y = rms(hidden, w["midlayer.post_attention_layernorm.weight"])
    hidden = (
        hidden
        + (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T))
        @ w["midlayer.mlp.down_proj.weight"].T
    )
    draft = rms(hidden, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((rows, config["vocab_size"]), float("-inf"))
    full[:, torch.arange(config["draft_vocab_size"]) + tensors["d2t"]] = draft  # d2t: offsets
    return full


@pytest.mark.parametrize("shared", [True, False])  # the target's LM-head rows written out / the head's own
def test_the_checkpoint_scores_what_the_head_scores(tmp_path, target, shared):
    head = head_of(target, shared)
    folder = write_hf_checkpoint(head, tmp_path / "ckpt", max_position_embeddings=256, dtype="float32")
    tensors, config = load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())
    assert set(tensors) == LAYER_NAMES
    assert torch.equal(tensors["d2t"] + torch.arange(8), head.d2t)
    assert torch.equal(tensors["t2d"].nonzero().flatten(), head.d2t.sort().values)
    g = torch.Generator().manual_seed(5)
    features, token_ids = torch.randn(7, 3 * 32, generator=g), torch.randint(0, 96, (7,), generator=g)
    logits, _ = head.new_sequence()(token_ids, features=features)
    expected = torch.full((7, 96), float("-inf"))
    expected[:, head.d2t] = logits
    reference = reference_logits(tensors, config, target.get_input_embeddings(), features, token_ids)
    assert torch.equal(reference.isinf(), expected.isinf())
    torch.testing.assert_close(reference[:, head.d2t], expected[:, head.d2t], rtol=1e-4, atol=1e-4)
    assert torch.equal(reference.argmax(-1), expected.argmax(-1))


def test_the_config_is_a_llama_eagle3_config_transformers_reads(tmp_path, target):
    from transformers import AutoConfig

    head = head_of(target, True)
    folder = write_hf_checkpoint(head, tmp_path / "ckpt", max_position_embeddings=256)
    config = AutoConfig.from_pretrained(folder)
    assert (config.architectures, config.model_type, config.num_hidden_layers) == (
        ["LlamaForCausalLMEagle3"],
        "llama",
        1,
    )
    assert (config.hidden_size, config.intermediate_size, config.vocab_size, config.draft_vocab_size) == (32, 64, 96, 8)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 8)
    assert config.max_position_embeddings == 256 and config.tie_word_embeddings is False
    assert not hasattr(config, "eagle_aux_hidden_state_layer_ids")  # (2, 3, 3): both engines' default, nothing pinned
    tensors = load_file(folder / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and torch.equal(tensors["fc.weight"], head.fc.weight.bfloat16())
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


@pytest.mark.parametrize(
    "layers, vllm_ids, sglang_ids",
    [
        ((2, 3, 3), None, None),  # the engines' default: no ids pinned
        ((1, 3, 5), [1, 3, 5], [0, 2, 4]),  # vLLM: hidden states entering layers; SGLang: layer outputs (one lower)
    ],
)
def test_fused_layers_are_named_for_each_engine(target, layers, vllm_ids, sglang_ids):
    config = hf_config(head_of(target, True, layers).shape, max_position_embeddings=256)
    assert config.get("eagle_aux_hidden_state_layer_ids") == vllm_ids
    assert (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") == sglang_ids


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layers=(0, 3, 5)), "embedding"),  # SGLang cannot name the embedding as a layer output
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(context=0), "max_position_embeddings must be >= 1"),
    ],
)
def test_what_the_engines_cannot_load_is_refused(tmp_path, target, change, message):
    head = head_of(target, True, change.get("layers"))
    with pytest.raises(InvalidParameterError, match=message):
        write_hf_checkpoint(
            head,
            tmp_path / "ckpt",
            max_position_embeddings=change.get("context", 256),
            dtype=change.get("dtype", "bfloat16"),
        )
    assert not (tmp_path / "ckpt").exists()


def test_a_folder_with_files_and_a_quantized_head_are_refused_and_left_alone(tmp_path, target):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(InvalidParameterError, match="not an empty folder"):
        write_hf_checkpoint(head_of(target, True), tmp_path / "busy", max_position_embeddings=256)
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]
    with pytest.raises(InvalidParameterError, match="quantized to q8_0"):
        write_hf_checkpoint(quantize_head_(head_of(target, False)), tmp_path / "q", max_position_embeddings=256)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # no partial folder left behind


@pytest.fixture(scope="module")
def gguf_head_file(tmp_path_factory):
    """A tiny GGUF target and a head for it that borrows the target's LM-head rows (not in its file)."""
    folder = tmp_path_factory.mktemp("export")
    gguf_path = write_gguf_model(folder / "target.gguf")
    runner = GGUFRunner.from_file(gguf_path, max_context_length=64)
    shape = HeadShape(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        vocab_size=GGUF_VOCAB,
        num_target_layers=2,
        feature_layers=(1, 1, 1),
        draft_vocab_size=16,
        target_model_type="qwen2",
        lm_head_from_target=True,
    )
    d2t = torch.arange(16) * 5
    head = EagleHead(shape, runner.weights.embed, d2t, runner.weights.output_rows(d2t), seed=0)
    head.save(folder / "head.gguf", weights="q8_0")
    return gguf_path, folder / "head.gguf", runner


def test_export_head_lends_the_targets_rows_and_context(gguf_head_file):
    gguf_path, head_path, runner = gguf_head_file
    assert trained_context(str(gguf_path), 7) == 512  # the GGUF's qwen2.context_length, not the runner's 64
    folder = export_head(head_path, runner, str(gguf_path))
    assert folder == default_export_folder(head_path) == head_path.with_name("head-eagle3")
    config, tensors = json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")
    assert config["max_position_embeddings"] == 512 and config["verispec"]["head_file"] == "head.gguf"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 1, 1] and config["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [0, 0, 0]
    rows = runner.weights.output_rows(torch.arange(16) * 5)
    assert torch.equal(tensors["lm_head.weight"], rows.bfloat16())  # the target's rows, as its file holds them
    with pytest.raises(InvalidParameterError, match="not an empty folder"):
        export_head(head_path, runner, str(gguf_path))


def test_cli_export_head_writes_the_folder_and_refuses_a_wrong_path(tmp_path, gguf_head_file):
    gguf_path, head_path, _ = gguf_head_file
    out = tmp_path / "for-vllm"
    result = CliRunner().invoke(
        app, ["export-head", str(head_path), "--target", str(gguf_path), "--out", str(out), "--runner", "gguf"]
    )
    assert result.exit_code == 0, result.output
    assert "eagle3" in result.output and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    missing = CliRunner().invoke(
        app, ["export-head", str(tmp_path / "nope.gguf"), "--target", str(gguf_path), "--out", str(tmp_path / "x")]
    )
    assert missing.exit_code != 0 and "no EAGLE head at" in missing.output and "Traceback" not in missing.output
    assert not (tmp_path / "x").exists()


def test_advise_export_of_an_eagle_verdict_writes_the_checkpoint_it_names(tmp_path, gguf_head_file, monkeypatch):
    """The advice itself is faked (an EAGLE verdict); loading the target and head, the conversion
    and the exported configuration are real."""
    from types import SimpleNamespace

    import verispec.bench.advise as advise_module
    import verispec.bench.advise_render as render_module

    gguf_path, head_path, _ = gguf_head_file
    verdict = SimpleNamespace(method="eagle", num_speculative_tokens=3)
    monkeypatch.setattr(advise_module, "advise", lambda *args, **kwargs: SimpleNamespace(verdicts=[verdict]))
    monkeypatch.setattr(render_module, "render", lambda advice, console: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ab!"}) + "\n")
    exported, folder = tmp_path / "vllm.json", tmp_path / "heads" / "mine"
    result = CliRunner().invoke(
        app,
        [
            "advise",
            "--prompts",
            str(prompts),
            "--target",
            str(gguf_path),
            "--draft",
            "none",
            "--runner",
            "gguf",
            "--methods",
            "eagle",
            "--eagle-head",
            str(head_path),
            "--export",
            "vllm",
            "--export-file",
            str(exported),
            "--export-head-dir",
            str(folder),
        ],
    )
    assert result.exit_code == 0, result.output
    spec = json.loads(exported.read_text())["config"]["speculative_config"]
    assert spec == {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3}
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
