"""Continuous batching: one target pass over many sequences, and each request's output equal to
running it alone (greedy: token for token; sampled with a seed: the same tokens), on the gguf
and int8 runners (bit-identical rows whatever the batch) and on the torch runner (one sequence
after the other). Admission, the KV budget, chunked prefill and cancellation of the scheduler."""

import pytest
import torch

from batching_support import PIECES, PROMPTS, gguf_engine, run_batched
from gguf_models import VOCAB
from helpers import CharTokenizer, default_pieces, single_thread, tiny_qwen2
from helpers import perturbed_copy as perturbed_module
from verispec.algorithms.sampling import SamplingParams
from verispec.algorithms.tree import TokenTree, tree_attention_mask, tree_position_ids
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.scheduler import Scheduler
from verispec.errors import InvalidParameterError
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners import ForwardCall, Runner, forward_batch, prefill
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.torch_runner import TransformersRunner

# (method, max_tokens, stop, penalties): a mix of what requests ask for, one row per request
REQUESTS = [
    ("draft", 30, (), {}),
    ("none", 24, (), {}),
    ("ngram", 40, (), {"repetition_penalty": 1.3}),
    ("auto", 33, ("%",), {}),
    ("tree", 28, (), {}),
    ("draft", 12, (), {"presence_penalty": 0.5}),
    ("auto", 40, (), {"frequency_penalty": 0.4}),
    ("tree", 19, ("'",), {"repetition_penalty": 1.2}),
]


def request(i: int, seed: int | None = None, temperature: float = 0.0):
    method, max_tokens, stop, penalties = REQUESTS[i % len(REQUESTS)]
    params = SamplingParams(max_tokens=max_tokens, stop=stop, temperature=temperature, seed=seed, **penalties)
    return PROMPTS[i % len(PROMPTS)], params, SpeculativeConfig(method=method, num_speculative_tokens=1 + i % 5)


@pytest.mark.parametrize("num_requests", [1, 2, 3, 5, 8])
def test_gguf_greedy_batched_equals_alone(gguf_files, num_requests):
    engine = gguf_engine(gguf_files)
    requests = [request(i) for i in range(num_requests)]
    alone = [engine.generate(*r).token_ids for r in requests]
    batched, largest = run_batched(engine, requests)
    assert batched == alone
    assert largest == num_requests  # they really shared passes
    plain = [engine.generate(p, params, SpeculativeConfig(method="none")).token_ids for p, params, _ in requests]
    assert alone == plain  # and speculation changed nothing


def test_gguf_sampled_with_seed_batched_equals_alone(gguf_files):
    engine = gguf_engine(gguf_files)
    requests = []
    for i in range(6):
        prompt, params, _ = request(i, seed=100 + i, temperature=0.9)
        # a seed fixes the tokens for fixed draft lengths (the cost schedule's depend on measured times)
        requests.append(
            (prompt, params, SpeculativeConfig(method="draft", num_speculative_tokens=3, schedule="constant"))
        )
    alone = [engine.generate(*r).token_ids for r in requests]
    batched, _ = run_batched(engine, requests)
    assert batched == alone
    assert len({tuple(t) for t in alone}) == len(alone)  # the seeds really differ


def test_cancelling_one_request_leaves_the_others_unchanged(gguf_files):
    engine = gguf_engine(gguf_files)
    requests = [request(i) for i in range(5)]
    alone = [engine.generate(*r).token_ids for r in requests]
    batched, _ = run_batched(engine, requests, cancel_after=(2, 3))  # request 2 dropped after 3 passes
    assert batched[2] is None
    assert [b for i, b in enumerate(batched) if i != 2] == [a for i, a in enumerate(alone) if i != 2]


def test_chunked_prefill_of_a_long_prompt_beside_decoding_requests(gguf_files):
    engine = gguf_engine(gguf_files, max_num_batched_tokens=8)  # the 60-token prompt takes 8 passes
    long_prompt = [(7 * i + 3) % VOCAB for i in range(60)]
    requests = [request(0), request(1), (long_prompt, SamplingParams(max_tokens=20), SpeculativeConfig(method="auto"))]
    alone = [engine.generate(*r).token_ids for r in requests]
    batched, _ = run_batched(engine, requests)
    assert batched == alone


