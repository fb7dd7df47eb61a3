"""N-gram (prompt lookup) drafting: matching table, incremental index, exactness, distribution."""

import random
import time

import pytest
import torch

from helpers import BigramRunner, CharTokenizer, chain_table, make_engine, sequence_distribution, single_thread
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.errors import InvalidParameterError
from verispec.proposers import DraftRequest
from verispec.proposers.ngram import NgramIndex, NgramProposer, copy_continuation, find_ngram_match


@pytest.mark.parametrize(
    "context, min_n, max_n, expected",
    [
        ([1, 2, 3, 4], 1, 3, None),  # no token repeats: no match
        ([], 1, 3, None),  # empty context
        ([7], 1, 3, None),  # the suffix itself never counts as an earlier occurrence
        ([5, 9, 5], 1, 3, (1, 1)),  # [5] occurred at 0, continuation starts at 1
        ([5, 9, 5], 2, 3, None),  # ... but no 2-gram repeats
        ([1, 2, 3, 1, 2], 1, 3, (2, 2)),  # longest n wins: [1, 2] (not just [2])
        ([4, 1, 2, 3, 4, 1, 2, 9, 4, 1, 2], 1, 3, (3, 7)),  # most recent occurrence wins (7, not 4)
        ([8, 8, 8, 8], 1, 3, (3, 3)),  # overlapping match: [8, 8, 8] ending at position 3
        ([3, 4, 3, 4], 1, 4, (2, 2)),  # [3, 4] at 0..1; n=3 ([4, 3, 4]) never occurred before
        ([1, 2, 6, 1, 2], 3, 4, None),  # a match shorter than min_ngram is no match
        ([6, 1, 2, 5, 1, 2], 1, 2, (2, 3)),  # match right before the suffix's first token
    ],
)
def test_find_ngram_match(context, min_n, max_n, expected):
    assert find_ngram_match(context, min_n, max_n) == expected


@pytest.mark.parametrize(
    "context, start, num_tokens, expected",
    [
        ([1, 2, 3, 9, 1, 2], 2, 3, [3, 9, 1]),  # plain copy inside the context
        ([1, 2, 1, 2], 2, 5, [1, 2, 1, 2, 1]),  # period 2: the copy reads its own output
        ([8, 8, 8], 2, 4, [8, 8, 8, 8]),  # period 1
        ([1, 2, 3], 1, 0, []),  # nothing asked
    ],
)
def test_copy_continuation(context, start, num_tokens, expected):
    assert copy_continuation(context, start, num_tokens) == expected


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_incremental_index_agrees_with_reference(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(20):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        index = NgramIndex(min_n, max_n)
        for i, token in enumerate(context):  # grown one token at a time, checked at every length
            index.extend([token])
            assert index.match() == find_ngram_match(context[: i + 1], min_n, max_n)


def request(prompt, output=()):
    return DraftRequest(list(prompt), list(output), SamplingParams(), torch.Generator())


def test_proposer_follows_the_request_and_starts_over_for_a_new_one():
    proposer = NgramProposer(min_ngram=1, max_ngram=3)
    assert proposer.propose(request([1, 2, 3, 1, 2]), 4).draft_token_ids == [3, 1, 2, 3]
    # the same request two tokens later: only the new tokens are indexed
    assert proposer.propose(request([1, 2, 3, 1, 2], [3, 7]), 2).draft_token_ids == []
    assert proposer.propose(request([1, 2, 3, 1, 2], [3, 7, 1]), 2).draft_token_ids == [2, 3]
    # a different request: the index of the old context must not leak into it
    assert proposer.propose(request([9, 7]), 3).draft_token_ids == []
    assert proposer.propose(request([9, 7, 9]), 3).draft_token_ids == [7, 9, 7]
    assert proposer.propose(request([9, 7, 9]), 0).draft_token_ids == []


def test_bad_ngram_range_is_refused():
    with pytest.raises(InvalidParameterError):
        NgramProposer(min_ngram=3, max_ngram=2)


def test_long_context_is_not_rescanned():
    """50,000 context tokens: each step costs O(max_ngram), not O(context)."""
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(50_000)]
    proposer = NgramProposer(min_ngram=2, max_ngram=4)
    proposer.propose(request(prompt), 8)  # builds the index once
    output: list[int] = []
    start = time.perf_counter()
    for _ in range(200):
        output.append(rng.randrange(1000))
        proposer.propose(request(prompt, output), 8)
    per_step_ms = (time.perf_counter() - start) / 200 * 1e3
    assert per_step_ms < 5, per_step_ms  # a rescan of 50k tokens with 3 n-gram sizes takes ~100 ms


