"""One test per public bug class of speculative decoding engines (issue 29), on the int8 runner
(batched rows bit-identical to rows alone, nothing to compile) over the tiny torch pair:
penalties on draft rows, seeds under shared passes, drafter state leaking between sequences or
into the next request, and misconfigurations that would silently never draft. Every case compares
against plain decoding (``method="none"``) of the same request, token for token. The cases that
go through a live server (a client leaving mid-step, streamed deltas, refused speculation) are
tests/server/test_bug_classes_int8_server.py's."""

from __future__ import annotations

import pytest

from helpers import VOCAB, CharTokenizer, default_pieces, perturbed_copy, single_thread, tiny_qwen2
from server_support import bigram_qwen2, build_tokenizer, successor_table
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.loader import SpeculativePipeline
from verispec.engine.scheduler import Scheduler
from verispec.errors import IncompatibleDraftError, InvalidParameterError
from verispec.models.loading import LoadedModel
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.runners.cpu.int8 import Int8Runner

PIECES = CharTokenizer(default_pieces(VOCAB))
PLAIN = SpeculativeConfig(method="none")


@pytest.fixture(scope="module")
def pair():
    """The tiny target and a draft that agrees with it sometimes (torch modules)."""
    target = tiny_qwen2(0)
    return target, perturbed_copy(target, noise=0.2, seed=1)


def int8_engine(pair) -> SpeculativeEngine:
    """A fresh engine over the tiny pair on the int8 runner: ``draft`` chains, ``tree`` trees,
    the lookups built in."""
    target, draft = pair
    proposers = {
        "draft": DraftModelProposer(Int8Runner.from_module(draft, max_context_length=256)),
        "tree": DraftTreeProposer(Int8Runner.from_module(draft, max_context_length=256), branching=2, max_depth=4),
    }
    return SpeculativeEngine(
        Int8Runner.from_module(target, max_context_length=256), PIECES, eos_token_ids=(0,), proposers=proposers
    )


def constant(method: str, k: int = 4) -> SpeculativeConfig:
    """Fixed draft lengths: every step drafts ``k`` tokens (the cost schedule may not draft at all)."""
    return SpeculativeConfig(method=method, num_speculative_tokens=k, schedule="constant")


def run_batched(engine, requests, max_num_seqs=8):
    """Every request through one scheduler: (outputs in request order, largest batch seen)."""
    scheduler = Scheduler(engine, max_num_seqs=max_num_seqs)
    for i, r in enumerate(requests):
        scheduler.add(*r, tag=i)
    outputs, largest = [None] * len(requests), 0
    while scheduler.running or scheduler.waiting:
        for handle, chunk in scheduler.step():
            largest = max(largest, engine.last_pass_num_seqs)
            if chunk.output is not None:
                outputs[handle.tag] = chunk.output
    return outputs, largest


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def spec_counts(output) -> tuple:
    spec = output.metrics.spec
    return spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.chosen_k


# ----- 1. penalties on draft rows -----

REPEATING = [8, 9, 8, 9, 8, 9, 8, 9, 8]  # n-gram lookup drafts here; penalties decide what is accepted
# (prompt, method, penalties): positive and negative values of each penalty, each drafter
PENALTY_CASES = [
    (REPEATING, "draft", {"repetition_penalty": 1.5}),  # seen tokens pushed down, drafted ones included
    ([40] * 12, "ngram", {"presence_penalty": 0.1, "repetition_penalty": 1.05}),  # small: the output still loops
    (REPEATING, "ngram", {"repetition_penalty": 0.7}),  # below 1: seen tokens pulled up, drafts accepted more
    (REPEATING, "ngram", {"presence_penalty": -2.0}),  # negative: repeating output is rewarded
    (REPEATING, "draft", {"presence_penalty": 1.5}),
    ([5, 17, 33, 2, 9], "draft", {"frequency_penalty": 2.0}),  # grows with each repeat inside one draft
    ([5, 17, 33, 2, 9], "draft", {"frequency_penalty": -1.0, "repetition_penalty": 1.3}),  # mixed signs
    ([60, 61, 62], "tree", {"frequency_penalty": -2.0, "presence_penalty": 0.5}),  # every tree node's row
    ([40] * 12, "auto", {"repetition_penalty": 0.5, "frequency_penalty": 1.0}),
]


def penalty_requests():
    return [
        (prompt, SamplingParams(max_tokens=36, **penalties), constant(method))
        for prompt, method, penalties in PENALTY_CASES
    ]


