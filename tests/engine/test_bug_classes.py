"""One test (or a table of them) per kind of speculative-decoding bug that users of vLLM, SGLang,
llama.cpp and TensorRT-LLM reported in 2025-26 (issue 29), on the engine and its scheduler:
penalties on draft rows, seeds under batching, drafter state leaking between sequences or
surviving into the next request on a slot. Misconfigurations that would silently never draft
are ``test_bug_classes_refusals.py``'s; the server's side (seeds over HTTP, clients that leave,
streamed deltas, load-time refusals) is in ``test_bug_classes_server.py``.

Tiny torch models (the torch runner batches one sequence after the other, so a request's rows
are its rows alone); every speculative run uses the constant schedule, so its draft lengths,
and with them its draft statistics and a seeded request's random draws, do not depend on
measured times.
"""

from __future__ import annotations

import pytest

from bug_classes_support import PLAIN, PROMPTS, make_engine, spec
from helpers import perturbed_copy, single_thread
from verispec.algorithms.sampling import SamplingParams
from verispec.engine.scheduler import Scheduler
from verispec.errors import InvalidParameterError
from verispec.proposers.ngram import NgramProposer, copy_continuation, find_ngram_match

METHODS = ["draft", "tree", "ngram", "suffix", "layer-skip"]  # every drafter kind of the engine
# positive and negative values of each penalty (repetition: > 1 discourages, < 1 encourages)
PENALTIES = [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7},
    {"presence_penalty": 1.5},
    {"presence_penalty": -1.5},
    {"frequency_penalty": 0.8},
    {"frequency_penalty": -0.8},
    {"repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 0.6},  # all three at once
]


def draft_counts(output) -> dict:
    """What a request's drafting did, without its timings: per drafter and per position."""
    stats = output.metrics.spec
    return {
        "per_drafter": {
            name: (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) for name, d in stats.per_drafter.items()
        },
        "accepted_per_position": stats.accepted_per_position,
        "drafted_per_position": stats.drafted_per_position,
        "chosen_k": stats.chosen_k,
        "token_sources": output.token_sources,
    }


def run_scheduler(engine, requests, max_num_seqs=4, cancel=None):
    """Every ``(prompt, params, spec)`` through one scheduler; returns the outputs (None for a
    request cancelled by ``cancel = (index, after so many passes)``) and the largest batch."""
    scheduler = Scheduler(engine, max_num_seqs=max_num_seqs)
    handles = [scheduler.add(*r, tag=i) for i, r in enumerate(requests)]
    outputs, largest, passes = [None] * len(requests), 0, 0
    while scheduler.running or scheduler.waiting:
        largest = max(largest, len(scheduler.running))
        for handle, chunk in scheduler.step():
            if chunk.output is not None:
                outputs[handle.tag] = chunk.output
        passes += 1
        if cancel is not None and passes == cancel[1]:
            scheduler.cancel(handles[cancel[0]])
    assert scheduler.reserved_kv_tokens == 0 and scheduler.num_free_seqs == max_num_seqs  # nothing held
    return outputs, largest


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, noise=0.3, seed=2)  # agrees sometimes: some drafts accepted, some rejected


# ----- 1. penalties: draft rows scored as plain decoding scores them -----


@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: ",".join(f"{k.split('_')[0]}={v}" for k, v in p.items()))
def test_penalties_give_plain_decodings_tokens_with_every_drafter(target, draft, penalties):
    engine = make_engine(target, draft)
    params = SamplingParams(max_tokens=40, **penalties)
    changed = 0
    for prompt in PROMPTS[:2]:
        plain = engine.generate(prompt, params, PLAIN).token_ids
        changed += plain != engine.generate(prompt, SamplingParams(max_tokens=40), PLAIN).token_ids
        for method in METHODS:
            got = engine.generate(prompt, params, spec(method))
            assert got.token_ids == plain, (method, prompt)
            if method in ("draft", "layer-skip"):  # model drafters draft every step
                assert got.metrics.spec.num_draft_tokens > 0
    assert changed  # the penalty changed what plain decoding gives


