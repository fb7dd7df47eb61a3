"""The gguf runner's layers in one C++ call (``LayerStack``) give the bits of the layer ops called one
by one from Python: logits and KV cache entries, one-row steps, chunks and several sequences in one
pass, on every kernel path this CPU runs; architectures it does not cover take the op-by-op loop."""

from pathlib import Path

import pytest
import torch

from gguf_models import DRAFT_LIKE, MIXED, Q4_0_MIX, Shape, write_gguf_model
from verispec.runners import ForwardCall, forward_batch
from verispec.runners.cpu import gguf_runner
from verispec.runners.cpu.gguf_runner import GGUFRunner, set_kernel_implementation
from verispec.runners.kernels import gguf_kernels

IMPLS = gguf_kernels().supported_isas()
MODELS = {
    "qwen2": dict(types=MIXED),  # q/k/v biases, every block type the target mixes
    "llama": dict(types=DRAFT_LIKE, arch="llama", kv_heads=1, seed=2),
    "q4_0": dict(types=Q4_0_MIX, seed=5),
    "phi3": dict(arch="phi3", seed=8),  # fused qkv and gate-up matrices
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("fused-layers")
    return {name: write_gguf_model(directory / f"{name}.gguf", **spec) for name, spec in MODELS.items()}


@pytest.fixture
def kernel_impl(request):
    set_kernel_implementation(request.param)
    yield request.param
    set_kernel_implementation("auto")


def pair(path: Path, **options) -> tuple[GGUFRunner, GGUFRunner]:
    """The same file twice: layers in one call, and op by op."""
    fused = GGUFRunner.from_file(path, max_context_length=64, **options)
    op_by_op = GGUFRunner.from_file(path, max_context_length=64, **options)
    op_by_op.ops.fuses_layers = False
    return fused, op_by_op


def steps(r: GGUFRunner) -> list[torch.Tensor]:
    """Logits of a prefill, a one-row step, a 3-row chunk, a rollback and two sequences in one pass,
    then every cache entry."""
    out = [r.forward([5, 17, 33, 2, 9, 61]), r.forward([4]), r.forward([8, 70, 3])]
    r.truncate(7)
    out.append(r.forward([11]))
    other = r.new_sequence()
    other.forward([40, 41])
    out += forward_batch([ForwardCall(r, [12, 13]), ForwardCall(other, [42])])
    return out + [r.export_kv(0, r.num_cached_tokens), other.export_kv(0, other.num_cached_tokens)]


@pytest.mark.parametrize("kernel_impl", IMPLS, indirect=True)
@pytest.mark.parametrize("name", list(MODELS))
def test_layers_in_one_call_give_the_op_by_op_bits(files, name, kernel_impl, monkeypatch):
    fused, op_by_op = pair(files[name])
    calls = []
    monkeypatch.setattr(fused.ops, "_stack", None)
    real = gguf_runner.layer_stack
    monkeypatch.setattr(gguf_runner, "layer_stack", lambda w: calls.append(w) or real(w))
    for a, b in zip(steps(fused), steps(op_by_op), strict=True):
        assert torch.equal(a, b)
    assert len(calls) == 1  # the fused runner built its stack once and ran it


def test_a_requantized_draft_with_a_reduced_head_gives_the_op_by_op_bits(files):
    fused, op_by_op = pair(
        files["qwen2"], requantize="iq4_nl", head_token_ids=torch.arange(0, 60, 2), context_rows=True
    )
    for a, b in zip(steps(fused), steps(op_by_op), strict=True):
        assert torch.equal(a, b)


def test_tree_passes_feature_capture_and_windows_take_the_op_by_op_loop(files, tmp_path, monkeypatch):
    from verispec.algorithms.tree import TokenTree, tree_attention_mask, tree_position_ids

    r = GGUFRunner.from_file(files["qwen2"], max_context_length=64)
    fused_passes = []
    real = r.ops.run_layers
    monkeypatch.setattr(r.ops, "run_layers", lambda *args: fused_passes.append(1) or real(*args))
    r.forward([5, 17, 33])
    assert len(fused_passes) == 1
    tree = TokenTree(token_ids=(7, 8, 9), parents=(-1, 0, 0))
    r.forward_tree(list(tree.token_ids), tree_position_ids(tree, 3), tree_attention_mask(tree, 3))
    r.truncate(3)
    r.capture_features([0, 1])
    r.forward([4])
    assert len(fused_passes) == 1 and r.last_features is not None  # neither the tree nor the features fused
    gemma = write_gguf_model(
        tmp_path / "gemma.gguf",
        arch="gemma3",
        types=dict(Q4_0_MIX, output=None),
        seed=5,
        heads=2,
        kv_heads=1,
        num_layers=6,
        shape=Shape(head_dim=256, window=3),
    )
    windowed = GGUFRunner.from_file(gemma, max_context_length=64)
    assert not gguf_runner.fusable(windowed.weights) and gguf_runner.fusable(r.weights)
    assert windowed.ops.run_layers(torch.zeros(1, 1), []) is None
