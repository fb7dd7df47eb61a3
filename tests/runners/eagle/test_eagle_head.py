"""EAGLE-3 head (runners/eagle/head.py) and its self-distillation (training/loop.py) on the tiny
Qwen2 target: shapes, cache rollback, the draft vocabulary, refusals, the training-time-test
unroll against inference, learning, determinism, save/load."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from helpers import VOCAB, greedy_continuations, single_thread, tiny_qwen2
from verispec.errors import InvalidParameterError
from verispec.runners.cpu.reduced_vocab import token_counts
from verispec.runners.eagle.head import (
    EagleHead,
    choose_draft_vocabulary,
    default_feature_layers,
)
from verispec.training.loop import TrainOptions, make_optimizer, teacher, train_head, ttt_unroll

EOS = 95
HIDDEN = 32


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(0)


@pytest.fixture(scope="module")
def sequences(target):
    """48 greedy continuations (28 tokens) of random 4-token prompts: the target's own outputs."""
    return greedy_continuations(target, seed=1)


@pytest.fixture(scope="module")
def draft_ids(sequences):
    return choose_draft_vocabulary(token_counts(sequences, VOCAB), 64, eos_token_ids=[EOS])


def features_of(target, token_ids, layers):
    return teacher(target, token_ids, layers).features


@pytest.mark.parametrize(
    "num_layers, expected",
    [
        (2, (1, 1, 0)),  # the tiny target: (2, 1, -1) clamped into [0, N - 1]
        (4, (2, 2, 1)),
        (28, (2, 14, 25)),  # Qwen2.5-1.5B: EAGLE-3's low, middle, high
    ],
)
def test_default_feature_layers(num_layers, expected):
    assert default_feature_layers(num_layers) == expected


@pytest.mark.parametrize(
    "counts, size, eos, expected",
    [
        ([5, 0, 9, 9, 1], 2, (), [2, 3]),  # the two most frequent
        ([5, 0, 9, 9, 1], 2, (1,), [1, 2]),  # EOS never seen, still kept; size stays exact
        ([5, 0, 9, 9, 1], 1, (), [2]),  # tie on count: lower id first
    ],
)
def test_choose_draft_vocabulary(counts, size, eos, expected):
    assert choose_draft_vocabulary(torch.tensor(counts), size, eos).tolist() == expected


@pytest.mark.parametrize(
    "size, eos", [(0, ()), (6, ()), (1, (0, 1)), (2, (7,))]
)  # empty, too big, EOS overflow, unknown id
def test_choose_draft_vocabulary_refuses(size, eos):
    with pytest.raises(InvalidParameterError):
        choose_draft_vocabulary(torch.ones(5), size, eos)


def test_shapes_dtypes_and_both_input_paths(target, draft_ids):
    head = EagleHead.from_target(target, draft_token_ids=draft_ids)
    token_ids = [3, 14, 15, 92, 65]
    features = features_of(target, token_ids, head.shape.feature_layers)
    assert features.shape == (5, 3 * HIDDEN) and features.dtype == torch.float32
    logits, hidden = head(token_ids[1:], features=features[:4])
    assert logits.shape == (4, 64) and logits.dtype == torch.float32
    assert hidden.shape == (4, HIDDEN) and hidden.dtype == torch.float32
    logits, hidden = head([7], hidden=hidden[-1:])  # a draft step on the head's own output
    assert logits.shape == (1, 64) and head.num_cached_tokens == 5
    with pytest.raises(InvalidParameterError):
        head([1], features=features[:1], hidden=hidden)  # both inputs
    with pytest.raises(InvalidParameterError):
        head([1], hidden=features[:1])  # 3H where H is expected