def test_penalties_apply_to_draft_rows_as_to_plain_decoding_alone_and_batched(pair):
    engine = int8_engine(pair)
    requests = penalty_requests()
    plain = [engine.generate(prompt, params, PLAIN).token_ids for prompt, params, _ in requests]
    alone = [engine.generate(*r) for r in requests]
    assert tokens(alone) == plain
    batched, largest = run_batched(engine, requests, max_num_seqs=len(requests))
    assert tokens(batched) == plain and largest == len(requests)
    assert all(o.metrics.spec.num_draft_tokens > 0 for o in alone + batched)  # every request really drafted
    assert all(
        o.metrics.spec.num_accepted_tokens < o.metrics.spec.num_draft_tokens for o in alone[:2]
    )  # rejections too
    assert sum(o.metrics.spec.num_accepted_tokens for o in alone) > 0  # and some drafts were kept
    # the penalties really changed the output (else this would test nothing)
    unpenalised = [engine.generate(prompt, SamplingParams(max_tokens=36), PLAIN).token_ids for prompt, _, _ in requests]
    assert all(p != u for p, u in zip(plain, unpenalised))


# ----- 2. a request's seed under shared passes -----


def test_a_seeded_sampled_request_gives_its_alone_tokens_beside_other_requests(pair):
    engine = int8_engine(pair)
    mine = [  # (prompt, params, spec): seeded, sampled, fixed draft lengths, each per-request drafter
        ([5, 17, 33, 2, 9], SamplingParams(max_tokens=30, temperature=0.9, seed=7), constant("draft", 3)),
        ([8, 9, 8, 9, 8, 9, 8], SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=8), constant("ngram", 4)),
        ([60, 61, 62], SamplingParams(max_tokens=30, temperature=1.2, top_p=0.9, seed=9), constant("tree", 6)),
        (
            [11, 12, 13, 14],
            SamplingParams(max_tokens=30, temperature=0.8, seed=7, presence_penalty=0.5),
            constant("draft", 5),
        ),
    ]
    others = [  # what shares the passes: greedy, unseeded sampling, the same seed on another prompt, plain
        ([70, 3], SamplingParams(max_tokens=40), constant("draft", 2)),
        ([90, 4, 22, 4], SamplingParams(max_tokens=40, temperature=1.0), constant("ngram", 5)),
        ([5, 17, 33, 2, 9, 1], SamplingParams(max_tokens=40, temperature=0.9, seed=7), constant("draft", 3)),
        ([40] * 12, SamplingParams(max_tokens=40, temperature=0.5, seed=123), PLAIN),
    ]
    alone = tokens(engine.generate(*r) for r in mine)
    assert alone == tokens(engine.generate(*r) for r in mine)  # a seed fixes the tokens at all
    batched, largest = run_batched(engine, mine + others)
    assert tokens(batched[: len(mine)]) == alone and largest == len(mine) + len(others)
    reordered, _ = run_batched(engine, others[::-1] + mine[::-1])  # other neighbours, other rows of the pass
    assert tokens(reordered[len(others) :][::-1]) == alone
    unseeded = [(p, SamplingParams(max_tokens=30, temperature=0.9), s) for p, _, s in mine]
    assert tokens(engine.generate(*r) for r in unseeded) != alone  # sampling really varies without the seed


# ----- 3. drafter state of one sequence leaking into another -----

PROMPTS = [
    [5, 17, 33, 2, 9],
    [70, 3],
    [8, 9, 8, 9, 8, 9, 8],
    [40] * 12,
    [60, 61, 62],
    [90, 4, 22, 4, 90, 4],
    [1 + i % 50 for i in range(37)],
    [11, 12, 13, 14, 15, 16],
]


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "tree"])
def test_batched_sequences_each_draft_from_their_own_context(pair, method):
    engine = int8_engine(pair)
    requests = [
        (prompt, SamplingParams(max_tokens=32), constant(method, 2 + i % 4)) for i, prompt in enumerate(PROMPTS)
    ]
    plain = [engine.generate(prompt, params, PLAIN).token_ids for prompt, params, _ in requests]
    batched, largest = run_batched(engine, requests)
    assert tokens(batched) == plain and largest == len(PROMPTS)
    drafted = [o.metrics.spec.num_draft_tokens for o in batched]
    assert sum(d > 0 for d in drafted) >= (2 if method in ("ngram", "suffix") else len(PROMPTS)), drafted
    assert sum(o.metrics.spec.num_accepted_tokens for o in batched) > 0
    if method in ("ngram", "draft", "tree"):  # per-sequence drafters: each drafts as it would alone
        alone = [int8_engine(pair).generate(*r) for r in requests]
        assert [spec_counts(o) for o in batched] == [spec_counts(o) for o in alone]


# ----- 4. drafter state carried from one request to the next on one slot -----


