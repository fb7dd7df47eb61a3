"""The EAGLE drafter (proposers/eagle.py) in the generate loop: greedy output equal to plain
decoding token for token on the torch, int8 and gguf runners, alone and batched; sampled output
with the target's distribution; a trained head accepted more often than an untrained one; the
head restarting where features are missing; a head for another target or a damaged file refused."""

import dataclasses

import pytest
import torch
from torch import nn

from gguf_models import HIDDEN as GGUF_HIDDEN
from gguf_models import VOCAB as GGUF_VOCAB
from gguf_models import write_gguf_model
from helpers import VOCAB, BigramRunner, CharTokenizer, default_pieces, greedy_continuations, single_thread, tiny_qwen2
from test_engine import sequence_distribution
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.policy import drafter_order
from verispec.errors import InvalidParameterError, ModelIntegrityError, ModelNotFoundError
from verispec.proposers import DraftRequest
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.factory import DrafterOptions, build_drafters
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.eagle.head import EagleHead, HeadShape
from verispec.runners.torch_runner import TransformersRunner
from verispec.training.loop import TrainOptions, train_head

PROMPTS = [[5, 17, 33, 2, 9], [70, 3, 11, 40], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [88]]
GREEDY = SamplingParams(max_tokens=40)


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(0)


@pytest.fixture(scope="module")
def trained_head(target):
    """A head trained 60 steps on the target's own greedy continuations of random prompts."""
    head = EagleHead.from_target(target, seed=0)
    train_head(
        head,
        target,
        greedy_continuations(target, seed=11),
        TrainOptions(steps=60, lr=3e-3, batch_positions=128, held_out=0.0, seed=0),
    )
    return head


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_gguf_model(tmp_path_factory.mktemp("eagle") / "target.gguf")


def runner_of(kind, target, gguf_path):
    return {
        "torch": lambda: TransformersRunner(target, max_context_length=128),
        "int8": lambda: Int8Runner.from_module(target, max_context_length=128),
        "gguf": lambda: GGUFRunner.from_file(gguf_path, max_context_length=128),
    }[kind]()


def gguf_head(runner, seed=0):
    """An untrained head for the tiny GGUF model (hidden 256, 96 tokens, 2 layers), borrowing the
    runner's embedding as the file stores it."""
    shape = HeadShape(
        hidden_size=GGUF_HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        vocab_size=GGUF_VOCAB,
        num_target_layers=2,
        feature_layers=(1, 1, 0),
        draft_vocab_size=GGUF_VOCAB,
        target_model_type="qwen2",
    )
    return EagleHead(shape, runner.weights.embed, torch.arange(GGUF_VOCAB), seed=seed)


def engine_with(runner, head, vocab):
    return SpeculativeEngine(
        runner, CharTokenizer(default_pieces(vocab)), eos_token_ids=(), proposers={"eagle": EagleProposer(head)}
    )


def generate_all(engine, method, params=GREEDY, k=4):
    return [
        engine.generate(p, params, SpeculativeConfig(method=method, num_speculative_tokens=k, schedule="constant"))
        for p in PROMPTS
    ]


@pytest.mark.parametrize("kind", ["torch", "int8", "gguf"])
def test_greedy_eagle_equals_plain_token_for_token(kind, target, trained_head, gguf_path):
    runner = runner_of(kind, target, gguf_path)
    head = gguf_head(runner) if kind == "gguf" else trained_head.new_sequence()
    engine = engine_with(runner, head, GGUF_VOCAB if kind == "gguf" else VOCAB)
    plain, eagle = generate_all(engine, "none"), generate_all(engine, "eagle")
    for p, e in zip(plain, eagle):
        assert e.token_ids == p.token_ids
    drafted = sum(e.metrics.spec.num_draft_tokens for e in eagle)
    accepted = sum(e.metrics.spec.num_accepted_tokens for e in eagle)
    assert drafted >= 4 * 20  # it drafted on every step once the prompt's features were in
    if kind != "gguf":  # the trained head: some accepted, some rolled back
        assert 0 < accepted < drafted, (accepted, drafted)


