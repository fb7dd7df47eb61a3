"""The engine hands a feature drafter (EAGLE head) the target's hidden states of exactly the
tokens the target keeps, at their positions: prefill chunks, chain and tree verifies, batches."""

import pytest
import torch

from helpers import BigramTreeRunner, CharTokenizer, chain_table, default_pieces
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.scheduler import Scheduler
from verispec.errors import InvalidParameterError
from verispec.proposers import DraftOutput, Proposer

VOCAB = 24


class FeatureRunner(BigramTreeRunner):
    """Its "hidden state" of a row is ``[token id, position]``, so a feature names its token."""

    def capture_features(self, layers):
        self.layers = tuple(layers)

    def new_sequence(self):
        clone = FeatureRunner(self.table, self.max_context_length)
        clone.layers = self.layers
        return clone

    def forward(self, token_ids, num_logits=None):
        start = len(self.token_ids)
        self.last_features = torch.tensor([[float(t), float(start + i)] for i, t in enumerate(token_ids)])
        return super().forward(token_ids, num_logits)

    def forward_tree(self, token_ids, position_ids, attention_mask):
        start = len(self.token_ids)
        logits = super().forward_tree(token_ids, position_ids, attention_mask)
        self.last_features = torch.tensor(
            [[float(t), float(start + int(p) - int(position_ids[0]))] for t, p in zip(token_ids, position_ids)]
        )
        return logits


class Recorder(Proposer):
    """Drafts ``token + 1`` chains (often right, often wrong) and keeps every feature it is given."""

    feature_layers = (1,)

    def __init__(self):
        self.seen = {}

    def new_sequence(self):
        return Recorder()

    def propose(self, request, num_speculative_tokens):
        last = request.context[-1]
        return DraftOutput([(last + 1 + i) % VOCAB for i in range(num_speculative_tokens)])

    def observe_features(self, features, position):
        for offset, row in enumerate(features.tolist()):
            self.seen[position + offset] = row


def engine(recorder, table=None):
    table = (
        table
        if table is not None
        else chain_table({i: (i + (2 if i % 4 == 3 else 1)) % VOCAB for i in range(VOCAB)}, VOCAB)
    )
    return SpeculativeEngine(
        FeatureRunner(table), CharTokenizer(default_pieces(VOCAB)), eos_token_ids=(), proposers={"draft": recorder}
    )


def assert_aligned(recorder, prompt, output):
    tokens = list(prompt) + list(output)
    assert sorted(recorder.seen) == list(range(len(tokens) - 1))  # every kept token, the pending last one not yet
    assert all(recorder.seen[p] == [float(tokens[p]), float(p)] for p in recorder.seen)


@pytest.mark.parametrize("method", ["draft", "none", "tree"])
def test_every_kept_token_reaches_the_feature_drafter_at_its_position(method):
    recorder = Recorder()
    eng = engine(recorder)
    prompt = [3, 4, 5, 3, 4, 9, 10]
    out = eng.generate(
        prompt,
        SamplingParams(max_tokens=30),
        SpeculativeConfig(method=method, num_speculative_tokens=4, schedule="constant"),
    )
    assert_aligned(recorder, prompt, out.token_ids)
    if method == "draft":
        assert 0 < out.metrics.spec.num_accepted_tokens < out.metrics.spec.num_draft_tokens  # some rows rolled back
    if method == "tree":
        assert out.metrics.spec.num_drafts > 0  # trees were verified (n-gram branches)


def test_chunked_prefills_and_batched_requests_each_feed_their_own_drafter():
    recorder = Recorder()
    eng = engine(recorder)
    eng.max_num_batched_tokens = 3  # prompts prefilled in chunks while the other request decodes
    prompts = [[3, 4, 5, 3, 4, 9, 10, 11], [7, 8, 12, 13, 7, 8]]
    states = [
        eng.start(
            p,
            SamplingParams(max_tokens=20),
            SpeculativeConfig(method="draft", num_speculative_tokens=3),
            eng.new_slot(),
        )
        for p in prompts
    ]
    while not all(s.finished for s in states):
        eng.step(states)
    for state, prompt in zip(states, prompts):
        (drafter,) = state.slot.feature_readers
        assert_aligned(drafter, prompt, state.output.token_ids)


def test_a_runner_without_features_is_refused_for_a_feature_drafter():
    with pytest.raises(InvalidParameterError, match="cannot hand its hidden states to a feature drafter"):
        SpeculativeEngine(
            BigramTreeRunner(torch.zeros(VOCAB, VOCAB)),
            CharTokenizer(default_pieces(VOCAB)),
            eos_token_ids=(),
            proposers={"draft": Recorder()},
        )