@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: ",".join(f"{k.split('_')[0]}={v}" for k, v in p.items()))
def test_a_draft_that_is_the_target_has_every_token_accepted_under_penalties(target, penalties):
    # the draft's rows must see the same penalties, over the same history (prompt, output and
    # the draft's own earlier tokens), as the target's rows; one wrong row rejects its token
    engine = make_engine(target, target)
    for prompt in PROMPTS[:3]:
        got = engine.generate(prompt, SamplingParams(max_tokens=30, **penalties), spec("draft"))
        stats = got.metrics.spec
        assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens == stats.num_draft_tokens, prompt


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 0.0},  # CTRL's penalty divides a seen token's logit: 0 has no meaning
        {"repetition_penalty": -1.3},  # nor has a negative one (below 1 already encourages repeats)
        {"presence_penalty": -2.5},  # OpenAI's range is [-2, 2]
        {"frequency_penalty": 2.5},
    ],
)
def test_penalties_outside_their_range_are_refused(penalties):
    with pytest.raises(InvalidParameterError, match=next(iter(penalties))):
        SamplingParams(**penalties)


def test_penalties_under_the_scheduler_beside_other_requests(target, draft):
    engine = make_engine(target, draft)
    requests = [
        (
            PROMPTS[i % len(PROMPTS)],
            SamplingParams(max_tokens=24, **PENALTIES[i]),
            spec(METHODS[i % len(METHODS)], 1 + i % 4),
        )
        for i in range(len(PENALTIES))
    ]
    alone = [make_engine(target, draft).generate(*r) for r in requests]
    batched, largest = run_scheduler(engine, requests)
    assert largest == 4  # they shared passes
    assert [b.token_ids for b in batched] == [engine.generate(p, params, PLAIN).token_ids for p, params, _ in requests]
    assert [draft_counts(b) for b in batched] == [draft_counts(a) for a in alone]  # the draft rows too


# ----- 2. a seed holds whatever shares the request's passes -----


def test_a_seeded_sampled_request_gives_the_same_tokens_alone_and_batched(target, draft):
    seeded = [
        (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.9, seed=11), spec("draft", 3)),
        (
            PROMPTS[1],
            SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=12, presence_penalty=0.5),
            spec("tree", 4),
        ),
        (PROMPTS[3], SamplingParams(max_tokens=30, temperature=1.1, top_p=0.9, seed=13), spec("ngram", 3)),
    ]
    others = [
        (PROMPTS[2], SamplingParams(max_tokens=40), spec("draft", 5)),  # greedy
        (PROMPTS[4], SamplingParams(max_tokens=12, temperature=1.0), spec("layer-skip", 2)),  # unseeded
        (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.9, seed=99), spec("draft", 3)),
    ]  # the first, another seed
    alone = [make_engine(target, draft).generate(*r).token_ids for r in seeded]
    assert alone == [make_engine(target, draft).generate(*r).token_ids for r in seeded]  # a seed is reproducible
    engine = make_engine(target, draft)
    for batch in (seeded + others, others[:2] + seeded[::-1] + others[2:]):  # two orders, two batch mixes
        batched, largest = run_scheduler(engine, batch)
        assert largest == 4
        assert [batched[batch.index(r)].token_ids for r in seeded] == alone
        assert batched[batch.index(others[2])].token_ids != alone[0]  # the seed decides the tokens


# ----- 3. one sequence's drafter state never reaches another's -----


class RecordingNgram(NgramProposer):
    """N-gram lookup that notes every proposal: (the request's prompt, its context, k, the draft)."""

    def __init__(self, log: list) -> None:
        super().__init__(2, 4)
        self.log = log

    def new_sequence(self) -> RecordingNgram:
        return RecordingNgram(self.log)

    def propose(self, request, num_speculative_tokens):
        draft = super().propose(request, num_speculative_tokens)
        self.log.append(
            (tuple(request.prompt_token_ids), request.context, num_speculative_tokens, draft.draft_token_ids)
        )
        return draft