def test_trained_head_is_accepted_more_often_than_untrained(target, trained_head):
    rates = {}
    for name, head in {
        "untrained": EagleHead.from_target(target, seed=0),
        "trained": trained_head.new_sequence(),
    }.items():
        outs = generate_all(engine_with(TransformersRunner(target, max_context_length=128), head, VOCAB), "eagle")
        rates[name] = sum(o.metrics.spec.num_accepted_tokens for o in outs) / sum(
            o.metrics.spec.num_draft_tokens for o in outs
        )
    print(f"acceptance rate untrained {rates['untrained']:.3f} trained {rates['trained']:.3f}")
    assert rates["trained"] > rates["untrained"] + 0.15


def stepped_together(head, target, spec):
    """``PROMPTS`` stepped together (each its own slot) on the batch-invariant int8 runner; their
    states after the last step, and each prompt's plain output alone."""
    engine = engine_with(Int8Runner.from_module(target, max_context_length=128), head, VOCAB)
    alone = [engine.generate(p, GREEDY, SpeculativeConfig(method="none")) for p in PROMPTS]
    states = [engine.start(p, GREEDY, spec, engine.new_slot()) for p in PROMPTS]
    while not all(s.finished for s in states):
        engine.step(states)
    return states, alone


def test_batched_eagle_requests_equal_each_alone(target, trained_head, monkeypatch):
    """Four requests stepped together (each its own head cache, shared weights, shared head
    passes) give each one's plain output."""
    from verispec.proposers import eagle as eagle_module

    passes, real = [], eagle_module.forward_heads
    monkeypatch.setattr(eagle_module, "forward_heads", lambda calls: passes.append(len(calls)) or real(calls))
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, schedule="constant")
    states, alone = stepped_together(trained_head.new_sequence(), target, spec)
    assert [s.output.token_ids for s in states] == [a.token_ids for a in alone]
    heads = {id(s.slot.proposers["eagle"].head) for s in states}
    assert len(heads) == len(PROMPTS)  # a head cache per sequence
    assert max(passes) == len(PROMPTS)  # every request's rows in one head pass
    assert sum(s.output.metrics.spec.num_accepted_tokens for s in states) > 0


class ToyFeatureRunner(BigramRunner):
    """A bigram target whose "hidden state" of a row is the one-hot of its token, twice (two layers)."""

    def capture_features(self, layers):
        self.layers = tuple(layers)

    def forward(self, token_ids, num_logits=None):
        onehot = nn.functional.one_hot(torch.tensor(list(token_ids)), self.vocab_size).float()
        self.last_features = torch.cat([onehot, onehot], dim=-1)
        return super().forward(token_ids, num_logits)


def toy_head(vocab=4, draft_ids=(0, 1, 3), seed=0):
    shape = HeadShape(
        hidden_size=vocab,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=2,
        intermediate_size=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        num_target_layers=2,
        feature_layers=(0, 1),
        draft_vocab_size=len(draft_ids),
        target_model_type="qwen2",
    )
    head = EagleHead(shape, nn.Embedding(vocab, vocab), torch.tensor(draft_ids), seed=seed)
    with torch.no_grad():
        head.lm_head.weight.mul_(60.0)  # a peaked draft distribution, unlike the target's
    return head


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0, max_tokens=3), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3)]
)
def test_sampled_eagle_sequences_follow_the_target_distribution(params):
    """20,000 three-token samples, the bound of the draft model's test (test_engine.py); the head
    never drafts token 2 (outside its draft vocabulary), so those tokens are always recovered."""
    tv, accepted, drafted = sampled_distance(ToyFeatureRunner, "eagle", 2, params)
    assert tv < 0.04, tv  # sampling noise alone: about 0.02
    assert 0.1 < accepted / drafted < 0.9, accepted / drafted  # rejections and recoveries happened


TOY_TABLE = torch.tensor([[0.0, 1.0, 2.0, 0.5], [2.0, 0.0, 1.0, 1.5], [1.0, 1.0, 0.0, 2.0], [0.0, 2.0, 1.0, 0.0]])


