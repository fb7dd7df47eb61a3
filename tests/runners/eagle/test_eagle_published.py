"""Published EAGLE-3 heads (runners/eagle/published.py, ``--eagle-head DIR``): a head written here
in the layout the EAGLE authors and SpecForge publish (config.json + safetensors or
pytorch_model.bin, bf16, random weights) for a tiny Llama-style GGUF target scores what a direct
PyTorch EAGLE-3 forward written below from the loaders (SafeAILab/EAGLE ``cnets.py``, vLLM and
SGLang ``llama_eagle3.py``) scores, drafts under ``--method eagle`` with the output of plain
decoding, is converted once and cached; a head for another target, a damaged folder and an
unknown layout are refused with one line."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from typer.testing import CliRunner

from gguf_models import DRAFT_LIKE, HIDDEN, VOCAB, Shape, write_gguf_model
from verispec.algorithms.sampling import SamplingParams
from verispec.cli import app
from verispec.engine.loader import SpeculativePipeline
from verispec.engine.request import SpeculativeConfig
from verispec.errors import InvalidParameterError, ModelIntegrityError, ModelNotFoundError
from verispec.proposers.factory import DrafterOptions
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.eagle.head import EagleHead
from verispec.runners.eagle.published import feature_layers
from verispec.runners.select import RunnerOptions

LAYERS = 6  # the engines' default fused layers (2, 3, 3) fit
HEADS, KV_HEADS, HEAD_DIM, INNER, DRAFT_VOCAB = 4, 2, 64, 128, 64
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3["original_max_position_embeddings"] = 16  # short, so every band of frequencies shows in 12 positions
TOLERANCE = 1e-4  # float32 both ways from bf16 weights: sums in another order, nothing else


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_gguf_model(  # Llama-3-style: RoPE scaled as Llama 3.1 files are (a rope_freqs tensor)
        tmp_path_factory.mktemp("published") / "llama.gguf",
        DRAFT_LIKE,
        arch="llama",
        num_layers=LAYERS,
        seed=4,
        shape=Shape(llama3=(8.0, 1.0, 4.0, 64), rope_base=500000.0),
    )
    return path, GGUFRunner.from_file(path, max_context_length=128)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def published_config(**changes):
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INNER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }  # no rope_theta: the EAGLE authors' Llama 3.1 head names none (10000)
    config.update(changes)
    return {k: v for k, v in config.items() if v is not None}


def published_tensors(seed=0, hidden=HIDDEN, vocab=VOCAB, draft_vocab=DRAFT_VOCAB):
    """bf16 weights under the published names; norms away from 1 so a swapped norm shows."""
    g = torch.Generator().manual_seed(seed)

    def matrix(rows, cols):
        return (torch.randn(rows, cols, generator=g) * 0.05).bfloat16()

    def norm():
        return (torch.rand(hidden, generator=g) + 0.5).bfloat16()

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values  # EAGLE's d2t: ascending
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return {
        "fc.weight": matrix(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": matrix(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": matrix(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": matrix(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": matrix(hidden, q),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": matrix(INNER, hidden),
        "midlayer.mlp.up_proj.weight": matrix(INNER, hidden),
        "midlayer.mlp.down_proj.weight": matrix(hidden, INNER),
        "norm.weight": norm(),
        "lm_head.weight": (torch.randn(draft_vocab, hidden, generator=g) * 0.5).bfloat16(),
        "d2t": draft_ids - torch.arange(draft_vocab),  # offsets: target id - draft row
        "t2d": t2d,
        "embed_tokens.weight": matrix(vocab, hidden),  # SpecForge's frozen copy; the target's is used
    }


def write_head(folder, config=None, tensors=None, weights="model.safetensors"):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or published_config()))
    tensors = published_tensors() if tensors is None else tensors
    if weights.endswith(".safetensors"):
        save_file(tensors, folder / weights, metadata={"format": "pt"})
    else:
        torch.save(tensors, folder / weights)
    return folder


def frequencies(config):
    """The rotary frequencies as the loaders compute them, one by one (Meta's llama3 ``apply_scaling``)."""
    theta, scaling = config.get("rope_theta", 10000.0), config.get("rope_scaling") or {}
    kind, out = scaling.get("rope_type", scaling.get("type")), []
    for i in range(0, HEAD_DIM, 2):
        freq = 1.0 / theta ** (i / HEAD_DIM)
        if kind == "linear":
            freq /= scaling["factor"]
        elif kind == "llama3":
            context, wavelength = scaling["original_max_position_embeddings"], 2 * math.pi / freq
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            if wavelength > context / low:
                freq /= scaling["factor"]
            elif wavelength >= context / high:
                smooth = (context / wavelength - low) / (high - low)
                freq = (1 - smooth) * freq / scaling["factor"] + smooth * freq
        out.append(freq)
    return torch.tensor(out, dtype=torch.float64)


def reference_logits(config, tensors, embed, features, token_ids, lm_head=None):
    """EAGLE-3's draft forward over ``T`` rows at positions 0..T-1, causal, written out in float64:
    fc over the three features, then the midlayer (attention over [input_layernorm(embedding),
    hidden_norm(hidden)], residual the un-normed hidden unless norm_before_residual), norm, lm_head,
    scores scattered to target ids by d2t offsets (-inf elsewhere)."""
    w = {name: t.double() for name, t in tensors.items()}
    eps, rows = config["rms_norm_eps"], features.shape[0]

    def rms(x, gain):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain

    hidden = features.double() @ w["fc.weight"].T
    normed = rms(hidden, w["midlayer.hidden_norm.weight"])
    residual = normed if config.get("norm_before_residual") else hidden
    x = torch.cat([rms(embed(token_ids).double(), w["midlayer.input_layernorm.weight"]), normed], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(rows, HEADS, HEAD_DIM)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(rows, KV_HEADS, HEAD_DIM)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(rows, KV_HEADS, HEAD_DIM)
    angles = torch.arange(rows).double()[:, None] * frequencies(config)[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rope(t):
        first, second = t.chunk(2, -1)
        return t * cos + torch.cat([-second, first], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(~torch.ones(rows, rows, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(rows, -1)
    hidden = residual + attended @ w["midlayer.self_attn.o_proj.weight"].T
    y = rms(hidden, w["midlayer.post_attention_layernorm.weight"])
    gate, up = y @ w["midlayer.mlp.gate_proj.weight"].T, y @ w["midlayer.mlp.up_proj.weight"].T
    hidden = hidden + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    head_rows = w["lm_head.weight"] if lm_head is None else lm_head.double()
    draft = rms(hidden, w["norm.weight"]) @ head_rows.T
    full = torch.full((rows, VOCAB), float("-inf"), dtype=torch.float64)
    d2t = tensors.get("d2t", torch.zeros(VOCAB, dtype=torch.long))
    full[:, torch.arange(d2t.numel()) + d2t] = draft
    return full


def head_logits(head, features, token_ids):
    logits, _ = head.new_sequence()(token_ids, features=features)
    full = torch.full((features.shape[0], VOCAB), float("-inf"))
    full[:, head.d2t] = logits
    return full


@pytest.mark.parametrize(
    "changes",
    [
        {},  # as the EAGLE authors publish: no rope_theta (10000), the engines' default layers
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3},  # a Llama 3.1 head's scaled RoPE
        {"rope_scaling": {"type": "linear", "factor": 2.0}},  # EAGLE's older key name
        {"norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 5]},  # vLLM's flag and ids
    ],
)
def test_the_converted_head_scores_what_the_published_forward_scores(tmp_path, target, changes):
    _, runner = target
    config, tensors = published_config(**changes), published_tensors(seed=1)
    head = EagleHead.load(write_head(tmp_path / "head", config, tensors), runner)
    g = torch.Generator().manual_seed(2)
    features, token_ids = torch.randn(12, 3 * HIDDEN, generator=g), torch.randint(0, VOCAB, (12,), generator=g)
    ours = head_logits(head, features, token_ids)
    reference = reference_logits(config, tensors, runner.weights.embed, features, token_ids)
    assert torch.equal(ours.isinf(), reference.isinf())  # the same 64 target ids drafted
    assert (ours.isfinite().sum(-1) == DRAFT_VOCAB).all()
    torch.testing.assert_close(ours[ours.isfinite()].double(), reference[reference.isfinite()], rtol=0, atol=TOLERANCE)
    assert head.shape.feature_layers == tuple(changes.get("eagle_aux_hidden_state_layer_ids", (2, 3, 3)))


def test_without_lm_head_the_full_vocabulary_head_scores_with_the_targets_rows(tmp_path, target):
    """SGLang's load_lm_head_from_target: no draft vocabulary, no lm_head in the file."""
    _, runner = target
    config = published_config(draft_vocab_size=None)
    tensors = {n: t for n, t in published_tensors(seed=3).items() if n not in ("lm_head.weight", "d2t", "t2d")}
    head = EagleHead.load(write_head(tmp_path / "head", config, tensors), runner)
    features, token_ids = torch.randn(5, 3 * HIDDEN, generator=torch.Generator().manual_seed(4)), torch.arange(5)
    rows = runner.weights.output_rows(torch.arange(VOCAB))
    reference = reference_logits(config, tensors, runner.weights.embed, features, token_ids, lm_head=rows)
    ours = head_logits(head, features, token_ids)
    torch.testing.assert_close(ours.double(), reference, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, (2, 3, 3)),  # neither engine's ids: their default (2, N // 2, N - 3)
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 5]}, (1, 2, 5)),  # vLLM: hidden-state indices, as ours
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}, (1, 3, 5)),  # SGLang: outputs, one lower
    ],
)
def test_fused_layers_as_each_engine_names_them(config, expected):
    assert feature_layers(config, LAYERS) == expected


