"""The served runner as the teacher of an EAGLE head (ops.train_head.runner_teacher): the target on
the int8 / gguf kernels reads a sequence in prefill passes and hands out its features, final normed
hidden state and greedy tokens; the same values whatever the pass size (batch-invariant kernels),
the same as transformers' where the runner is float-equivalent enough, and a head trained from it
learns to draft."""

import pytest
import torch

from gguf_models import write_gguf_model
from helpers import VOCAB, greedy_continuations, single_thread, tiny_qwen2
from verispec.errors import InvalidParameterError
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.cpu.reduced_vocab import token_counts
from verispec.runners.eagle.head import EagleHead, choose_draft_vocabulary
from verispec.runners.torch_runner import TransformersRunner
from verispec.training.loop import TrainOptions, runner_teacher, teacher, train_head

LAYERS = (1, 0, 1)
SEQUENCE = [5, 17, 33, 2, 9, 70, 3, 11, 40, 41, 42, 7, 7, 19]
EOS = 95


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(0)


@pytest.fixture(scope="module")
def runners(target, tmp_path_factory):
    path = write_gguf_model(tmp_path_factory.mktemp("teacher") / "target.gguf")
    return {
        "int8": Int8Runner.from_module(target, max_context_length=64),
        "gguf": GGUFRunner.from_file(path, max_context_length=64),
    }


@pytest.mark.parametrize("kind", ["int8", "gguf"])
def test_pass_size_changes_no_bit(runners, kind):
    runner = runners[kind]
    whole = runner_teacher(runner, SEQUENCE, LAYERS)
    for chunk in (1, 3, 5):
        part = runner_teacher(runner, SEQUENCE, LAYERS, chunk=chunk)
        assert torch.equal(part.features, whole.features) and torch.equal(part.final_hidden, whole.final_hidden), chunk
        assert torch.equal(part.target_argmax, whole.target_argmax), chunk
    hidden = whole.final_hidden.shape[1]
    assert whole.features.shape == (len(SEQUENCE), len(LAYERS) * hidden) and whole.final_hidden.dtype == torch.float32
    assert runner.num_cached_tokens == 0  # a fresh sequence read it; the runner's own cache untouched


@pytest.mark.parametrize("kind", ["int8", "gguf"])
def test_values_are_the_runners_own(runners, target, kind):
    """The argmax is the runner's own greedy token; the final hidden is the normed last residual
    stream, whose LM head product is the runner's logits; the features are the captured ones."""
    runner = runners[kind]
    read = runner_teacher(runner, SEQUENCE, LAYERS)
    sequence = runner.new_sequence()
    sequence.capture_features(LAYERS)
    logits = sequence.forward(SEQUENCE)
    assert torch.equal(read.target_argmax, logits.argmax(-1))
    assert torch.equal(read.features, sequence.last_features)
    assert sequence.last_final_hidden is None  # capture_final_hidden is off unless asked
    sequence.truncate(0)
    sequence.capture_final_hidden(True)
    again = sequence.forward(SEQUENCE)
    assert torch.equal(again, logits)  # capturing the final hidden state changes no logit bit
    assert torch.equal(sequence.last_final_hidden, read.final_hidden)
    if kind == "int8":  # the LM head's input: the float LM head over it gives the runner's greedy tokens
        head = target.get_output_embeddings().weight.detach()
        assert torch.equal((read.final_hidden @ head.T).argmax(-1), read.target_argmax)


def test_close_to_transformers_on_the_int8_runner(target, runners):
    """int8 weights and activations: not equal to float32 transformers, close (measured: max |diff|
    of the final hidden ~0.05 of its scale; greedy tokens all equal on this sequence)."""
    ours, theirs = runner_teacher(runners["int8"], SEQUENCE, LAYERS), teacher(target, SEQUENCE, LAYERS)
    scale = theirs.final_hidden.abs().max()
    assert (ours.final_hidden - theirs.final_hidden).abs().max() < 0.2 * scale
    assert (ours.features - theirs.features).abs().max() < 0.2 * theirs.features.abs().max()
    assert (ours.target_argmax == theirs.target_argmax).float().mean() >= 0.8


def test_only_the_context_is_read_and_bad_input_refused(runners, target):
    short = Int8Runner(runners["int8"].weights, max_context_length=6)
    assert runner_teacher(short, SEQUENCE, LAYERS).token_ids.tolist() == SEQUENCE[:6]
    with pytest.raises(InvalidParameterError, match="chunk"):
        runner_teacher(runners["int8"], SEQUENCE, LAYERS, chunk=0)
    with pytest.raises(InvalidParameterError, match="hidden states"):
        runner_teacher(TransformersRunner(target, max_context_length=64), SEQUENCE, LAYERS)


def test_a_head_trained_from_the_runner_learns(target, runners):
    """The int8 runner reads the target's own continuations; the head's held-out agreement with the
    runner's greedy tokens rises (as the float32 teacher's test, tests/runners/eagle/test_eagle_head.py)."""
    sequences = greedy_continuations(target, seed=1)
    draft_ids = choose_draft_vocabulary(token_counts(sequences, VOCAB), 64, eos_token_ids=[EOS])
    head = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=0)
    options = TrainOptions(steps=40, lr=3e-3, batch_positions=128, held_out=0.25, seed=0)
    read_count = []

    def read(sequence):
        read_count.append(len(sequence))
        return runner_teacher(runners["int8"], sequence, head.shape.feature_layers)

    report = train_head(head, target, sequences, options, read=read)
    print(f"held-out top-1 {report.held_out_top1_before:.3f} -> {report.held_out_top1:.3f}")
    assert len(read_count) == len(sequences)  # every sequence read by the runner, none by transformers
    assert report.held_out_loss < report.held_out_loss_before
    assert report.held_out_top1 > report.held_out_top1_before + 0.2
