"""The drafter protocol (every hook declared, defaults given) and the factory that decides which
drafters an engine gets."""

import pytest
import torch

from helpers import BigramRunner, CharTokenizer, chain_table, default_pieces, make_engine, single_thread, tiny_qwen2
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.errors import InvalidParameterError
from verispec.proposers import DraftOutput, DraftRequest, Proposer
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.factory import for_new_sequence, with_lookup_drafters, with_own_suffix_cache
from verispec.proposers.ngram import NgramProposer, NgramTreeProposer
from verispec.proposers.suffix import SuffixProposer, SuffixTreeProposer
from verispec.runners.torch_runner import TransformersRunner


class Repeat(Proposer):
    """Drafts the last context token again, k times: only ``propose`` implemented."""

    def propose(self, request, num_speculative_tokens):
        return DraftOutput([request.context[-1]] * num_speculative_tokens)


class RepeatPerSequence(Repeat):
    def new_sequence(self):
        return RepeatPerSequence()


def request(context):
    return DraftRequest(context[:1], context[1:], SamplingParams(), torch.Generator())


def test_the_defaults_suit_a_stateless_drafter():
    drafter = Repeat()
    assert drafter.catch_up_rows(request([1, 2])) == 0
    assert drafter.end_request([1], [2]) is None and drafter.observe(3) is None
    assert (drafter.holds_sequences, drafter.batches) == (False, False)
    with pytest.raises(ValueError, match="Repeat cannot follow another sequence"):
        drafter.new_sequence()


def test_a_drafter_holds_sequences_when_it_implements_new_sequence():
    assert RepeatPerSequence().holds_sequences is True
    assert isinstance(RepeatPerSequence().new_sequence(), RepeatPerSequence)


def test_the_default_propose_batch_is_each_propose_alone():
    items = [(Repeat(), request([4, 5]), 2), (Repeat(), request([6]), 3)]
    drafts = Proposer.propose_batch(items)
    assert [d.draft_token_ids for d in drafts] == [[5, 5], [6, 6, 6]]


def test_a_draft_model_drafter_batches_unless_a_subclass_drafts_its_own_way():
    runner = TransformersRunner(tiny_qwen2(1))

    class Own(DraftModelProposer):
        def propose(self, request, num_speculative_tokens):
            return DraftOutput()

    assert DraftModelProposer(runner).batches is True
    assert Own(runner).batches is False


def test_an_engine_refuses_an_object_that_is_not_a_drafter():
    class Duck:
        def propose(self, request, num_speculative_tokens):
            return DraftOutput()

        def observe(self, num_accepted_tokens):
            pass

    with pytest.raises(
        InvalidParameterError, match="drafter 'duck' is a Duck: drafters subclass verispec.proposers.Proposer"
    ):
        SpeculativeEngine(
            BigramRunner(chain_table({}, 8)),
            CharTokenizer(default_pieces(8)),
            eos_token_ids=(),
            proposers={"duck": Duck()},
        )


def test_a_custom_drafter_is_exact():
    """A drafter written against the protocol alone (loaded as the ``draft`` method's drafter):
    the engine's output equals plain decoding."""
    engine = make_engine(tiny_qwen2(3), proposers={"draft": RepeatPerSequence()})
    prompt = [5, 9, 14, 2]
    plain = engine.generate(prompt, SamplingParams(max_tokens=24), SpeculativeConfig(method="none"))
    spec = engine.generate(
        prompt, SamplingParams(max_tokens=24), SpeculativeConfig(method="draft", num_speculative_tokens=3)
    )
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.spec.num_draft_tokens > 0


def test_every_engine_gets_the_lookup_drafters_and_their_trees():
    drafters = with_lookup_drafters({"repeat": Repeat()})
    assert sorted(drafters) == ["ngram", "ngram-tree", "repeat", "suffix", "suffix-tree"]
    assert drafters["ngram-tree"].ngram is drafters["ngram"]
    assert drafters["suffix-tree"].suffix is drafters["suffix"]


def test_a_new_sequence_keeps_each_tree_over_its_own_chain():
    drafters = with_lookup_drafters({})
    fresh = for_new_sequence(drafters)
    assert isinstance(fresh["ngram"], NgramProposer) and fresh["ngram"] is not drafters["ngram"]
    assert isinstance(fresh["ngram-tree"], NgramTreeProposer) and fresh["ngram-tree"].ngram is fresh["ngram"]
    assert isinstance(fresh["suffix-tree"], SuffixTreeProposer) and fresh["suffix-tree"].suffix is fresh["suffix"]
    assert fresh["suffix"].cache is drafters["suffix"].cache  # one cache of past requests per engine


def test_an_own_suffix_cache_is_empty_and_leaves_the_other_drafters_shared():
    drafters = with_lookup_drafters({"repeat": Repeat()})
    drafters["suffix"].end_request([1, 2, 3], [4, 5, 6, 7])
    own = with_own_suffix_cache(drafters)
    assert isinstance(own["suffix"], SuffixProposer) and own["suffix"].cache is not drafters["suffix"].cache
    assert own["suffix"].cache.num_tokens == 0 < drafters["suffix"].cache.num_tokens
    assert own["suffix-tree"].suffix is own["suffix"]
    assert own["repeat"] is drafters["repeat"] and own["ngram"] is drafters["ngram"]
