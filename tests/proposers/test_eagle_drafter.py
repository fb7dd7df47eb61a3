"""The EAGLE drafter (proposers/eagle.py) in the generate loop: greedy output equal to plain
decoding token for token on the torch, int8 and gguf runners, alone and batched; sampled output
with the target's distribution; a trained head accepted more often than an untrained one; the
head restarting where features are missing; a head for another target or a damaged file refused."""

import dataclasses

import pytest
import torch

from eagle_support import (
    PROMPTS,
    ToyFeatureRunner,
    engine_with,
    generate_all,
    gguf_head,
    runner_of,
    sampled_distance,
    stepped_together,
    toy_head,
)
from gguf_models import VOCAB as GGUF_VOCAB
from helpers import VOCAB, BigramRunner, single_thread, tiny_qwen2
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.policy import drafter_order
from verispec.errors import InvalidParameterError, ModelIntegrityError, ModelNotFoundError
from verispec.proposers import DraftRequest
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.factory import DrafterOptions, build_drafters
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.eagle.head import EagleHead
from verispec.runners.torch_runner import TransformersRunner


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


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0, max_tokens=3), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3)]
)
def test_sampled_eagle_sequences_follow_the_target_distribution(params):
    """20,000 three-token samples, the bound of the draft model's test (test_engine.py); the head
    never drafts token 2 (outside its draft vocabulary), so those tokens are always recovered."""
    tv, accepted, drafted = sampled_distance(ToyFeatureRunner, "eagle", 2, params)
    assert tv < 0.04, tv  # sampling noise alone: about 0.02
    assert 0.1 < accepted / drafted < 0.9, accepted / drafted  # rejections and recoveries happened


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