def test_pytorch_model_bin_reads_as_safetensors_and_the_conversion_is_cached(tmp_path, target, home):
    _, runner = target
    tensors = published_tensors(seed=5)
    features, token_ids = torch.randn(4, 3 * HIDDEN, generator=torch.Generator().manual_seed(6)), torch.arange(4)
    first = head_logits(EagleHead.load(write_head(tmp_path / "st", tensors=tensors), runner), features, token_ids)
    cached = sorted((home / "eagle-heads").iterdir())
    assert len(cached) == 1 and cached[0].suffix == ".gguf"
    stamp = cached[0].stat().st_mtime_ns
    EagleHead.load(tmp_path / "st", runner)  # the same files: the converted head is read, not written again
    assert sorted((home / "eagle-heads").iterdir()) == cached and cached[0].stat().st_mtime_ns == stamp
    bin_head = EagleHead.load(write_head(tmp_path / "bin", tensors=tensors, weights="pytorch_model.bin"), runner)
    assert torch.equal(head_logits(bin_head, features, token_ids), first)
    assert len(list((home / "eagle-heads").iterdir())) == 2  # other source files, another key


PROMPTS = ["ab!c", "hello world", "xyz xyz xyz"]


def test_pipeline_drafts_with_the_published_head_and_equals_plain(tmp_path, target):
    path, _ = target
    pipe = SpeculativePipeline.load(
        str(path),
        None,
        drafters=DrafterOptions(eagle_head=write_head(tmp_path / "head"), layer_skip_layers=0),
        runners=RunnerOptions(kind="gguf", max_context_length=128),
    )
    params = SamplingParams(max_tokens=24)
    drafted = 0
    for prompt in PROMPTS:
        plain = pipe.generate(prompt, params, SpeculativeConfig(method="none"))
        spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, schedule="constant")
        eagle = pipe.generate(prompt, params, spec)
        assert eagle.token_ids == plain.token_ids
        drafted += eagle.metrics.spec.num_draft_tokens
    assert drafted >= 3 * 15  # the head drafted on most steps