def sampled_distance(runner_type, method, k, params, num_draws=20000):
    """Total variation between ``num_draws`` seeded three-token samples of ``method`` (the toy
    head over a ``runner_type`` of :data:`TOY_TABLE`) and the target's exact distribution; and
    the accepted and drafted token counts."""
    engine = engine_with(runner_type(TOY_TABLE), toy_head(), 4)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, schedule="constant")
    counts, accepted, drafted = {}, 0, 0
    for seed in range(num_draws):
        out = engine.generate([0], SamplingParams(**{**params.__dict__, "seed": seed}), spec)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        accepted += out.metrics.spec.num_accepted_tokens
        drafted += out.metrics.spec.num_draft_tokens
    exact = sequence_distribution(TOY_TABLE, params, first=0, length=3)
    return 0.5 * sum(abs(counts.get(seq, 0) / num_draws - p) for seq, p in exact.items()), accepted, drafted


def test_draft_probs_are_the_target_rows_of_the_draft_vocabulary():
    proposer = EagleProposer(toy_head())
    proposer.observe_features(torch.eye(4)[[0, 1, 3]].repeat(1, 2), 0)  # features of tokens 0, 1, 3 at 0..2
    request = DraftRequest([0, 1, 3], [1], SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    draft = proposer.propose(request, 3)
    assert len(draft.draft_token_ids) == 3 and draft.draft_probs.shape == (3, 4)
    assert torch.all(draft.draft_probs[:, 2] == 0)  # outside the draft vocabulary
    torch.testing.assert_close(draft.draft_probs.sum(-1), torch.ones(3))
    assert all(t != 2 for t in draft.draft_token_ids)


@pytest.mark.parametrize(
    "observed, context, drafts",
    [
        ([(0, 3)], [0, 1, 3, 1], True),  # features of 0..2 for a 4-token context: drafts
        ([(0, 2)], [0, 1, 3, 1], False),  # position 2's feature missing: nothing to draft from
        ([(0, 3), (6, 1)], [0, 1, 3, 1, 0, 1, 3, 1], True),  # a gap: restarts at 6 and drafts from row 6
        ([(0, 3), (1, 2)], [0, 1, 3, 1], True),  # rolled back to 1 and re-fed 1..2: drafts
    ],
)
def test_the_head_drafts_only_from_features_it_has(observed, context, drafts):
    proposer = EagleProposer(toy_head())
    for position, rows in observed:
        proposer.observe_features(
            torch.eye(4)[[context[(position + i) % len(context)] for i in range(rows)]].repeat(1, 2), position
        )
    request = DraftRequest(context[:2], context[2:], SamplingParams(), torch.Generator())
    assert bool(proposer.propose(request, 3).draft_token_ids) == drafts


def test_a_context_changed_under_the_heads_rows_restarts_it():
    proposer = EagleProposer(toy_head())
    proposer.observe_features(torch.eye(4)[[0, 1, 3]].repeat(1, 2), 0)
    assert proposer.propose(
        DraftRequest([0, 1], [3, 1], SamplingParams(), torch.Generator()), 3
    ).draft_token_ids  # rows 0..2 built
    assert not proposer.propose(
        DraftRequest([0, 3], [3, 1], SamplingParams(), torch.Generator()), 3
    ).draft_token_ids  # token 1 changed
    assert proposer.head.num_cached_tokens == 0  # restarted: nothing of the old rows is attended


def test_auto_drafts_with_the_head_or_the_draft_model_when_the_lookup_fails():
    assert drafter_order("auto", ["ngram", "suffix", "eagle", "draft"]) == ["suffix", "eagle", "draft"]
    assert drafter_order("auto", ["ngram", "eagle", "draft", "tree"], trees=True) == ["ngram", "eagle", "draft", "tree"]
    loaded = ["ngram", "eagle", "eagle-tree", "draft", "tree"]
    assert drafter_order("auto", loaded, trees=True) == ["ngram", "eagle", "eagle-tree", "draft", "tree"]
    assert drafter_order("auto", loaded, trees=False) == [
        "ngram",
        "eagle",
        "draft",
    ]  # no trees where the runner verifies none
    assert drafter_order("eagle-tree", loaded, trees=True) == ["eagle-tree"]
    assert drafter_order("auto", ["ngram", "eagle", "layer-skip"]) == ["ngram", "eagle"]


def test_a_head_for_another_target_or_a_damaged_file_is_refused(target, trained_head, tmp_path, gguf_path):
    trained_head.save(tmp_path / "head.pt")
    with pytest.raises(InvalidParameterError, match="belongs to another target.*num_target_layers 2 != 4"):
        EagleHead.load(tmp_path / "head.pt", tiny_qwen2(0, num_layers=4))
    with pytest.raises(InvalidParameterError, match="hidden_size 32 != 256"):
        EagleHead.load(tmp_path / "head.pt", GGUFRunner.from_file(gguf_path, max_context_length=64))
    with pytest.raises(ModelNotFoundError, match="no EAGLE head at"):
        EagleHead.load(tmp_path / "missing.pt", target)
    (tmp_path / "cut.pt").write_bytes((tmp_path / "head.pt").read_bytes()[:500])
    with pytest.raises(ModelIntegrityError, match="not a readable EAGLE head"):
        EagleHead.load(tmp_path / "cut.pt", target)
    assert torch.equal(
        EagleHead.load(tmp_path / "head.pt", TransformersRunner(target)).lm_head.weight, trained_head.lm_head.weight
    )


def test_the_factory_builds_the_eagle_drafter_over_the_target_runner(target, trained_head, tmp_path):
    trained_head.save(tmp_path / "head.pt")
    options = DrafterOptions(eagle_head=tmp_path / "head.pt", layer_skip_layers=0)
    loaded = type("Loaded", (), {"model": target, "context_length": 128})()
    drafters = build_drafters(options, loaded, target_runner=Int8Runner.from_module(target, max_context_length=64))
    assert (
        isinstance(drafters["eagle"], EagleProposer)
        and drafters["eagle"].feature_layers == trained_head.shape.feature_layers
    )
    with pytest.raises(InvalidParameterError, match="--eagle-head needs a runner that hands out the target's features"):
        build_drafters(options, loaded, target_runner=BigramRunner(torch.zeros(4, 4)))


def test_the_gguf_runner_lends_its_lm_head_rows_to_a_shared_head(gguf_path, tmp_path):
    """A head sharing the target's LM head, loaded over the gguf runner, drafts with the file's
    own output rows (de-quantized), so its logits are those rows times its normed state."""
    runner = GGUFRunner.from_file(gguf_path, max_context_length=64)
    ids = torch.tensor([1, 4, 9, 16, 25])
    rows = runner.weights.output_rows(ids)
    from gguf import GGUFReader, quants

    reader = GGUFReader(gguf_path)
    output = next(t for t in reader.tensors if t.name == "output.weight")
    want = torch.from_numpy(quants.dequantize(output.data, output.tensor_type).astype("float32"))[ids]
    assert rows.dtype == torch.float32 and torch.equal(rows, want)
    head = gguf_head(runner)
    head = EagleHead(
        dataclasses.replace(head.shape, lm_head_from_target=True, draft_vocab_size=5),
        runner.weights.embed,
        ids,
        rows,
        seed=0,
    )
    head.save(tmp_path / "shared.gguf", "q8_0")
    loaded = EagleHead.load(tmp_path / "shared.gguf", runner)
    assert torch.equal(loaded.lm_head.weight, rows)


def test_a_shared_head_over_a_runner_that_lends_no_rows_is_refused(target, tmp_path):
    head = EagleHead.from_target(target, lm_head_from_target=True)
    head.save(tmp_path / "shared.gguf")
    with pytest.raises(InvalidParameterError, match="does not lend"):
        EagleHead.load(tmp_path / "shared.gguf", Int8Runner.from_module(target, max_context_length=64))
