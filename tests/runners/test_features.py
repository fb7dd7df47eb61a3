"""Features out of the verify pass (EAGLE-3, arXiv 2503.01840): the runners hand out the hidden
states of chosen layers for every row they compute, with no extra pass and the logits unchanged
bit for bit; on the int8 and gguf runners a row's features do not depend on the rest of the pass
(one-token steps, one k-row pass, a batch with another sequence, a tree); on the torch runner
they equal transformers' ``output_hidden_states``."""

import pytest
import torch

from gguf_models import HIDDEN as GGUF_HIDDEN
from gguf_models import write_gguf_model
from helpers import CharTokenizer, default_pieces, single_thread, tiny_qwen2
from verispec.algorithms.sampling import SamplingParams
from verispec.algorithms.tree import TokenTree, tree_attention_mask, tree_position_ids
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.errors import InvalidParameterError
from verispec.proposers import DraftOutput, Proposer
from verispec.runners import ForwardCall, forward_batch, prefill
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.eagle import head as eagle_head
from verispec.runners.features import default_feature_layers
from verispec.runners.torch_runner import TransformersRunner

NUM_LAYERS = 4
LAYERS = (3, 0, 2)  # out of order, the embeddings and the last layer's input included
PROMPT = [5, 17, 33, 2, 9, 70, 3, 11]
DRAFT = [32, 38, 46, 26, 43]
TREE = TokenTree((35, 8, 9, 79, 32, 38), (-1, 0, 0, 1, 1, 3))  # 35 -> {8 -> {79 -> 38, 32}, 9}
EXACT = ["int8", "gguf"]  # batch-invariant runners: features equal bit for bit
ALL = EXACT + ["torch"]


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2(0, num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_gguf_model(tmp_path_factory.mktemp("features") / "target.gguf", num_layers=NUM_LAYERS)


@pytest.fixture
def make(model, gguf_path):
    """``make(kind, layers)``: a fresh runner of ``kind``, capturing ``layers`` (``()``: off)."""

    def build(kind, layers=LAYERS):
        runner = {
            "int8": lambda: Int8Runner.from_module(model, max_context_length=128),
            "gguf": lambda: GGUFRunner.from_file(gguf_path, max_context_length=128),
            "torch": lambda: TransformersRunner(model, max_context_length=128),
        }[kind]()
        runner.capture_features(layers)
        return runner

    return build


def hidden_size(kind):
    return GGUF_HIDDEN if kind == "gguf" else 32  # tiny_qwen2's


@pytest.mark.parametrize(
    "num_layers, expected",
    [
        (1, (0, 0, 0)),  # one layer: only the embeddings precede a layer
        (2, (1, 1, 0)),  # (2, 1, -1) clamped into [0, 1]
        (4, (2, 2, 1)),  # the tests' 4-layer models
        (28, (2, 14, 25)),  # Qwen2.5-1.5B: EAGLE-3's low, middle, high
        (32, (2, 16, 29)),  # Llama-3.1-8B, the paper's target
    ],
)
def test_default_feature_layers(num_layers, expected):
    assert default_feature_layers(num_layers) == expected


def test_default_layers_agree_with_the_head():
    assert eagle_head.default_feature_layers is default_feature_layers  # one definition


@pytest.mark.parametrize("kind", ALL)
def test_capture_changes_no_logit_bit(make, kind):
    plain, capturing = make(kind, ()), make(kind)
    for r in (plain, capturing):  # prefill, a verify chain with fewer logits rows, a tree
        r.outputs = [prefill(r, PROMPT), r.forward(DRAFT, num_logits=2), r.forward([7, 8, 9])]
        cached = r.num_cached_tokens
        r.outputs.append(
            r.forward_tree(list(TREE.token_ids), tree_position_ids(TREE, cached), tree_attention_mask(TREE, cached))
        )
    assert all(torch.equal(a, b) for a, b in zip(plain.outputs, capturing.outputs))
    assert plain.last_features is None
    assert capturing.last_features.shape == (TREE.num_nodes, len(LAYERS) * hidden_size(kind))


@pytest.mark.parametrize("kind", ALL)
def test_every_row_in_the_order_given(make, kind):
    r = make(kind)
    prefill(r, PROMPT)
    r.forward(DRAFT, num_logits=1)  # one logits row, features for all five
    features = r.last_features
    hidden = hidden_size(kind)
    assert features.dtype == torch.float32 and features.shape == (len(DRAFT), len(LAYERS) * hidden)
    r.truncate(len(PROMPT))
    r.capture_features((2,))
    r.forward(DRAFT)
    assert torch.equal(r.last_features, features[:, 2 * hidden :])  # LAYERS[2] == 2: the third block


@pytest.mark.parametrize("kind", EXACT)
def test_features_of_one_pass_equal_one_token_steps(make, kind):
    r = make(kind)
    prefill(r, PROMPT)
    for k in (1, 2, 5, 9):
        tokens = [(7 * i + k) % 96 for i in range(k)]
        r.forward(tokens, num_logits=1)
        together = r.last_features
        r.truncate(len(PROMPT))
        steps = []
        for t in tokens:
            r.forward([t])
            steps.append(r.last_features)
        r.truncate(len(PROMPT))
        assert torch.equal(together, torch.cat(steps)), k


@pytest.mark.parametrize("kind", EXACT)
def test_batched_sequences_each_get_their_own_rows(make, kind):
    alone_a, alone_b = make(kind), make(kind)
    prefill(alone_a, PROMPT)
    alone_a.forward(DRAFT)
    alone_b.forward([40, 41, 42], num_logits=1)  # a prefill chunk
    a = make(kind)
    b, off = a.new_sequence(), a.new_sequence()  # new_sequence keeps the capture ...
    off.capture_features(())  # ... until turned off
    prefill(a, PROMPT)
    forward_batch([ForwardCall(a, DRAFT), ForwardCall(b, [40, 41, 42], num_logits=0), ForwardCall(off, [1, 2])])
    assert torch.equal(a.last_features, alone_a.last_features)
    assert torch.equal(b.last_features, alone_b.last_features)  # every row though no logits row
    assert off.last_features is None


@pytest.mark.parametrize("kind", EXACT)
def test_a_tree_node_has_the_features_of_its_path(make, kind):
    r = make(kind)
    prefill(r, PROMPT)
    r.forward_tree(list(TREE.token_ids), tree_position_ids(TREE, len(PROMPT)), tree_attention_mask(TREE, len(PROMPT)))
    tree_features = r.last_features
    for leaf in (2, 4, 5):  # 35 -> 9; 35 -> 8 -> 32; 35 -> 8 -> 79 -> 38
        path = [0] + TREE.path_to(leaf)  # the root first
        r.truncate(len(PROMPT))
        r.forward([TREE.token_ids[n] for n in path])
        assert torch.equal(r.last_features, tree_features[path]), leaf


def test_torch_features_are_transformers_hidden_states(make, model):
    r = make("torch")
    rows = []
    for chunk in (PROMPT, DRAFT, [7]):
        r.forward(chunk, num_logits=1)
        rows.append(r.last_features)
    with torch.no_grad():
        states = model(input_ids=torch.tensor([PROMPT + DRAFT + [7]]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in LAYERS], dim=-1)
    torch.testing.assert_close(torch.cat(rows), expected, rtol=1e-5, atol=1e-5)


def test_int8_features_follow_the_same_layer_convention(make, model):
    """Quantized, so only close: each captured block is nearest to transformers' state of its own index."""
    r = make("int8", tuple(range(NUM_LAYERS)))
    r.forward(PROMPT)
    with torch.no_grad():
        states = model(input_ids=torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    blocks = r.last_features.split(model.config.hidden_size, dim=-1)
    for i, block in enumerate(blocks):
        errors = [float((block - s[0]).norm() / s[0].norm()) for s in states]
        assert min(range(len(states)), key=errors.__getitem__) == i and errors[i] < 0.05, (i, errors)


@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("layers", [(-1,), (NUM_LAYERS,), (0, NUM_LAYERS + 3)])  # NUM_LAYERS: the final-normed state
def test_a_layer_out_of_range_is_refused(make, kind, layers):
    r = make(kind, ())
    with pytest.raises(InvalidParameterError, match="feature layers"):
        r.capture_features(layers)


class Recorder(Proposer):
    """Drafts ``token + 1`` chains (mostly rejected: rows rolled back) and keeps every feature row."""

    feature_layers = (1, 3)

    def __init__(self):
        self.seen = {}

    def new_sequence(self):
        return Recorder()

    def propose(self, request, num_speculative_tokens):
        return DraftOutput([(request.context[-1] + 1 + i) % 96 for i in range(num_speculative_tokens)])

    def observe_features(self, features, position):
        for offset, row in enumerate(features):
            self.seen[position + offset] = row.clone()


@pytest.mark.parametrize("method", ["draft", "tree"])
def test_engine_hands_the_drafter_the_features_of_one_plain_pass(make, method):
    """Through the engine (chain or tree verifies, rollbacks), every kept token's features equal
    those of one pass over the final text: what an EAGLE head would have been trained on."""
    recorder = Recorder()
    engine = SpeculativeEngine(
        make("int8", ()), CharTokenizer(default_pieces(96)), eos_token_ids=(), proposers={"draft": recorder}
    )
    out = engine.generate(
        PROMPT, SamplingParams(max_tokens=24), SpeculativeConfig(method=method, num_speculative_tokens=3)
    )
    tokens = PROMPT + list(out.token_ids)
    reference = make("int8", Recorder.feature_layers)
    reference.forward(tokens[:-1])
    assert sorted(recorder.seen) == list(range(len(tokens) - 1))  # the last token is not in the cache yet
    assert all(torch.equal(recorder.seen[p], reference.last_features[p]) for p in recorder.seen)