@pytest.mark.parametrize("method", ["eagle", "eagle-tree"])
def test_a_seed_gives_plain_decodings_sampled_tokens_with_the_head(tmp_path, target, method):
    """Coupled sampling (issue 47): the head drafts with the target's noise, the text is plain's."""
    path, _ = target
    pipe = SpeculativePipeline.load(
        str(path),
        None,
        drafters=DrafterOptions(eagle_head=write_head(tmp_path / "head"), layer_skip_layers=0),
        runners=RunnerOptions(kind="gguf", max_context_length=128),
    )
    drafted = 0
    for seed, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=seed)
        plain = pipe.generate(prompt, params, SpeculativeConfig(method="none"))
        spec = SpeculativeConfig(method=method, num_speculative_tokens=3, schedule="constant")
        out = pipe.generate(prompt, params, spec)
        assert out.token_ids == plain.token_ids
        drafted += out.metrics.spec.num_draft_tokens
    assert drafted > 0  # the head really drafted


def cli_generate(target_path, head, *extra):
    args = ["generate", "ab!c", "--target", str(target_path), "--draft", "none", "--method", "eagle"]
    args += ["--eagle-head", str(head), "-k", "3", "--max-tokens", "16", "--schedule", "constant", *extra]
    return CliRunner().invoke(app, args)


