"""The EAGLE drafter's test kit (``tests/proposers/test_eagle_drafter.py`` and the tests of
batched heads, trees of heads and the heads' block kernels): runners of the tiny target, an
untrained head for the tiny GGUF model, an engine drafting with a head, a toy target whose
features are one-hot rows, and the sampled distance of a head's output from the target's
distribution. The target, the trained head and the GGUF file are fixtures of the conftest files."""

import torch
from torch import nn

from gguf_models import HIDDEN as GGUF_HIDDEN
from gguf_models import VOCAB as GGUF_VOCAB
from helpers import VOCAB, BigramRunner, CharTokenizer, default_pieces, sequence_distribution
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.proposers.eagle import EagleProposer
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.eagle.head import EagleHead, HeadShape
from verispec.runners.torch_runner import TransformersRunner

PROMPTS = [[5, 17, 33, 2, 9], [70, 3, 11, 40], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [88]]
GREEDY = SamplingParams(max_tokens=40)


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


def stepped_together(head, target, spec):
    """``PROMPTS`` stepped together (each its own slot) on the batch-invariant int8 runner; their
    states after the last step, and each prompt's plain output alone."""
    engine = engine_with(Int8Runner.from_module(target, max_context_length=128), head, VOCAB)
    alone = [engine.generate(p, GREEDY, SpeculativeConfig(method="none")) for p in PROMPTS]
    states = [engine.start(p, GREEDY, spec, engine.new_slot()) for p in PROMPTS]
    while not all(s.finished for s in states):
        engine.step(states)
    return states, alone


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