# Token-id prompts for the tiny models. "serving " repeated 48 times, one id per character.
SERVING = [ord(c) % 96 for c in "serving " * 48]
REPEATS = [5, 17, 33, 2, 9, 5, 17, 33, 2, 9, 5, 17]
NO_REPEATS = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
GREEDY_32 = SamplingParams(max_tokens=32)


@pytest.fixture(scope="module")
def plain_outputs(target_model):
    engine = make_engine(target_model, max_context_length=512)
    return {
        name: engine.generate(prompt, GREEDY_32, SpeculativeConfig(method="none")).token_ids
        for name, prompt in (("serving", SERVING), ("repeats", REPEATS), ("none", NO_REPEATS))
    }


@pytest.mark.parametrize("k", range(1, 9))
def test_ngram_greedy_equals_plain(k, target_model, plain_outputs):
    engine = make_engine(target_model, max_context_length=512)
    for name, prompt in (("serving", SERVING), ("repeats", REPEATS), ("none", NO_REPEATS)):
        out = engine.generate(prompt, GREEDY_32, SpeculativeConfig(method="ngram", num_speculative_tokens=k))
        assert out.token_ids == plain_outputs[name], name
        if name == "serving":  # the random model's own output repeats too: drafts were made
            assert out.metrics.spec.num_drafts > 0


def test_ngram_on_a_cycle_is_always_accepted():
    """A target that cycles 1 -> 2 -> 3 -> 1: once the cycle is in the context, every draft is right."""
    engine = SpeculativeEngine(
        BigramRunner(chain_table({1: 2, 2: 3, 3: 1}, 4)), CharTokenizer("abcd"), eos_token_ids=[]
    )
    out = engine.generate(
        [1, 2, 3, 1], SamplingParams(max_tokens=25), SpeculativeConfig(method="ngram", num_speculative_tokens=8)
    )
    assert out.token_ids == ([2, 3, 1] * 9)[:25]
    spec = out.metrics.spec
    assert spec.acceptance_rate == 1.0 and spec.num_drafts == 3  # 1 + 3 x (8 accepted + 1 bonus) = 28 >= 25
    assert spec.per_drafter["ngram"].num_accepted_tokens == spec.num_accepted_tokens
    assert out.token_sources[0] == "target" and out.token_sources[1:9] == ["ngram"] * 8


def test_ngram_sampling_follows_target_distribution():
    """20,000 three-token samples with one-hot n-gram drafts: accept x with target_probs[x].

    top-k 3 makes the target put zero mass on some drafted tokens (always rejected) and the
    residual of a one-hot draft is the target with the drafted token removed.
    """
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=3)
    target_table = torch.tensor(
        [[0.0, 1.0, 2.0, 0.5], [2.0, 0.0, 1.0, 1.5], [1.0, 1.0, 0.0, 2.0], [0.0, 2.0, 1.0, 0.0]]
    )
    engine = SpeculativeEngine(
        BigramRunner(target_table), CharTokenizer("abcd"), eos_token_ids=[], proposers={"ngram": NgramProposer(1, 3)}
    )
    prompt = [0, 1, 2, 3, 0, 2, 1, 0]  # every token occurs: 1-gram lookups match from the first step on
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    counts: dict = {}
    num_draws = 20000
    accepted = drafted = 0
    for seed in range(num_draws):
        out = engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}), spec)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        accepted += out.metrics.spec.num_accepted_tokens
        drafted += out.metrics.spec.num_draft_tokens
    exact = sequence_distribution(target_table, params, first=prompt[-1], length=3)
    tv = 0.5 * sum(abs(counts.get(seq, 0) / num_draws - p) for seq, p in exact.items())
    assert tv < 0.04, tv  # 64 outcomes, 20,000 draws: sampling noise alone gives about 0.02
    assert 0.1 < accepted / drafted < 0.9  # drafts were made, and both accepted and rejected