@pytest.mark.parametrize("method", ["ngram", "draft", "suffix", "tree"])
def test_the_second_request_on_an_engine_equals_it_on_a_fresh_engine(pair, method):
    first = ([8, 9, 8, 9, 8, 9, 8, 9], SamplingParams(max_tokens=40), constant(method))  # leaves caches full
    second = ([40] * 12, SamplingParams(max_tokens=40), constant(method))
    used = int8_engine(pair)
    used.generate(*first)
    after = used.generate(*second)
    fresh = int8_engine(pair).generate(*second)
    plain = int8_engine(pair).generate(second[0], second[1], PLAIN)
    assert after.token_ids == fresh.token_ids == plain.token_ids
    assert fresh.metrics.spec.num_draft_tokens > 0
    if method in ("ngram", "draft", "tree"):  # per-request drafters: the same drafts as on a fresh engine
        assert spec_counts(after) == spec_counts(fresh)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_reused_scheduler_slot_drafts_as_a_fresh_one(pair, method):
    engine = int8_engine(pair)
    requests = [(prompt, SamplingParams(max_tokens=30), constant(method, 3)) for prompt in PROMPTS[:4]]
    one_slot, largest = run_batched(engine, requests, max_num_seqs=1)  # each request after the other on one slot
    assert largest == 1
    for request, output in zip(requests, one_slot):
        fresh = int8_engine(pair).generate(*request)
        assert output.token_ids == fresh.token_ids
        assert spec_counts(output) == spec_counts(fresh)


# ----- 5. misconfigurations: a clear verispec error, never a run that silently drafts nothing -----


def _draft_loaded(vocab_shrink: int = 0, other_merges: bool = False) -> LoadedModel:
    """The tiny server pair's draft, its logits ``vocab_shrink`` narrower or a token added to its tokenizer."""
    tokenizer = build_tokenizer()
    if other_merges:
        tokenizer.add_tokens(["zz-only-in-the-draft"])
    model = bigram_qwen2(tokenizer, successor_table(tokenizer, num_changed=2), seed=1)
    return LoadedModel(
        name="tiny-draft",
        model=model,
        tokenizer=tokenizer,
        path=None,
        load_time_s=0.0,
        param_bytes=0,
        eos_token_ids=(tokenizer.eos_token_id,),
        context_length=256,
        vocab_size=len(tokenizer) - vocab_shrink,
    )


def _target_loaded() -> LoadedModel:
    tokenizer = build_tokenizer()
    model = bigram_qwen2(tokenizer, successor_table(tokenizer), seed=0)
    return LoadedModel(
        name="tiny-target",
        model=model,
        tokenizer=tokenizer,
        path=None,
        load_time_s=0.0,
        param_bytes=0,
        eos_token_ids=(tokenizer.eos_token_id,),
        context_length=256,
        vocab_size=len(tokenizer),
    )


@pytest.mark.parametrize(
    "draft",
    [
        dict(vocab_shrink=5),  # the draft's logits cannot score the target's last tokens
        dict(other_merges=True),  # a token the target does not have
    ],
)
def test_a_draft_with_another_vocabulary_is_refused_at_load(draft):
    with pytest.raises(IncompatibleDraftError, match="draft"):
        SpeculativePipeline(_target_loaded(), _draft_loaded(**draft))


@pytest.mark.parametrize("method", ["draft", "layer-skip", "eagle"])
def test_a_method_whose_drafter_is_not_loaded_is_refused_before_it_runs(method):
    engine = SpeculativeEngine(
        Int8Runner.from_module(tiny_qwen2(0), max_context_length=256), PIECES, eos_token_ids=(0,)
    )
    spec = constant(method)
    with pytest.raises(InvalidParameterError, match=f"method '{method}' needs its drafter loaded"):
        engine.generate([5, 17, 33, 2, 9], SamplingParams(max_tokens=8), spec)
    with pytest.raises(InvalidParameterError, match="needs its drafter loaded"):
        Scheduler(engine).add([5, 17, 33, 2, 9], SamplingParams(max_tokens=8), spec)  # before it is queued


@pytest.mark.parametrize("k", [0, -1, 65, 1000])
def test_an_impossible_draft_length_is_refused(k):
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens must be in \\[1, 64\\]"):
        SpeculativeConfig(method="draft", num_speculative_tokens=k)


@pytest.mark.parametrize("draft_vocab", [64, 128])
def test_an_engine_refuses_a_draft_runner_of_another_vocabulary(draft_vocab):
    target = Int8Runner.from_module(tiny_qwen2(0), max_context_length=256)
    draft = DraftModelProposer(Int8Runner.from_module(tiny_qwen2(1, vocab_size=draft_vocab), max_context_length=256))
    with pytest.raises(IncompatibleDraftError, match=f"draft drafter's logits are {draft_vocab} wide, the target's 96"):
        SpeculativeEngine(target, PIECES, eos_token_ids=(0,), proposers={"draft": draft})  # before any request