def test_int8_runner_greedy_batched_equals_alone():
    target = Int8Runner.from_module(tiny_qwen2(0), max_context_length=256)
    draft = Int8Runner.from_module(perturbed_module(tiny_qwen2(0), 0.2, seed=1), max_context_length=256)
    engine = SpeculativeEngine(
        target, CharTokenizer(default_pieces(96)), eos_token_ids=(), proposers={"draft": DraftModelProposer(draft)}
    )
    requests = [
        (PROMPTS[i], SamplingParams(max_tokens=25), SpeculativeConfig(method=("draft", "ngram", "none", "auto")[i % 4]))
        for i in range(8)
    ]
    alone = [engine.generate(*r).token_ids for r in requests]
    batched, largest = run_batched(engine, requests)
    assert batched == alone and largest == 8


def test_torch_runner_batches_one_sequence_after_the_other():
    model = tiny_qwen2(0)
    engine = SpeculativeEngine(
        TransformersRunner(model),
        CharTokenizer(default_pieces(96)),
        eos_token_ids=(),
        proposers={"draft": DraftModelProposer(TransformersRunner(perturbed_module(model, 0.2, seed=1)))},
    )
    requests = [
        (PROMPTS[i], SamplingParams(max_tokens=15), SpeculativeConfig(method="draft", num_speculative_tokens=3))
        for i in range(4)
    ]
    alone = [engine.generate(*r).token_ids for r in requests]
    batched, largest = run_batched(engine, requests)
    assert batched == alone and largest == 4


def test_forward_batch_rows_are_each_sequences_own_rows(gguf_files):
    base = GGUFRunner.from_file(gguf_files["target"], max_context_length=256)
    sequences = [base] + [base.new_sequence() for _ in range(3)]
    for seq, prompt in zip(sequences, PROMPTS):
        prefill(seq, prompt)
    tree = TokenTree((50, 1, 2, 3, 4), (-1, 0, 0, 1, 1))
    cached = sequences[3].num_cached_tokens
    calls = [
        ForwardCall(sequences[0], [4, 5, 6]),  # a chain
        ForwardCall(sequences[1], [7]),  # a plain step
        ForwardCall(sequences[2], list(range(20, 32)), num_logits=0),  # a prefill chunk: no rows
        ForwardCall(
            sequences[3], list(tree.token_ids), None, tree_position_ids(tree, cached), tree_attention_mask(tree, cached)
        ),
    ]
    batched = forward_batch(calls)
    assert [b.shape[0] for b in batched] == [3, 1, 0, 5]
    lengths = [s.num_cached_tokens for s in sequences]
    for seq, prompt in zip(sequences, PROMPTS):
        prefill(seq, prompt)
    alone = forward_batch(calls[:1]) + forward_batch(calls[1:2]) + forward_batch(calls[2:3]) + forward_batch(calls[3:])
    assert all(torch.equal(a, b) for a, b in zip(alone, batched))
    assert [s.num_cached_tokens for s in sequences] == lengths


def test_forward_batch_refuses_a_sequence_twice_and_leaves_caches_alone(gguf_files):
    r = GGUFRunner.from_file(gguf_files["target"], max_context_length=32)
    other = r.new_sequence()
    with pytest.raises(ValueError, match="twice"):
        forward_batch([ForwardCall(r, [1]), ForwardCall(r, [2])])
    with pytest.raises(ValueError, match="context length"):
        forward_batch([ForwardCall(other, [1, 2]), ForwardCall(r, list(range(40)))])
    assert r.num_cached_tokens == other.num_cached_tokens == 0  # checked before anything ran


def test_kv_budget_makes_the_queue_wait_first_come_first_served(gguf_files):
    engine = gguf_engine(gguf_files)
    scheduler = Scheduler(engine, max_num_seqs=4, max_kv_tokens=256)
    params = SamplingParams(max_tokens=100)
    first = scheduler.add(PROMPTS[0], params, SpeculativeConfig(method="none"))  # reserves 5 + 100 + 6
    second = scheduler.add(PROMPTS[1], params, SpeculativeConfig(method="none"))  # 108: fits beside the first
    third = scheduler.add(PROMPTS[2], params, SpeculativeConfig(method="none"))  # 116: must wait
    fourth = scheduler.add(
        PROMPTS[1], SamplingParams(max_tokens=2), SpeculativeConfig(method="none")
    )  # small, behind it
    scheduler.step()
    assert [first.running, second.running, third.running, fourth.running] == [True, True, False, False]
    assert scheduler.reserved_kv_tokens == first.kv_tokens + second.kv_tokens <= 256
    while first.running or second.running:
        scheduler.step()
    scheduler.step()
    assert third.running and fourth.running  # admitted in order once the budget freed