def test_cache_and_truncate_match_recomputing(target, draft_ids):
    head = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=3)
    token_ids = [5, 17, 33, 2, 9, 70, 3, 11]
    features = features_of(target, token_ids, head.shape.feature_layers)[:7]
    full, _ = head(token_ids[1:], features=features)
    head.truncate(0)
    first, _ = head(token_ids[1:4], features=features[:3])
    rest, _ = head(token_ids[4:], features=features[3:])
    torch.testing.assert_close(torch.cat([first, rest]), full, rtol=1e-5, atol=1e-5)  # chunked == one pass
    head([1, 2], features=torch.randn(2, 3 * HIDDEN))  # a draft the target rejects
    head.truncate(7)
    head.truncate(7)  # zero rows discarded: a no-op
    head.truncate(4)  # roll back into the accepted part too
    again, _ = head(token_ids[5:], features=features[4:])
    torch.testing.assert_close(again, full[4:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        head.truncate(8)  # beyond the cache


def test_d2t_maps_draft_rows_to_target_ids(target, draft_ids):
    head = EagleHead.from_target(target, draft_token_ids=draft_ids)
    assert head.d2t.dtype == torch.long and head.d2t.tolist() == draft_ids.tolist()
    assert EOS in head.d2t.tolist()
    assert head.draft_to_target(torch.tensor([0, 63])).tolist() == [draft_ids[0].item(), draft_ids[63].item()]
    torch.testing.assert_close(
        head.lm_head.weight, target.lm_head.weight[draft_ids]
    )  # initialised from the target's rows
    assert not any("embed" in key for key in head.state_dict())  # the embedding is borrowed, not stored
    assert head.config["draft_vocab_size"] == 64 and head.config["feature_layers"] == [1, 1, 0]


def test_refuses_another_target(target, tmp_path):
    head = EagleHead.from_target(target)
    head.save(tmp_path / "head.pt")
    wider = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(InvalidParameterError, match="hidden_size 32 != 48"):
        EagleHead.load(tmp_path / "head.pt", wider)
    with pytest.raises(InvalidParameterError, match="hidden size 32"):
        EagleHead(head.shape, wider.get_input_embeddings(), head.d2t)  # another target's embedding
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
    with pytest.raises(InvalidParameterError, match="gpt2"):
        EagleHead.from_target(gpt2)  # unsupported architecture
    with pytest.raises(InvalidParameterError):
        EagleHead.from_target(target, feature_layers=(0, 2))  # 2 is the final-normed state, not a layer input
    with pytest.raises(InvalidParameterError):
        EagleHead.from_target(target, draft_token_ids=[0, VOCAB])  # an id outside the vocabulary


def test_refuses_a_target_of_the_same_shapes_with_other_weights(target, tmp_path):
    """A base model and its fine-tune share every shape: the final norm's digest tells them apart,
    whatever runner holds the target; a head written before the digest existed still loads."""
    from dataclasses import replace

    from verispec.runners.cpu.int8 import Int8Runner

    head = EagleHead.from_target(target, seed=0)
    assert len(head.shape.target_norm_sha256) == 64
    head.save(tmp_path / "head.gguf")
    other = tiny_qwen2(1)  # the same config, other weights
    with torch.no_grad():
        other.model.norm.weight.mul_(1.01)  # a fine-tune moves the norms too
    with pytest.raises(InvalidParameterError, match="another target of the same shapes"):
        EagleHead.load(tmp_path / "head.gguf", other)
    with pytest.raises(InvalidParameterError, match="another target of the same shapes"):
        EagleHead.load(tmp_path / "head.gguf", Int8Runner.from_module(other, max_context_length=32))
    same = EagleHead.load(
        tmp_path / "head.gguf", Int8Runner.from_module(target, max_context_length=32)
    )  # another runner, same target
    assert same.shape == head.shape
    old = EagleHead(replace(head.shape, target_norm_sha256=""), target.get_input_embeddings(), head.d2t)
    old.load_state_dict(head.state_dict())
    old.save(tmp_path / "old.gguf")
    assert EagleHead.load(tmp_path / "old.gguf", other).shape.target_norm_sha256 == ""  # nothing to compare: loads


def test_ttt_unroll_matches_inference(target, sequences, draft_ids):
    """Step j of the training unroll at anchor t == what the head computes when drafting from t."""
    head = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=5)
    ids = torch.tensor(sequences[0][:16])
    features = features_of(target, ids.tolist(), head.shape.feature_layers)
    anchors = torch.arange(12)
    unrolled = ttt_unroll(head, features[anchors], torch.stack([ids[anchors + j + 1] for j in range(3)]), anchors)
    for t in (0, 5, 11):
        head.truncate(0)
        logits, hidden = head(ids[1 : t + 2], features=features[: t + 1])  # anchors 0..t
        torch.testing.assert_close(logits[-1], unrolled[0][t], rtol=1e-4, atol=1e-4)
        for j in (1, 2):  # feed the head's own output with the next true token
            logits, hidden = head(ids[t + j + 1 : t + j + 2], hidden=hidden[-1:])
            torch.testing.assert_close(logits[-1], unrolled[j][t], rtol=1e-4, atol=1e-4)


def test_training_lowers_loss_and_raises_agreement(target, sequences, draft_ids):
    head = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=0)
    seen = []
    options = TrainOptions(steps=40, lr=3e-3, batch_positions=128, held_out=0.25, seed=0)
    report = train_head(
        head, target, sequences, options, on_step=lambda step, loss, top1, rate: seen.append((step, loss, top1, rate))
    )
    print(
        f"loss {report.losses[0]:.2f} -> {report.losses[-1]:.2f}; held-out loss {report.held_out_loss_before:.2f} -> "
        f"{report.held_out_loss:.2f}; held-out top-1 {report.held_out_top1_before:.3f} -> {report.held_out_top1:.3f} "
        f"(by step {[round(x, 3) for x in report.held_out_top1_by_step]})"
    )
    assert report.steps == 40 and [s for s, _, _, _ in seen] == list(range(1, 41))
    assert all(rate > 0 for *_, rate in seen)  # anchors per second of the loop
    assert sum(report.losses[-5:]) / 5 < 0.6 * sum(report.losses[:5]) / 5  # the training loss falls
    assert report.held_out_loss < report.held_out_loss_before
    assert report.held_out_top1 > report.held_out_top1_before + 0.2  # measured: 0.02 -> 0.41
    assert len(report.held_out_top1_by_step) == 3


