"""Draft chains sized by the draft's own confidence (``ControllerConfig.confident_chains``): the
policy hands a model drafter's chain the stop rule under the ``cost`` schedule, the chain stops
where the rule says (alone and batched alike), and the output is plain decoding's, greedy and seeded."""

import pytest
import torch

from batching_support import PROMPTS, gguf_engine
from verispec.algorithms import schedules
from verispec.algorithms.control import ControllerConfig
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.proposers import DraftRequest
from verispec.proposers.draft_model import DraftModelProposer, propose_batch
from verispec.runners.cpu.gguf_runner import GGUFRunner


def draft_proposer(gguf_files) -> DraftModelProposer:
    return DraftModelProposer(GGUFRunner.from_file(gguf_files["draft"], max_context_length=256))


def test_the_chain_stops_where_the_rule_says_and_is_given_its_own_probabilities(gguf_files):
    proposer, seen = draft_proposer(gguf_files), []

    def two_tokens(confidences):
        seen.append(list(confidences))
        return len(confidences) < 2

    request = DraftRequest(PROMPTS[0], [], SamplingParams(), torch.Generator(), continues=two_tokens)
    draft = proposer.propose(request, 6)
    assert len(draft.draft_token_ids) == 2 and [len(c) for c in seen] == [1, 2]
    assert all(0.0 < c <= 1.0 for c in seen[-1])
    # the first confidence is the draft's top probability after the prompt
    proposer.runner.truncate(0)
    logits = proposer.runner.forward(list(PROMPTS[0]))[-1]
    assert seen[0][0] == pytest.approx(float(torch.softmax(logits.float(), -1).max()))


def test_a_batched_chain_stops_where_it_stops_alone(gguf_files):
    base = draft_proposer(gguf_files)
    rules = [lambda c: len(c) < 1, lambda c: c[-1] > 0.5, lambda c: len(c) < 3, None]

    def requests():
        return [
            DraftRequest(
                PROMPTS[i],
                [],
                SamplingParams(temperature=0.7 * (i % 2), seed=3),
                torch.Generator().manual_seed(i),
                continues=rule,
            )
            for i, rule in enumerate(rules)
        ]

    alone = [base.new_sequence().propose(r, 5) for r in requests()]
    batched = propose_batch([(base.new_sequence(), r, 5) for r in requests()])
    assert [d.draft_token_ids for d in batched] == [d.draft_token_ids for d in alone]
    assert (
        len(alone[0].draft_token_ids) == 1 and len(alone[2].draft_token_ids) == 3 and len(alone[3].draft_token_ids) == 5
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", ["draft", "auto"])
def test_confident_chains_give_plain_decodings_tokens(gguf_files, monkeypatch, method, temperature):
    asked = []
    rule = schedules.chain_continues

    def counted(confidences, alpha, step_costs):
        asked.append(len(confidences))
        return rule(confidences, alpha, step_costs)

    monkeypatch.setattr(schedules, "chain_continues", counted)
    on = gguf_engine(gguf_files)
    off = gguf_engine(gguf_files, controller=ControllerConfig(confident_chains=False))
    for prompt in PROMPTS[:4]:
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=11)
        plain = on.generate(prompt, params, SpeculativeConfig(method="none")).token_ids
        spec = SpeculativeConfig(method=method, num_speculative_tokens=6)
        assert on.generate(prompt, params, spec).token_ids == plain
        before = len(asked)
        assert off.generate(prompt, params, spec).token_ids == plain
        assert len(asked) == before  # off: the rule is never asked
    if method == "draft":
        assert asked  # on: the chains asked it (auto's steps here may all go to its tree and lookups)
