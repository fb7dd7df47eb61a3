"""GGUFRunner on tiny GGUF files in every block type: bit-identical verify rows and tree nodes,
exact speculative greedy (also with a draft re-quantized to Q4_0), agreement with transformers'
de-quantized model, loading errors."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_models import DRAFT_LIKE, MIXED, Q4_0_MIX, VOCAB, perturbed_copy, write_gguf_model
from helpers import CharTokenizer, default_pieces, single_thread
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.errors import InvalidParameterError, ModelIntegrityError
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.runners import Runner, prefill
from verispec.runners.cpu.gguf_runner import GGUFRunner, set_kernel_implementation
from verispec.runners.kernels import gguf_kernels

PROMPTS = [[5, 17, 33, 2, 9], [70, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY_40 = SamplingParams(max_tokens=40)
TIED = dict(DRAFT_LIKE, output=None, token_embd=T.Q8_0)  # no output.weight: the head is the embedding
F32_EMBED = dict(MIXED, token_embd=T.F32)
IMPLS = gguf_kernels().supported_isas()  # every path this CPU runs, portable first


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("gguf-models")
    specs = {
        "target": dict(types=MIXED),  # Q4_K q/k, Q6_K v/down/head, Q8_0 o, Q5_0 gate/up
        "draft": dict(types=DRAFT_LIKE, seed=1),  # the 0.5B's mix: Q5_0, Q8_0 v/head, Q4_K down
        "llama": dict(types=DRAFT_LIKE, arch="llama", kv_heads=1, seed=2),  # q/k rows permuted by the converter
        "tied": dict(types=TIED, seed=3),
        "f32-embed": dict(types=F32_EMBED, seed=4),
        "q4_0": dict(types=Q4_0_MIX, seed=5),
    }
    paths = {name: write_gguf_model(directory / f"{name}.gguf", **spec) for name, spec in specs.items()}
    # the target with 30 % of its head's blocks randomised: accepts about 0.5-0.8 of the drafts
    paths["partial"] = perturbed_copy(paths["target"], directory / "partial.gguf", "output.weight", 0.3)
    return paths


@pytest.fixture
def kernel_impl(request):
    set_kernel_implementation(request.param)
    yield request.param
    set_kernel_implementation("auto")


def runner(path: Path, capacity: int = 256, **options) -> GGUFRunner:
    return GGUFRunner.from_file(path, max_context_length=capacity, **options)


def draft_runner(files, kind: str) -> GGUFRunner:
    """``kind``: a file name, or ``"<name>@q4_0"`` for that file re-quantized to Q4_0 as it loads."""
    name, _, requantize = kind.partition("@")
    return runner(files[name], requantize=requantize or None)


def rows_one_at_a_time(r, token_ids):
    return torch.cat([r.forward([t]) for t in token_ids])


@pytest.mark.parametrize("kernel_impl", IMPLS, indirect=True)
@pytest.mark.parametrize(
    "name",
    [
        "target",
        "draft",
        "llama",
        "tied",
        "f32-embed",
        "q4_0",
        "draft@q4_0",
        "target@q4_0",
        "draft@iq4_nl",
        "target@iq4_nl",
    ],
)
def test_verify_pass_is_bit_identical_to_one_token_steps(files, name, kernel_impl):
    r = draft_runner(files, name)
    prompt = [(13 * i + 5) % VOCAB for i in range(40)]
    prefill(r, prompt)
    for k in (1, 2, 3, 5, 8, 9, 16, 17):  # every register-tile remainder
        tokens = [(7 * i + k) % VOCAB for i in range(k)]
        batched = r.forward(tokens)
        r.truncate(len(prompt))
        assert torch.equal(batched, rows_one_at_a_time(r, tokens)), k
        r.truncate(len(prompt))


def test_every_kernel_path_gives_the_portable_bits(files):
    if len(IMPLS) < 2:
        pytest.skip("this CPU runs the portable path only")
    logits = {}
    for impl in IMPLS:
        set_kernel_implementation(impl)
        try:
            logits[impl] = runner(files["target"]).forward(PROMPTS[2])
        finally:
            set_kernel_implementation("auto")
    for impl in IMPLS[1:]:
        assert torch.equal(logits["portable"], logits[impl]), impl


def test_two_threads_give_the_same_bits(files):
    one = runner(files["target"]).forward(PROMPTS[2])
    torch.set_num_threads(2)
    try:
        assert torch.equal(runner(files["target"]).forward(PROMPTS[2]), one)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("name", ["target", "llama", "q4_0"])
def test_close_to_transformers_dequantized_model(files, name):
    from transformers import AutoModelForCausalLM

    path = files[name]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([PROMPTS[2]])).logits[0]
    ours = runner(path).forward(PROMPTS[2])
    assert ours.shape == expected.shape == (len(PROMPTS[2]), VOCAB)
    assert (ours - expected).abs().max() <= 0.05 * expected.abs().max()  # int8 activations; a wrong q/k order: ~0.7
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


# all accepted, almost none, some; the partial draft re-quantized to Q4_0
@pytest.mark.parametrize("draft_kind", ["target", "draft", "partial", "partial@q4_0", "partial@iq4_nl"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_speculative_equals_plain(files, draft_kind, k):
    pieces = CharTokenizer(default_pieces(VOCAB))
    target = runner(files["target"])
    plain = SpeculativeEngine(target, pieces, eos_token_ids=())
    drafter = DraftModelProposer(draft_runner(files, draft_kind))
    engine = SpeculativeEngine(target, pieces, eos_token_ids=(), proposers={"draft": drafter})
    accepted = []
    for prompt in PROMPTS:
        expected = plain.generate(prompt, GREEDY_40, SpeculativeConfig(method="none")).token_ids
        out = engine.generate(prompt, GREEDY_40, SpeculativeConfig(num_speculative_tokens=k, schedule="constant"))
        assert out.token_ids == expected
        accepted.append(out.metrics.spec.acceptance_rate)
    if draft_kind == "target":
        assert min(accepted) == 1.0  # the target drafting for itself is always right
    if draft_kind.startswith("partial"):
        assert 0.2 < sum(accepted) / len(accepted) < 1.0  # some drafts rejected, most accepted


@pytest.mark.parametrize("requantize, qtype", [("q4_0", T.Q4_0), ("iq4_nl", T.IQ4_NL)])
def test_requantization_reads_fewer_bytes_and_stays_close(files, requantize, qtype):
    """Every matrix the file stores above 4.5 bits per weight becomes 4-bit; Q4_K stays; the
    logits move by about the rounding, and the re-quantized draft still mostly agrees."""
    full, q4 = runner(files["target"]), runner(files["target"], requantize=requantize)
    types = {
        qtype
        for layer in q4.weights.layers
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
        for _, qtype, _ in linear.parts
    } | {qtype for _, qtype, _ in q4.weights.lm_head.parts}
    assert types == {int(qtype), int(T.Q4_K)}  # MIXED: Q4_K q/k stay, Q6_K / Q8_0 / Q5_0 are re-quantized
    assert q4.weights.nbytes() < 0.85 * full.weights.nbytes()
    a, b = full.forward(PROMPTS[2]), q4.forward(PROMPTS[2])
    assert not torch.equal(a, b)  # a different draft...
    assert (a - b).abs().max() <= 0.1 * a.abs().max() and (
        a.argmax(-1) == b.argmax(-1)
    ).float().mean() >= 0.8  # ...close to it


def test_unknown_requantization_is_refused(files):
    with pytest.raises(InvalidParameterError, match="unknown re-quantization 'q2_k'"):
        runner(files["draft"], requantize="q2_k")


@pytest.mark.parametrize("num_nodes", [3, 8])
def test_greedy_tree_speculation_equals_plain(files, num_nodes):
    pieces = CharTokenizer(default_pieces(VOCAB))
    target = runner(files["target"])
    plain = SpeculativeEngine(target, pieces, eos_token_ids=())
    drafter = DraftTreeProposer(runner(files["partial"]), branching=2, max_depth=4)
    engine = SpeculativeEngine(target, pieces, eos_token_ids=(), proposers={"tree": drafter})
    for prompt in PROMPTS:
        expected = plain.generate(prompt, GREEDY_40, SpeculativeConfig(method="none")).token_ids
        out = engine.generate(
            prompt, GREEDY_40, SpeculativeConfig(method="tree", num_speculative_tokens=num_nodes, schedule="constant")
        )
        assert out.token_ids == expected


def test_tree_nodes_get_the_logits_of_their_path(files):
    from verispec.algorithms.tree import TokenTree, tree_attention_mask, tree_position_ids

    context = PROMPTS[2]
    tree = TokenTree(token_ids=(7, 8, 9, 10, 11, 12), parents=(-1, 0, 0, 1, 1, 3))
    r = runner(files["target"])
    r.forward(context)
    rows = r.forward_tree(
        list(tree.token_ids), tree_position_ids(tree, len(context)), tree_attention_mask(tree, len(context))
    )
    for node in range(tree.num_nodes):
        path = [tree.token_ids[0]] + [tree.token_ids[j] for j in tree.path_to(node)]
        assert torch.equal(rows[node], runner(files["target"]).forward(context + path)[-1]), node
    r.keep_tree_path(len(context), [0, 1, 3, 5])  # accept root -> 8 -> 10 -> 12
    expected = runner(files["target"]).forward(context + [7, 8, 10, 12, 13], num_logits=1)
    assert torch.equal(r.forward([13]), expected) and r.num_cached_tokens == len(context) + 5


@pytest.mark.parametrize("num_rejected", [0, 2, 5])  # none rejected (a no-op), some, all drafted tokens
def test_rollback_equals_fresh_prefill(files, num_rejected):
    context, draft = PROMPTS[2], [32, 38, 46, 26, 43]
    r = runner(files["target"])
    prefill(r, context)
    r.forward(draft)
    keep = len(context) + len(draft) - num_rejected
    r.truncate(keep)
    assert torch.equal(r.forward([7]), runner(files["target"]).forward((context + draft)[:keep] + [7], num_logits=1))


def test_reduced_head_keeps_the_full_heads_values(files):
    kept = torch.tensor([1, 5, 17, 40, 95])
    full = runner(files["draft"]).forward(PROMPTS[0])
    reduced = runner(files["draft"], head_token_ids=kept).forward(PROMPTS[0])
    assert reduced.shape == full.shape
    assert torch.equal(reduced[:, kept], full[:, kept])  # the same columns, bit for bit
    mask = torch.ones(VOCAB, dtype=torch.bool)
    mask[kept] = False
    assert torch.all(reduced[:, mask] == float("-inf"))


def test_protocol_edges(files):
    r = runner(files["target"], capacity=10)
    assert isinstance(r, Runner) and r.vocab_size == VOCAB and r.max_context_length == 10
    assert r.forward(PROMPTS[0], num_logits=2).shape == (2, VOCAB)
    with pytest.raises(ValueError, match="context length"):
        r.forward(list(range(6)))
    with pytest.raises(ValueError):
        r.forward([])
    r.truncate(0)
    assert r.num_cached_tokens == 0
    assert r.weights.nbytes() > 0 and r.weights.load_time_s > 0


def test_unsupported_block_type_is_named(tmp_path):
    path = write_gguf_model(tmp_path / "q4_1.gguf", dict(MIXED, attn_output=T.F32))
    with pytest.raises(
        InvalidParameterError, match="blk.0.attn_output.weight .* F32.*Q4_K, Q6_K, Q4_0, IQ4_NL, Q5_0, Q8_0"
    ):
        runner(path)


def test_truncated_file_is_a_clear_error(files, tmp_path):
    data = files["target"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelIntegrityError, match="truncated"):
        runner(cut)


def test_other_architectures_are_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        InvalidParameterError,
        match="the gguf and int8 runners support llama, qwen2, qwen3, gemma3, phi3 models, not 'gpt2'",
    ):
        runner(tmp_path / "gpt2.gguf")


def test_pipeline_auto_runs_gguf_files_on_the_gguf_runner(files, tmp_path, monkeypatch):
    from verispec.engine.loader import SpeculativePipeline

    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    pipe = SpeculativePipeline.load(str(files["target"]), str(files["partial"]))
    assert pipe.runner_kind == "gguf"
    assert list((tmp_path / "tokenizers").iterdir())  # built once, then loaded from here
    params = SamplingParams(max_tokens=24)
    plain = pipe.generate("ab!c", params, SpeculativeConfig(method="none"))
    for method in ("draft", "tree", "auto", "ngram"):
        assert (
            pipe.generate(
                "ab!c", params, SpeculativeConfig(method=method, num_speculative_tokens=4, schedule="constant")
            ).token_ids
            == plain.token_ids
        )


@pytest.mark.parametrize(
    "quantization, draft_head", [("auto", T.IQ4_NL), ("q4_0", T.Q4_0), ("iq4_nl", T.IQ4_NL), ("none", T.Q6_K)]
)
def test_pipeline_with_a_q4_0_draft_gives_plain_output(files, tmp_path, monkeypatch, quantization, draft_head):
    from verispec.engine.loader import DrafterOptions, SpeculativePipeline

    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    pipe = SpeculativePipeline.load(
        str(files["target"]), str(files["partial"]), drafters=DrafterOptions(draft_quantization=quantization)
    )
    assert pipe.runner_kind == "gguf"
    assert {qtype for _, qtype, _ in pipe.draft_runner.weights.lm_head.parts} == {int(draft_head)}  # auto: re-quantized
    assert pipe.draft_requantize == {"auto": "iq4_nl", "none": None}.get(quantization, quantization)
    assert {qtype for _, qtype, _ in pipe.target_runner.weights.lm_head.parts} == {int(T.Q6_K)}  # the target never is
    params = SamplingParams(max_tokens=24)
    plain = pipe.generate("ab!c", params, SpeculativeConfig(method="none"))
    for method in ("draft", "tree", "auto"):
        assert (
            pipe.generate(
                "ab!c", params, SpeculativeConfig(method=method, num_speculative_tokens=4, schedule="constant")
            ).token_ids
            == plain.token_ids
        )


@pytest.mark.parametrize(
    "runner_kind, quantization, message",
    [("torch", "q4_0", "needs --runner gguf"), ("gguf", "int8", "needs --runner torch")],
)
def test_draft_quantization_on_the_wrong_runner_is_refused(
    files, tmp_path, monkeypatch, runner_kind, quantization, message
):
    from verispec.engine.loader import DrafterOptions, SpeculativePipeline
    from verispec.runners.select import RunnerOptions

    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    with pytest.raises(InvalidParameterError, match=message):
        SpeculativePipeline.load(
            str(files["target"]),
            str(files["partial"]),
            drafters=DrafterOptions(draft_quantization=quantization),
            runners=RunnerOptions(kind=runner_kind),
        )


def test_requantized_draft_is_cached_and_read_back_bit_identical(files, tmp_path, monkeypatch):
    """The first load writes the re-quantized matrices, the second reads them (re-quantizing is
    made to fail) with bit-identical logits; a reduced head is cut from the cached full head."""
    from verispec.runners.cpu import gguf_blocks

    cache = tmp_path / "weights"
    first = runner(files["draft"], requantize="iq4_nl", cache_dir=cache)
    assert len(list(cache.glob("draft-iq4_nl-*.bin"))) == 1 and not list(cache.glob("*.tmp*"))
    expected = first.forward(PROMPTS[2])
    assert torch.equal(expected, runner(files["draft"], requantize="iq4_nl").forward(PROMPTS[2]))  # uncached: the same

    class NoRequantize:
        def __getattr__(self, name):
            if name == "requantize_4bit":
                raise AssertionError("re-quantized although the cache holds the matrices")
            return getattr(gguf_kernels(), name)

    monkeypatch.setattr(gguf_blocks, "_MODULE", [NoRequantize()])
    assert torch.equal(runner(files["draft"], requantize="iq4_nl", cache_dir=cache).forward(PROMPTS[2]), expected)
    kept = torch.tensor([1, 5, 17, 40, 95])
    reduced = runner(files["draft"], requantize="iq4_nl", cache_dir=cache, head_token_ids=kept).forward(PROMPTS[2])
    assert torch.equal(reduced[:, kept], expected[:, kept])


def test_the_gguf_and_int8_runners_are_one_cpu_runner_over_their_own_ops(files):
    from verispec.runners.cpu.decoder_ops import DecoderOps
    from verispec.runners.cpu.gguf_runner import GGUFOps
    from verispec.runners.cpu.int8 import Int8Ops, Int8Runner
    from verispec.runners.cpu.int8_gguf import int8_weights_from_gguf
    from verispec.runners.cpu.runner import CPURunner

    assert not issubclass(GGUFRunner, Int8Runner) and not issubclass(Int8Runner, GGUFRunner)
    gguf_runner, int8_runner = runner(files["target"], 64), Int8Runner(int8_weights_from_gguf(files["target"], 64))
    members = [name for name in vars(DecoderOps) if not name.startswith("_")] + list(DecoderOps.__annotations__)
    for r, ops_class in ((gguf_runner, GGUFOps), (int8_runner, Int8Ops)):
        assert isinstance(r, CPURunner) and type(r.ops) is ops_class and r.ops.weights is r.weights
        assert all(hasattr(r.ops, name) for name in members)
        sequence = r.new_sequence()
        assert type(sequence) is type(r) and sequence.ops is r.ops and r.shares_weights_with(sequence)
    assert gguf_runner.runs_block_kernels and not int8_runner.runs_block_kernels
    assert not gguf_runner.shares_weights_with(int8_runner)