def test_training_is_deterministic(target, sequences, draft_ids):
    def run():
        head = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=1)
        report = train_head(
            head, target, sequences[:12], TrainOptions(steps=3, lr=1e-3, batch_positions=64, held_out=0.25, seed=2)
        )
        return report.losses, head.state_dict()

    (losses_a, state_a), (losses_b, state_b) = run(), run()
    assert losses_a == losses_b
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key


def test_a_resumed_run_continues_as_if_never_stopped(target, sequences, draft_ids):
    """3 steps, then 3 more from the saved optimiser state and the step count: the same head and
    losses as 6 steps in one run (the moments and the batch order both continue)."""
    options = dict(lr=1e-3, batch_positions=64, held_out=0.25, seed=2)
    whole = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=1)
    whole_losses = train_head(whole, target, sequences[:12], TrainOptions(steps=6, **options)).losses
    split = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=1)
    first_options = TrainOptions(steps=3, **options)
    optimizer = make_optimizer(split, first_options)
    first = train_head(split, target, sequences[:12], first_options, optimizer=optimizer).losses
    state = optimizer.state_dict()
    second_options = TrainOptions(steps=3, steps_before=3, **options)
    second = train_head(
        split, target, sequences[:12], second_options, optimizer=make_optimizer(split, second_options, state)
    ).losses
    assert first + second == whole_losses
    for key, value in whole.state_dict().items():
        assert torch.equal(split.state_dict()[key], value), key


def test_an_optimiser_state_of_another_head_is_refused(target, draft_ids):
    with pytest.raises(InvalidParameterError, match="optimiser state is not one of this head's"):
        make_optimizer(
            EagleHead.from_target(target, draft_token_ids=draft_ids, seed=1),
            TrainOptions(),
            {"state": {}, "param_groups": [{"params": [0]}]},
        )  # one parameter, the head has many


def test_train_head_refuses_a_run_without_a_budget(target, sequences):
    with pytest.raises(InvalidParameterError, match="needs a budget"):
        train_head(EagleHead.from_target(target), target, sequences[:4], TrainOptions(steps=None))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(ttt_steps=0), "ttt_steps must be >= 1, got 0"),
        (dict(held_out=1.0), r"held_out must be in \[0, 1\), got 1.0"),
        (dict(lr=-1.0), "lr must be > 0, got -1.0"),  # was torch's ValueError, a traceback, after the data was made
        (dict(lr=float("nan")), "lr must be > 0, got nan"),
        (dict(minutes=0.0), "minutes must be > 0, got 0.0"),  # was a head written after 0 steps, agreement nan
        (dict(steps=0), "steps must be >= 1, got 0"),
    ],
)
def test_train_options_refuse_what_cannot_train_when_made(options, message):
    with pytest.raises(InvalidParameterError, match=message):
        TrainOptions(**options)


def test_save_load_round_trip(target, sequences, draft_ids, tmp_path):
    head = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=7)
    train_head(head, target, sequences[:8], TrainOptions(steps=2, lr=1e-3, held_out=0.0))
    head.save(tmp_path / "head.pt")
    loaded = EagleHead.load(tmp_path / "head.pt", target)
    ids = sequences[9][:10]
    features = features_of(target, ids, head.shape.feature_layers)[:9]
    head.truncate(0)
    expected, hidden = head(ids[1:], features=features)
    got, got_hidden = loaded(ids[1:], features=features)
    assert torch.equal(got, expected) and torch.equal(got_hidden, hidden)
    assert loaded.config == head.config
