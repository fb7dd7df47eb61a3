"""Suffix drafting: the shared cache (lookup, eviction, concurrency), proposals, exactness
against plain decoding (chains and trees, alone and batched), the sampling distribution, the cache
file. The corpus datastore is tests/proposers/test_datastore.py's."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from batching_support import PROMPTS, gguf_engine, run_batched
from helpers import BigramRunner, CharTokenizer, cycle_engine, sequence_distribution, single_thread
from helpers import draft_request as request
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.errors import InvalidParameterError
from verispec.proposers.suffix import SuffixCache, SuffixProposer, most_frequent_path


def test_cache_finds_the_longest_tail_and_what_followed_each_occurrence():
    cache = SuffixCache(min_ngram=2, max_ngram=4)
    cache.add([1, 2, 3, 4, 5, 6])
    cache.add([9, 2, 3, 4, 7, 8])
    cache.add([3, 4, 5, 0])
    assert cache.continuations([8, 2, 3, 4], 3) == (3, [[7, 8], [5, 6]])  # "2 3 4": newest first
    assert cache.continuations([0, 3, 4], 2) == (2, [[5, 0], [7, 8], [5, 6]])
    assert cache.continuations([5, 5], 2) == (0, [])


def test_cache_evicts_the_oldest_requests_and_bounds_its_index():
    cache = SuffixCache(max_tokens=20, min_ngram=2, max_ngram=3)
    for i in range(50):
        cache.add([100 + i, 1, 2, 3, 200 + i])
    assert cache.num_tokens <= 20 and cache.num_sequences == 4
    n, found = cache.continuations([1, 2, 3], 1)
    assert n == 3 and found == [[249], [248], [247], [246]]  # only kept requests, newest first
    assert cache.index_size <= 20 * 2  # evicted entries leave with their requests
    with pytest.raises(InvalidParameterError):
        SuffixCache(max_tokens=0)


def test_cache_is_safe_to_share_between_threads():
    cache = SuffixCache(max_tokens=5000)
    errors = []

    def writer(seed):
        try:
            for i in range(200):
                cache.add([seed, i % 7, (i + 1) % 7, (i + 2) % 7, seed])
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    def reader():
        try:
            for i in range(400):
                n, found = cache.continuations([i % 7, (i + 1) % 7], 2)
                assert n == 0 or all(len(c) <= 2 for c in found)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(s,)) for s in (50, 60)] + [
        threading.Thread(target=reader) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and cache.num_sequences == 400 and cache.num_tokens == 2000


def test_most_frequent_path_follows_the_majority():
    assert most_frequent_path([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 4]], 3) == [1, 2, 4]
    assert most_frequent_path([[7], [8]], 3) == [7]  # tie: the most recent occurrence
    assert most_frequent_path([], 3) == []


def test_proposals_use_earlier_requests_and_grow_with_the_match():
    proposer = SuffixProposer(SuffixCache(min_ngram=2, max_ngram=8), spec_factor=1.0)
    proposer.end_request([50, 51], [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert proposer.propose(request([40, 2, 3]), 8).draft_token_ids == [4, 5]  # 2-token match: 2 tokens
    assert proposer.propose(request([1, 2, 3, 4]), 8).draft_token_ids == [5, 6, 7, 8]
    other = proposer.new_sequence()
    assert other.cache is proposer.cache and other.propose(request([3, 4, 5]), 2).draft_token_ids == [6, 7]
    # the request's own context wins a tie: 2 3 was followed by 9 earlier in this prompt
    assert proposer.propose(request([2, 3, 9, 0, 2, 3]), 1).draft_token_ids == [9]
    tree = proposer.propose_tree(request([0, 1, 2]), 4)
    assert tree.token_ids[1:3] == (3, 4)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_suffix_equals_plain_and_warms_across_requests(tree, k):
    engine = cycle_engine(tree=tree)
    params = SamplingParams(max_tokens=30)
    plain = engine.generate([6, 7], params, SpeculativeConfig(method="none")).token_ids
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=k, schedule="constant")
    first = engine.generate([6, 7], params, spec)
    second = engine.generate([6, 7], params, spec)  # a returning user: the cache holds the first answer
    assert first.token_ids == plain and second.token_ids == plain
    drafter = "suffix-tree" if tree else "suffix"
    assert (
        second.metrics.spec.per_drafter[drafter].num_accepted_tokens
        >= first.metrics.spec.per_drafter[drafter].num_accepted_tokens
    )
    assert second.metrics.spec.num_accepted_tokens > 0


def test_auto_drafts_from_earlier_requests():
    """``auto``'s lookup drafter is the engine's suffix drafter: a returning user is drafted from the first answer."""
    params = SamplingParams(max_tokens=30)
    plain = cycle_engine().generate([6, 7], params, SpeculativeConfig(method="none")).token_ids
    engine = cycle_engine()  # the same models, an empty cache
    spec = SpeculativeConfig(method="auto", num_speculative_tokens=8, schedule="constant")
    first = engine.generate([6, 7], params, spec)
    second = engine.generate([6, 7], params, spec)
    assert first.token_ids == plain and second.token_ids == plain
    assert set(second.metrics.spec.per_drafter) == {"suffix"}
    assert (
        second.metrics.spec.per_drafter["suffix"].num_accepted_tokens
        > first.metrics.spec.per_drafter["suffix"].num_accepted_tokens
    )


def test_a_drafter_loaded_under_two_names_learns_each_answer_once():
    suffix = SuffixProposer()
    engine = cycle_engine({"suffix": suffix, "ngram": suffix})  # auto drafts with it, method ngram too
    out = engine.generate(
        [6, 7],
        SamplingParams(max_tokens=12),
        SpeculativeConfig(method="auto", num_speculative_tokens=4, schedule="constant"),
    )
    assert suffix.cache.num_sequences == 1 and suffix.cache.num_tokens == len(out.token_ids)


def test_suffix_batched_equals_alone(gguf_files):
    engine = gguf_engine(gguf_files)
    warm = SamplingParams(max_tokens=20)
    for prompt in PROMPTS:
        engine.generate(prompt, warm, SpeculativeConfig(method="none"))  # the cache learns the answers
    requests = [
        (
            prompt,
            SamplingParams(max_tokens=20),
            SpeculativeConfig(method="suffix", num_speculative_tokens=1 + i % 6, schedule="constant"),
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    alone = [
        engine.generate(prompt, SamplingParams(max_tokens=20), SpeculativeConfig(method="none")).token_ids
        for prompt in PROMPTS
    ]
    batched, largest = run_batched(engine, requests)
    assert batched == alone and largest > 1


def test_suffix_sampling_follows_target_distribution():
    """20,000 three-token samples with suffix drafts warmed by earlier outputs."""
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=3)
    target_table = torch.tensor(
        [[0.0, 1.0, 2.0, 0.5], [2.0, 0.0, 1.0, 1.5], [1.0, 1.0, 0.0, 2.0], [0.0, 2.0, 1.0, 0.0]]
    )
    proposer = SuffixProposer(SuffixCache(min_ngram=1, max_ngram=3), min_ngram=1, max_ngram=3)
    engine = SpeculativeEngine(
        BigramRunner(target_table), CharTokenizer("abcd"), eos_token_ids=[], proposers={"suffix": proposer}
    )
    proposer.end_request([], [0, 1, 2, 3, 0, 2, 1, 0, 3, 3, 1])
    prompt = [2, 0]
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=4, schedule="constant")
    counts, accepted, drafted = {}, 0, 0
    for seed in range(20000):
        out = engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}), spec)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        accepted += out.metrics.spec.num_accepted_tokens
        drafted += out.metrics.spec.num_draft_tokens
    exact = sequence_distribution(target_table, params, first=prompt[-1], length=3)
    tv = 0.5 * sum(abs(counts.get(seq, 0) / 20000 - p) for seq, p in exact.items())
    assert tv < 0.04, tv
    assert 0.1 < accepted / drafted < 0.9


def test_cache_persists_and_refuses_a_bad_file(tmp_path):
    cache = SuffixCache(min_ngram=2, max_ngram=4)
    cache.add([1, 2, 3, 4, 5])
    cache.add([7, 2, 3, 9])
    path = tmp_path / "suffix.npz"
    cache.save(path)
    again = SuffixCache(min_ngram=2, max_ngram=4)
    assert again.load(path) == 2 and again.sequences() == [[1, 2, 3, 4, 5], [7, 2, 3, 9]]
    assert again.continuations([2, 3], 2) == cache.continuations([2, 3], 2)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(InvalidParameterError, match="not a verispec suffix cache"):
        SuffixCache().load(tmp_path / "bad.npz")
    with pytest.raises(InvalidParameterError, match="no suffix cache"):
        SuffixCache().load(tmp_path / "missing.npz")


def test_server_keeps_its_suffix_cache_across_restarts(tmp_path):
    import httpx

    from server_support import LiveServer, tiny_pipeline, wait_ready
    from verispec.server import create_app

    path = tmp_path / "cache.npz"
    body = {
        "model": "tiny-target",
        "prompt": "Hello",
        "max_tokens": 12,
        "temperature": 0,
        "speculative": {"method": "suffix"},
    }
    with LiveServer(create_app(tiny_pipeline(), suffix_cache=str(path))) as server:
        wait_ready(server.url)
        first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert path.exists()
    with LiveServer(create_app(tiny_pipeline(), suffix_cache=str(path))) as server:
        wait_ready(server.url)
        second = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["num_accepted_tokens"] > first["usage"]["num_accepted_tokens"]  # it remembered
    path.write_bytes(b"junk")
    with pytest.raises(InvalidParameterError):
        create_app(tiny_pipeline(), suffix_cache=str(path))


@pytest.mark.parametrize(
    "arrays",
    [
        None,  # an empty file
        {"tokens": np.array([1.0, 2.0]), "lengths": np.array([2])},  # float tokens
        {
            "tokens": np.array([1, 2, 3, 4]),
            "lengths": np.array([2**63 - 1, 2**63 - 1, 6]),
        },  # lengths that overflow int64
        {"tokens": np.array([2**40, 1]), "lengths": np.array([2])},  # ids beyond any vocabulary
        {"tokens": np.array([[1, 2]]), "lengths": np.array([2])},  # not 1-D
        {"tokens": np.array(["a", "b"]), "lengths": np.array([2])},
    ],
)
def test_bad_cache_files_are_clear_errors(tmp_path, arrays):
    path = tmp_path / "c.npz"
    if arrays is None:
        path.write_bytes(b"")
    else:
        np.savez(path, **arrays)
    with pytest.raises(InvalidParameterError):
        SuffixCache().load(path)
    np.save(tmp_path / "plain.npy", np.arange(4))
    with pytest.raises(InvalidParameterError, match="not a verispec suffix cache"):
        SuffixCache().load(tmp_path / "plain.npy")


def test_server_refuses_an_unwritable_suffix_cache_path(tmp_path):
    from server_support import tiny_pipeline
    from verispec.server import create_app

    with pytest.raises(InvalidParameterError, match="cannot be written"):
        create_app(tiny_pipeline(), suffix_cache=str(tmp_path / "missing-dir" / "c.npz"))
    with pytest.raises(InvalidParameterError, match="cannot be written"):
        create_app(tiny_pipeline(), suffix_cache=str(tmp_path))


def test_warm_ups_and_audit_re_decodes_teach_the_cache_nothing():
    from verispec.bench.audit import QualityAuditor

    engine = cycle_engine()
    cache = engine.proposers["suffix"].cache
    params = SamplingParams(max_tokens=12)
    engine.generate([6, 7], params, SpeculativeConfig(method="auto", schedule="constant"), learn=False)  # a warm-up
    assert cache.num_sequences == 0
    out = engine.generate([6, 7], params, SpeculativeConfig(method="auto", schedule="constant"))
    QualityAuditor(1.0).audit(engine, [6, 7], params, out)  # re-decodes it plainly
    assert cache.num_sequences == 1 and cache.num_tokens == len(out.token_ids)


def test_an_engine_with_its_own_suffix_cache_shares_everything_else():
    from verispec.proposers.factory import with_own_suffix_cache

    engine = cycle_engine()
    own = engine.with_proposers(with_own_suffix_cache(engine.proposers))
    assert own.proposers["suffix"].cache is not engine.proposers["suffix"].cache
    assert own.proposers["suffix-tree"].suffix is own.proposers["suffix"]
    assert own.target is engine.target and own.cost_model is engine.cost_model
    params = SamplingParams(max_tokens=20)
    out = own.generate([6, 7], params, SpeculativeConfig(method="suffix", schedule="constant"))
    assert out.token_ids == engine.generate([6, 7], params, SpeculativeConfig(method="none")).token_ids
    assert own.proposers["suffix"].cache.num_sequences == 1
    assert engine.proposers["suffix"].cache.num_sequences == 1  # the plain request, on its own engine's cache


def test_bench_methods_learn_only_their_own_answers():
    """In a benchmark the methods take turns on every prompt: the suffix drafter must not be drafted
    from another method's answer to the same prompt (nor from the warm-up), only from its own
    earlier answers (the second, repeated prompt)."""
    from server_support import tiny_pipeline
    from verispec.bench.run import BenchConfig, run_bench
    from verispec.bench.workload import WorkloadItem

    items = [WorkloadItem(name, "code", "def fib(n):", False) for name in ("first", "again")]
    config = BenchConfig(methods=("suffix",), peers=(), max_tokens=24, num_speculative_tokens=5)
    records, _, _ = run_bench(tiny_pipeline(), items, config)  # prompt 0: none, then suffix
    by = {(r.prompt_id, r.method): r for r in records}
    pipe = tiny_pipeline()
    alone = pipe.engine.generate(
        pipe.encode("def fib(n):"),
        SamplingParams(max_tokens=24),
        SpeculativeConfig(method="suffix", num_speculative_tokens=5, schedule="constant"),
    )
    assert by[("first", "suffix")].token_ids == by[("first", "none")].token_ids == alone.token_ids
    counts = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    assert [by[("first", "suffix")].spec[c] for c in counts] == [
        getattr(alone.metrics.spec, c) for c in counts
    ]  # an empty cache
    assert by[("again", "suffix")].num_target_forwards < by[("first", "suffix")].num_target_forwards
