"""Int8Runner: bit-exact batch invariance, exact speculative greedy, rollback, kernels, errors."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from helpers import CharTokenizer, default_pieces, single_thread, tiny_qwen2
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.errors import InvalidParameterError
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners import Runner, prefill
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.cpu.int8_ops import Int8Weight, quantize_activation_rows
from verispec.runners.torch_runner import TransformersRunner

CONTEXT = [3, 14, 15, 92, 65, 35, 89, 79]
DRAFT = [32, 38, 46, 26, 43]
PROMPTS = [[5, 17, 33, 2, 9], [70, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY_40 = SamplingParams(max_tokens=40)


@pytest.fixture(scope="module")
def int8_target(target_model):
    return Int8Runner.from_module(target_model, max_context_length=256)


def one_layer(config_class, model_class, hidden, heads, kv_heads, seed=0, **extra):
    """A one-layer model with a real model's attention shape (head_dim = hidden / heads)."""
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **extra,
    )
    return model_class(config).eval()


def rows_one_at_a_time(runner, token_ids):
    return torch.cat([runner.forward([t]) for t in token_ids])


def check_verify_passes(runner, prompt_length, sizes):
    prompt = [
        int(t) % runner.vocab_size
        for t in torch.randint(0, 1000, (prompt_length,), generator=torch.Generator().manual_seed(1))
    ]
    prefill(runner, prompt)
    for k in sizes:
        tokens = [(7 * i + k) % runner.vocab_size for i in range(k)]
        batched = runner.forward(tokens)
        runner.truncate(len(prompt))
        assert torch.equal(batched, rows_one_at_a_time(runner, tokens)), k
        runner.truncate(len(prompt))


@pytest.mark.parametrize(
    "model_factory",
    [
        lambda: tiny_qwen2(seed=0),  # the test target (hidden 32, head_dim 8)
        lambda: one_layer(
            Qwen2Config, Qwen2ForCausalLM, 1536, 12, 2
        ),  # Qwen2.5-1.5B attention: head_dim 128, 6 per group
        lambda: one_layer(
            Qwen2Config, Qwen2ForCausalLM, 896, 14, 2
        ),  # Qwen2.5-0.5B attention: head_dim 64, 7 per group
        lambda: one_layer(LlamaConfig, LlamaForCausalLM, 576, 9, 3),  # SmolLM2-135M attention, Llama (no q/k/v bias)
    ],
)
def test_verify_pass_is_bit_identical_to_one_token_steps(model_factory):
    runner = Int8Runner.from_module(model_factory(), max_context_length=512)
    check_verify_passes(runner, 150, (1, 2, 3, 8, 9, 17, 65))  # up to MAX_SPECULATIVE_TOKENS + 1


def test_verify_pass_is_bit_identical_with_two_threads():
    torch.set_num_threads(2)  # the kernels split work across threads; rows must not notice
    runner = Int8Runner.from_module(one_layer(Qwen2Config, Qwen2ForCausalLM, 1536, 12, 2), max_context_length=512)
    check_verify_passes(runner, 70, (9,))


@pytest.mark.parametrize("draft_kind", ["target", "random", "partial"])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_plain(
    draft_kind, k, target_model, random_draft_model, partial_draft_model, int8_target
):
    draft = {"target": target_model, "random": random_draft_model, "partial": partial_draft_model}[draft_kind]
    pieces = CharTokenizer(default_pieces(target_model.config.vocab_size))
    plain = SpeculativeEngine(int8_target, pieces, eos_token_ids=())
    drafter = DraftModelProposer(Int8Runner.from_module(draft, max_context_length=256))
    engine = SpeculativeEngine(int8_target, pieces, eos_token_ids=(), proposers={"draft": drafter})
    for prompt in PROMPTS:
        expected = plain.generate(prompt, GREEDY_40, SpeculativeConfig(method="none")).token_ids
        out = engine.generate(prompt, GREEDY_40, SpeculativeConfig(num_speculative_tokens=k, schedule="constant"))
        assert out.token_ids == expected
        if draft_kind == "target":
            assert out.metrics.spec.acceptance_rate == 1.0  # the target drafting for itself is always right


@pytest.mark.parametrize(
    "num_rejected",
    [0, 2, 5],  # none rejected (truncate is a no-op), some, all drafted tokens rejected
)
def test_rollback_equals_fresh_prefill(int8_target, target_model, num_rejected):
    prefill(int8_target, CONTEXT)
    int8_target.forward(DRAFT)
    keep = len(CONTEXT) + len(DRAFT) - num_rejected
    int8_target.truncate(keep)
    assert int8_target.num_cached_tokens == keep
    after_rollback = int8_target.forward([7])
    fresh = Int8Runner.from_module(target_model, max_context_length=64)
    assert torch.equal(after_rollback, fresh.forward((CONTEXT + DRAFT)[:keep] + [7], num_logits=1))