def test_scheduler_refuses_impossible_settings(gguf_files):
    engine = gguf_engine(gguf_files)
    with pytest.raises(InvalidParameterError, match="max_num_seqs"):
        Scheduler(engine, max_num_seqs=0)
    with pytest.raises(InvalidParameterError, match="context window"):
        Scheduler(engine, max_kv_tokens=100)
    scheduler = Scheduler(engine)
    with pytest.raises(InvalidParameterError, match="empty"):
        scheduler.add([], SamplingParams(), SpeculativeConfig())
    assert not scheduler.waiting


class OneSequenceRunner(Runner):
    """A runner without new_sequence (llama.cpp's holds one context)."""

    vocab_size, max_context_length, num_cached_tokens = VOCAB, 64, 0


def test_an_engine_that_cannot_batch_says_so():
    engine = SpeculativeEngine(OneSequenceRunner(), PIECES, eos_token_ids=())
    assert not engine.supports_batching
    with pytest.raises(InvalidParameterError, match="one sequence"):
        Scheduler(engine, max_num_seqs=2)
    assert Scheduler(engine, max_num_seqs=1).max_num_seqs == 1


def test_batched_drafts_equal_each_requests_own_drafts(gguf_files):
    from verispec.proposers import DraftRequest
    from verispec.proposers.draft_model import propose_batch

    base = DraftModelProposer(GGUFRunner.from_file(gguf_files["draft"], max_context_length=256))
    # (prompt, output so far, temperature, draft_stop_threshold, k): greedy, sampled, an early stop, no room
    cases = [
        (PROMPTS[0], [3, 4], 0.0, 0.0, 5),
        (PROMPTS[2], [], 0.8, 0.0, 4),
        (PROMPTS[6], [9], 0.0, 0.9, 6),
        (PROMPTS[1], [], 1.0, 0.0, 1),
        ([5] * 255, [], 0.0, 0.0, 3),
    ]

    def requests():
        return [
            DraftRequest(p, o, SamplingParams(temperature=t, seed=1), torch.Generator().manual_seed(7 + i), thr)
            for i, (p, o, t, thr, _) in enumerate(cases)
        ]

    alone = [base.new_sequence().propose(r, c[4]) for r, c in zip(requests(), cases)]
    batched = propose_batch([(base.new_sequence(), r, c[4]) for r, c in zip(requests(), cases)])
    assert [d.draft_token_ids for d in batched] == [d.draft_token_ids for d in alone]
    assert [len(d.draft_token_ids) for d in batched][-1] == 1  # one position of room left
    assert all((a.draft_probs is None) == (b.draft_probs is None) for a, b in zip(alone, batched))
    assert all(torch.equal(a.draft_probs, b.draft_probs) for a, b in zip(alone, batched) if a.draft_probs is not None)


def test_a_request_the_engine_cannot_start_fails_alone(gguf_files):
    engine = gguf_engine(gguf_files)
    start = engine.start

    def picky(prompt, params, spec, slot):
        if prompt == PROMPTS[1]:
            raise RuntimeError("cannot start this one")
        return start(prompt, params, spec, slot)

    engine.start = picky
    scheduler = Scheduler(engine, max_num_seqs=4)
    handles = [
        scheduler.add(PROMPTS[i], SamplingParams(max_tokens=6), SpeculativeConfig(method="draft"), tag=i)
        for i in range(3)
    ]
    done = {}
    while scheduler.running or scheduler.waiting:
        for handle, chunk in scheduler.step():
            if chunk.output is not None:
                done[handle.tag] = chunk.output.token_ids
    assert [(r.tag, str(e)) for r, e in scheduler.failed] == [(1, "cannot start this one")]
    assert sorted(done) == [0, 2] and handles[1].done and scheduler.num_free_seqs == 4
