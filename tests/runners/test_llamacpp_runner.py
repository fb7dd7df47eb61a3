"""LlamaCppRunner: same logits as transformers, rollback, exact speculative greedy (tiny GGUF).

The tiny models are written as float32 GGUF files from the seeded test Qwen2 models, so
llama.cpp and transformers run the same weights. Skipped (with the reason) when the optional
``llama-cpp-python`` extra is not installed.
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helpers import CharTokenizer, default_pieces
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.errors import InvalidParameterError
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners import Runner, prefill
from verispec.runners.llamacpp import INSTALL_HINT, llama_cpp_available
from verispec.runners.torch_runner import TransformersRunner

pytestmark = pytest.mark.skipif(not llama_cpp_available(), reason=f"llama-cpp-python is not installed: {INSTALL_HINT}")

CONTEXT = [3, 14, 15, 92, 65, 35, 89, 79]
DRAFT = [32, 38, 46, 26, 43]
PROMPTS = [[5, 17, 33, 2, 9], [70, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY_40 = SamplingParams(max_tokens=40)

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_qwen2_gguf(model, path: Path) -> Path:
    """A float32 qwen2 GGUF holding exactly ``model``'s weights (one-char tokens, no merges)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["<|endoftext|>", "<|im_end|>"] + [f"t{i}" for i in range(2, config.vocab_size)])
    writer.add_token_types([3, 3] + [1] * (config.vocab_size - 2))
    writer.add_token_merges(["t 1"])
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(0)
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", data)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", data)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", data)
        else:
            _, _, index, *rest = name.split(".")  # model.layers.{i}.{module}.{weight|bias}
            module, kind = ".".join(rest[:-1]), rest[-1]
            writer.add_tensor(f"blk.{index}.{HF_TO_GGUF[module]}.{kind}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, target_model, random_draft_model, partial_draft_model):
    directory = tmp_path_factory.mktemp("llamacpp")
    models = {"target": target_model, "random": random_draft_model, "partial": partial_draft_model}
    return {name: write_qwen2_gguf(model, directory / f"{name}.gguf") for name, model in models.items()}


def llama_runner(path, **options):
    from verispec.runners.llamacpp import LlamaCppRunner

    return LlamaCppRunner(path, **{"num_threads": 1, **options})


def test_same_logits_as_transformers(gguf_files, target_model):
    runner = llama_runner(gguf_files["target"])
    assert isinstance(runner, Runner) and runner.vocab_size == target_model.config.vocab_size
    logits = runner.forward(CONTEXT)
    expected = TransformersRunner(target_model).forward(CONTEXT)
    assert logits.shape == expected.shape and logits.dtype == torch.float32
    assert torch.allclose(logits, expected, atol=1e-3 * expected.abs().max().item())
    assert runner.forward([1, 2, 3], num_logits=2).shape == (2, runner.vocab_size)


@pytest.mark.parametrize(
    "num_rejected",
    [0, 2, 5],  # none rejected (truncate is a no-op), some, all drafted tokens rejected
)
def test_rollback_equals_fresh_prefill(gguf_files, num_rejected):
    runner = llama_runner(gguf_files["target"])
    prefill(runner, CONTEXT)
    runner.forward(DRAFT)
    keep = len(CONTEXT) + len(DRAFT) - num_rejected
    runner.truncate(keep)
    assert runner.num_cached_tokens == keep
    after_rollback = runner.forward([7])
    expected = llama_runner(gguf_files["target"]).forward((CONTEXT + DRAFT)[:keep] + [7], num_logits=1)
    assert torch.allclose(after_rollback, expected, atol=1e-4, rtol=1e-4)


def test_protocol_edges_and_long_inputs(gguf_files):
    runner = llama_runner(gguf_files["target"], max_context_length=40, batch_size=16)
    rows = runner.forward(list(range(2, 37)))  # 35 tokens: three llama.cpp batches
    one_batch = llama_runner(gguf_files["target"], max_context_length=40).forward(list(range(2, 37)))
    assert torch.allclose(rows, one_batch, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="context length"):
        runner.forward([1] * 6)
    assert runner.num_cached_tokens == 35
    with pytest.raises(ValueError):
        runner.truncate(36)
    runner.truncate(0)
    assert runner.num_cached_tokens == 0 and runner.forward([5, 6], num_logits=1).shape == (1, runner.vocab_size)


@pytest.fixture(scope="module")
def llama_target(gguf_files):
    return llama_runner(gguf_files["target"], max_context_length=128)


@pytest.mark.parametrize("draft_kind", ["target", "random", "partial"])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_plain(draft_kind, k, gguf_files, llama_target):
    pieces = CharTokenizer(default_pieces(llama_target.vocab_size))
    plain = SpeculativeEngine(llama_target, pieces, eos_token_ids=())
    drafter = DraftModelProposer(llama_runner(gguf_files[draft_kind], max_context_length=128))
    engine = SpeculativeEngine(llama_target, pieces, eos_token_ids=(), proposers={"draft": drafter})
    for prompt in PROMPTS:
        expected = plain.generate(prompt, GREEDY_40, SpeculativeConfig(method="none")).token_ids
        out = engine.generate(prompt, GREEDY_40, SpeculativeConfig(num_speculative_tokens=k, schedule="constant"))
        assert out.token_ids == expected
        if draft_kind == "target":
            assert out.metrics.spec.acceptance_rate == 1.0  # the target drafting for itself is always right
        elif draft_kind == "random":
            assert out.metrics.spec.acceptance_rate < 0.2


def test_missing_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(Exception, match="llama.cpp could not load"):
        llama_runner(bad)


def test_import_error_names_the_extra(monkeypatch):
    import sys

    from verispec.runners import llamacpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(InvalidParameterError, match=r"verispec\[llamacpp\]"):
        llamacpp.import_llama_cpp()


def cached_smollm2():
    from verispec.models.store import ModelStore

    store = ModelStore(progress=False)  # the suite's home, then the user's models folder (read only)
    return None if store.cache_state("smollm2-135m-instruct") == "missing" else store.fetch("smollm2-135m-instruct")


@pytest.mark.skipif(
    cached_smollm2() is None,
    reason="SmolLM2-135M is not in the model cache (verispec models fetch smollm2-135m-instruct)",
)
def test_real_quantized_gguf_speculative_equals_plain():
    """SmolLM2-135M Q4_1 drafting for itself: every draft accepted and the output unchanged."""
    target = llama_runner(cached_smollm2(), max_context_length=256)
    drafter = DraftModelProposer(llama_runner(cached_smollm2(), max_context_length=256))
    pieces = CharTokenizer(["x"] * target.vocab_size)
    engine = SpeculativeEngine(target, pieces, eos_token_ids=(), proposers={"draft": drafter})
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(100, 20000, (20,), generator=generator).tolist()
        plain = engine.generate(prompt, SamplingParams(max_tokens=32), SpeculativeConfig(method="none")).token_ids
        out = engine.generate(
            prompt, SamplingParams(max_tokens=32), SpeculativeConfig(num_speculative_tokens=5, schedule="constant")
        )
        assert out.token_ids == plain
        assert out.metrics.spec.acceptance_rate == 1.0