def test_close_to_the_float_model(target_model):
    int8_logits = Int8Runner.from_module(target_model).forward(CONTEXT)
    float_logits = TransformersRunner(target_model).forward(CONTEXT)
    assert int8_logits.shape == float_logits.shape and int8_logits.dtype == torch.float32
    assert (int8_logits.argmax(-1) == float_logits.argmax(-1)).all()
    assert (int8_logits - float_logits).abs().max() < 0.05 * float_logits.abs().max()


def test_protocol_edges(target_model):
    runner = Int8Runner.from_module(target_model, max_context_length=10)
    assert isinstance(runner, Runner) and runner.vocab_size == target_model.config.vocab_size
    assert runner.forward(CONTEXT, num_logits=2).shape == (2, runner.vocab_size)
    with pytest.raises(ValueError, match="context length"):
        runner.forward([1, 2, 3])
    assert runner.num_cached_tokens == len(CONTEXT)
    with pytest.raises(ValueError):
        runner.truncate(len(CONTEXT) + 1)
    with pytest.raises(ValueError):
        runner.forward([])
    runner.truncate(0)
    assert runner.num_cached_tokens == 0


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_kernels_agree_exactly(rows):
    weight, bias = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(rows, 24) * torch.logspace(-3, 3, rows)[:, None]  # rows of very different scales
    fast, portable = Int8Weight.from_float(weight, bias), Int8Weight.from_float(weight, bias, kernel="int_mm")
    assert portable.kernel == "int_mm"
    assert torch.equal(fast(x), portable(x))
    assert torch.allclose(fast(x), x @ weight.T + bias, rtol=0.05, atol=0.05 * x.abs().max().item())


def test_activation_scales_are_per_row():
    x = torch.tensor([[1.0, -2.0], [100.0, 50.0], [0.0, 0.0]])
    int8_x, scales = quantize_activation_rows(x)
    assert int8_x.tolist() == [[64, -127], [127, 64], [0, 0]]  # each row uses its own full range
    # max |row| / 127 per row; an all-zero row gets a tiny scale, never 0 (no division by zero)
    assert scales.flatten().tolist() == pytest.approx([2 / 127, 100 / 127, 1e-30 / 127], rel=1e-6)
    assert torch.equal(quantize_activation_rows(x[1:2])[0], int8_x[1:2])


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=32))
    with pytest.raises(InvalidParameterError, match="int8 runner"):
        Int8Runner.from_module(model)


TREE_PARENTS = [-1, 0, 0, 1, 1, 3]  # root; two children; the first has two; a grandchild below


@pytest.mark.parametrize(
    "model_factory",
    [
        lambda: tiny_qwen2(seed=0),
        lambda: one_layer(Qwen2Config, Qwen2ForCausalLM, 1536, 12, 2),  # Qwen2.5-1.5B attention shape
    ],
)
def test_tree_nodes_get_the_logits_of_their_path(model_factory):
    from verispec.algorithms.tree import TokenTree, tree_attention_mask, tree_position_ids

    model = model_factory()
    context = [t % model.config.vocab_size for t in CONTEXT]
    tree = TokenTree(token_ids=(7, 8, 9, 10, 11, 12), parents=tuple(TREE_PARENTS))
    runner = Int8Runner.from_module(model, max_context_length=128)
    runner.forward(context)
    rows = runner.forward_tree(
        list(tree.token_ids), tree_position_ids(tree, len(context)), tree_attention_mask(tree, len(context))
    )
    for node in range(tree.num_nodes):
        path = [tree.token_ids[0]] + [tree.token_ids[j] for j in tree.path_to(node)]
        chain = Int8Runner.from_module(model, max_context_length=128).forward(context + path)
        assert torch.equal(rows[node], chain[-1]), node  # bit-identical to decoding the path
    runner.keep_tree_path(len(context), [0, 1, 3, 5])  # accept root -> 8 -> 10 -> 12
    after = runner.forward([13])
    expected = Int8Runner.from_module(model, max_context_length=128).forward(context + [7, 8, 10, 12, 13], num_logits=1)
    assert torch.equal(after, expected) and runner.num_cached_tokens == len(context) + 5


@pytest.mark.parametrize("draft_kind", ["target", "random", "partial"])
@pytest.mark.parametrize("num_nodes", [3, 8])
def test_greedy_tree_speculation_equals_plain(
    draft_kind, num_nodes, target_model, random_draft_model, partial_draft_model, int8_target
):
    from verispec.proposers.draft_tree import DraftTreeProposer

    draft = {"target": target_model, "random": random_draft_model, "partial": partial_draft_model}[draft_kind]
    pieces = CharTokenizer(default_pieces(target_model.config.vocab_size))
    plain = SpeculativeEngine(int8_target, pieces, eos_token_ids=())
    drafter = DraftTreeProposer(Int8Runner.from_module(draft, max_context_length=256), branching=2, max_depth=4)
    engine = SpeculativeEngine(int8_target, pieces, eos_token_ids=(), proposers={"tree": drafter})
    for prompt in PROMPTS:
        expected = plain.generate(prompt, GREEDY_40, SpeculativeConfig(method="none")).token_ids
        out = engine.generate(
            prompt, GREEDY_40, SpeculativeConfig(method="tree", num_speculative_tokens=num_nodes, schedule="constant")
        )
        assert out.token_ids == expected