def test_concurrent_ngram_drafts_come_from_each_requests_own_context(target, draft):
    log: list = []
    engine = make_engine(target, draft, ngram=RecordingNgram(log))
    # both prompts repeat themselves (so lookup drafts) and share the n-gram (8, 9) with other continuations
    requests = [
        ([8, 9, 8, 9, 8, 9, 8], SamplingParams(max_tokens=40), spec("ngram")),
        ([40, 8, 9, 41, 8, 9, 41, 8], SamplingParams(max_tokens=40), spec("ngram")),
    ]
    batched, largest = run_scheduler(engine, requests, max_num_seqs=2)
    assert largest == 2
    assert [b.token_ids for b in batched] == [engine.generate(p, params, PLAIN).token_ids for p, params, _ in requests]
    for prompt, context, k, drafted in log:
        assert context[: len(prompt)] == list(prompt)
        match = find_ngram_match(context, 2, 4)
        assert drafted == (copy_continuation(context, match[1], k) if match else []), (prompt, context)
    for prompt, _, _ in requests:
        assert any(drafted for p, _, _, drafted in log if p == tuple(prompt))  # each request drafted


def test_batched_drafters_keep_their_own_state_per_sequence(target, draft):
    engine = make_engine(target, draft)
    # two requests per drafter in one batch; a shared draft cache or lookup index would change
    # what each drafted (its counts), never its tokens (the target verifies)
    requests = [
        (PROMPTS[(i + j) % len(PROMPTS)], SamplingParams(max_tokens=28), spec(method, 3))
        for i, method in enumerate(["draft", "tree", "layer-skip", "ngram"])
        for j in (0, 2)
    ]
    alone = [make_engine(target, draft).generate(*r) for r in requests]
    batched, largest = run_scheduler(engine, requests, max_num_seqs=8)
    assert largest == 8
    assert [b.token_ids for b in batched] == [engine.generate(p, params, PLAIN).token_ids for p, params, _ in requests]
    assert [draft_counts(b) for b in batched] == [draft_counts(a) for a in alone]
    suffix = [
        (p, SamplingParams(max_tokens=28), spec("suffix", 3)) for p in PROMPTS[:4]
    ]  # one cache for all, by design
    batched, _ = run_scheduler(make_engine(target, draft), suffix)
    assert [b.token_ids for b in batched] == [engine.generate(p, params, PLAIN).token_ids for p, params, _ in suffix]


# ----- 4. the next request on a slot starts from a clean drafter -----


@pytest.mark.parametrize("method", METHODS)
def test_a_request_after_a_cancelled_one_on_the_same_slot_equals_a_fresh_engine(target, draft, method):
    params = SamplingParams(max_tokens=30)
    first = (
        PROMPTS[1],
        SamplingParams(max_tokens=60, presence_penalty=-1.0),
        spec(method, 5),
    )  # cancelled after 4 passes
    # the second shares the first's first three tokens, so a stale draft cache would look reusable
    second = (PROMPTS[1][:3] + [70, 71, 70, 71], params, spec(method))
    fresh = make_engine(target, draft).generate(*second)
    engine = make_engine(target, draft)
    outputs, _ = run_scheduler(engine, [first, second], max_num_seqs=1, cancel=(0, 4))
    assert outputs[0] is None
    assert outputs[1].token_ids == fresh.token_ids == engine.generate(second[0], params, PLAIN).token_ids
    assert draft_counts(outputs[1]) == draft_counts(fresh)
    assert sum(fresh.metrics.spec.drafted_per_position) > 0  # it drafted


def test_a_request_after_a_finished_one_on_the_same_slot_equals_a_fresh_engine(target, draft):
    # the second request's prompt is the first's context (prompt + part of its output): the
    # drafters' cached prefixes are valid for it, and must be used only as far as they are
    params = SamplingParams(max_tokens=20)
    for method in ["draft", "tree", "ngram", "layer-skip"]:
        engine = make_engine(target, draft)
        first = engine.generate(PROMPTS[3], params, spec(method), learn=False)
        second = PROMPTS[3] + first.token_ids[:7]
        got = engine.generate(second, params, spec(method))
        fresh = make_engine(target, draft).generate(second, params, spec(method))
        assert got.token_ids == fresh.token_ids == engine.generate(second, params, PLAIN).token_ids
        assert draft_counts(got) == draft_counts(fresh), method