def test_cli_generate_with_eagle_head_dir_compares_identical_to_plain(tmp_path, target):
    path, _ = target
    result = cli_generate(path, write_head(tmp_path / "head"), "--compare-plain", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["compare_plain"]["identical"] is True
    assert data["metrics"]["spec"]["num_draft_tokens"] > 0


def test_cli_refuses_a_head_for_another_target_with_one_line(tmp_path, target):
    path, _ = target
    other = write_head(tmp_path / "other", published_config(hidden_size=128), published_tensors(hidden=128))
    result = cli_generate(path, other)
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "belongs to another target (hidden_size 128 != 256" in lines[0], result.output


def corrupt(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def without(name):
    return {n: t for n, t in published_tensors().items() if n != name}


@pytest.mark.parametrize(
    "config, tensors, damage, error, message",
    [
        # another target: vocabulary, fused layers past its 6 layers, hidden size via target_hidden_size
        (dict(vocab_size=100), published_tensors(vocab=100), None, InvalidParameterError, "vocab_size 100 != 96"),
        (dict(eagle_aux_hidden_state_layer_ids=[2, 3, 6]), None, None, InvalidParameterError, "outside the target's 6"),
        (dict(target_hidden_size=512), None, None, InvalidParameterError, "target_hidden_size 512 != 256"),
        # missing and damaged files
        ({}, None, lambda f: (f / "config.json").unlink(), ModelNotFoundError, "holds no config.json"),
        ({}, None, lambda f: (f / "model.safetensors").unlink(), ModelNotFoundError, "holds no weights"),
        ({}, None, corrupt, ModelIntegrityError, "not a readable weight file"),
        ({}, None, lambda f: (f / "config.json").write_text("{"), ModelIntegrityError, "not readable JSON"),
        ({}, without("midlayer.mlp.up_proj.weight"), None, ModelIntegrityError, "missing: midlayer.mlp.up_proj"),
        (dict(intermediate_size=96), None, None, ModelIntegrityError, "gate_proj.weight is \\[128, 256\\]"),
        ({}, {**published_tensors(), "d2t": torch.full((64,), 90)}, None, ModelIntegrityError, "d2t maps"),
        # unknown layouts
        (dict(architectures=["Qwen2ForCausalLM"]), None, None, InvalidParameterError, "architectures"),
        (dict(num_hidden_layers=2), None, None, InvalidParameterError, "2 decoder layers"),
        (dict(attention_bias=True), None, None, InvalidParameterError, "attention_bias set"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), None, None, InvalidParameterError, "'yarn'"),
        (dict(rope_scaling={"rope_type": "llama3"}), None, None, ModelIntegrityError, "rope_scaling lacks"),
        ({}, {**published_tensors(), "fc.bias": torch.zeros(HIDDEN)}, None, InvalidParameterError, "unknown tensors"),
    ],
)
def test_what_cannot_be_this_targets_head_is_refused(tmp_path, target, config, tensors, damage, error, message):
    _, runner = target
    folder = write_head(tmp_path / "head", published_config(**config), tensors)
    if damage is not None:
        damage(folder)
    with pytest.raises(error, match=message) as refused:
        EagleHead.load(folder, runner)
    assert "\n" not in str(refused.value)  # one line
    assert not (tmp_path / "home" / "eagle-heads").exists() or not any((tmp_path / "home" / "eagle-heads").iterdir())


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_file_of_the_folder_is_refused_naming_the_folder(tmp_path, target, name):
    """--eagle-head DIR/config.json said the file was not a readable head from train-head."""
    path, _ = target
    folder = write_head(tmp_path / "head")
    result = cli_generate(path, folder / name)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert (
        lines[0]
        == f"error: {folder / name} is a file of a published EAGLE-3 folder: give the folder, --eagle-head {folder}"
    )
