"""Automatic prefix caching (issue 53): the store's bookkeeping, and the engine's output with the
cache on equal to the output with it off, bit for bit, for every method, greedy and seeded, alone
and batched, across chunked-prefill boundaries and evictions (tiny random GGUF models on the gguf
runner: its cache entries do not depend on how a prompt was split into passes).
"""

from pathlib import Path

import pytest
import torch

from gguf_models import MIXED, VOCAB, perturbed_copy, write_gguf_model
from helpers import CharTokenizer, default_pieces
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.prefix_cache import ROOT, TARGET_PART, PrefixCache, block_hashes
from verispec.engine.scheduler import Scheduler
from verispec.errors import InvalidParameterError
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.runners.cpu.gguf_runner import GGUFRunner

PIECES = CharTokenizer(default_pieces(VOCAB))
METHODS = ["none", "ngram", "suffix", "draft", "tree", "auto"]
SYSTEM = [8, 9, 8, 9, 8, 9, 8, 40, 41, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 8, 9, 8, 9, 50]  # 26 tokens
QUESTIONS = [[60, 61, 62], [70, 3, 71, 72, 73, 74], [80], [8, 9, 8, 9, 30, 31]]
BLOCK = 4  # small blocks: many block boundaries inside short prompts
GREEDY = dict(max_tokens=24)
SEEDED = dict(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("prefix-gguf")
    target = write_gguf_model(directory / "target.gguf", types=MIXED)
    return {"target": target, "draft": perturbed_copy(target, directory / "draft.gguf", "output.weight", 0.3)}


def make_engine(files, cache: PrefixCache | None, max_num_batched_tokens: int = 256) -> SpeculativeEngine:
    target = GGUFRunner.from_file(files["target"], max_context_length=256)
    proposers = {
        "draft": DraftModelProposer(GGUFRunner.from_file(files["draft"], max_context_length=256)),
        "tree": DraftTreeProposer(
            GGUFRunner.from_file(files["draft"], max_context_length=256), branching=2, max_depth=4
        ),
    }
    return SpeculativeEngine(
        target,
        PIECES,
        eos_token_ids=(0,),
        proposers=proposers,
        prefix_cache=cache,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def spec(method: str) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_speculative_tokens=4, schedule="constant")


def conversation(engine: SpeculativeEngine, method: str, options: dict, turns: int = 3, scheduled: bool = False):
    """A chat that re-sends everything each turn: system, then per turn a question and the answer.
    ``scheduled``: each turn through a scheduler, whose slot is emptied between requests (the draft
    model's cache too: it is read back from the prefix cache, not kept by the slot)."""
    outputs, context = [], list(SYSTEM)
    scheduler = Scheduler(engine, max_num_seqs=1) if scheduled else None
    for question in QUESTIONS[:turns]:
        context = context + question
        params = SamplingParams(logprobs=2, **options)
        if scheduler is None:
            out = engine.generate(context, params, spec(method))
        else:
            scheduler.add(context, params, spec(method))
            out = None
            while out is None:
                out = next((c.output for _, c in scheduler.step() if c.output is not None), None)
        outputs.append(out)
        context = context + out.token_ids
    return outputs


def logprob_rows(out) -> list:
    return [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]


# ----- the store -----


def test_block_names_are_a_chain_over_the_whole_prefix():
    names = block_hashes(list(range(10)), 4)
    assert len(names) == 2  # full blocks only: tokens 8, 9 are not a block yet
    assert block_hashes(list(range(8)), 4) == names  # the same prefix, the same names
    assert block_hashes([99] + list(range(1, 10)), 4)[1] != names[1]  # block 1 names its whole prefix
    assert block_hashes(list(range(12)), 4, known=names)[:2] == names  # known names are kept, the rest hashed
    assert block_hashes(list(range(12)), 4)[2] == block_hashes(list(range(12)), 4, known=names)[2]


def entries(num_blocks: int, value: float = 1.0) -> torch.Tensor:
    return torch.full((2, 1, 1, num_blocks * BLOCK, 2), value)  # [2, layers, kv_heads, tokens, head_dim]


BLOCK_BYTES = 2 * BLOCK * 2 * 4  # one block's entries above, float32


def test_insert_match_read_and_the_budget():
    cache = PrefixCache(3 * BLOCK_BYTES, block_size=BLOCK)
    names = block_hashes(list(range(5 * BLOCK)), BLOCK)
    assert cache.insert(names, 0, TARGET_PART, entries(5), 3) == 3  # the budget holds three blocks
    assert cache.match(names, [TARGET_PART]) == 3 and cache.num_bytes == 3 * BLOCK_BYTES
    assert cache.match(names, [TARGET_PART, "draft:draft"]) == 0  # a part never kept
    assert cache.read(names[:3], TARGET_PART, 3).shape == (2, 1, 1, 3 * BLOCK, 2)
    assert cache.insert(names, 4, TARGET_PART, entries(1), 3) == 0  # no parent: never an orphan


def test_eviction_is_least_recently_used_tail_first_and_spares_held_blocks():
    cache = PrefixCache(4 * BLOCK_BYTES, block_size=BLOCK)
    first = block_hashes([1] * (2 * BLOCK), BLOCK)
    second = block_hashes([2] * (2 * BLOCK), BLOCK)
    cache.insert(first, 0, TARGET_PART, entries(2), 3)
    cache.insert(second, 0, TARGET_PART, entries(2), 3)
    cache.read(first, TARGET_PART, 3)  # first is now the most recently used
    third = block_hashes([3] * BLOCK, BLOCK)
    cache.insert(third, 0, TARGET_PART, entries(1), 3)
    assert cache.match(second, [TARGET_PART]) == 1  # second's tail went first, its head stays
    assert cache.match(first, [TARGET_PART]) == 2
    cache.hold(first)
    fourth = block_hashes([4] * (3 * BLOCK), BLOCK)
    assert cache.insert(fourth, 0, TARGET_PART, entries(3), 3) == 2  # held blocks are never evicted
    assert cache.match(first, [TARGET_PART]) == 2 and cache.num_bytes <= cache.budget_bytes
    assert cache.refs(first[0]) == 1
    cache.unhold(first)
    assert cache.refs(first[0]) == 0


def test_evicting_a_block_drops_its_descendants():
    cache = PrefixCache(10 * BLOCK_BYTES, block_size=BLOCK)
    names = block_hashes(list(range(3 * BLOCK)), BLOCK)
    cache.insert(names, 0, TARGET_PART, entries(3), 3)
    cache._evict(cache._blocks[names[1]])
    assert names[2] not in cache and names[0] in cache and cache.num_bytes == BLOCK_BYTES
    assert cache.stats.evicted_blocks == 2


def test_bad_budget_is_refused():
    with pytest.raises(InvalidParameterError, match="budget"):
        PrefixCache(-1)
    assert PrefixCache(0).insert(block_hashes([1] * 16), 0, TARGET_PART, torch.zeros(2, 1, 1, 16, 2), 3) == 0
    assert ROOT == b""


# ----- the engine: cache on == cache off -----


@pytest.mark.parametrize("options", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", METHODS)
def test_a_conversation_gives_the_same_tokens_and_logprobs_with_the_cache_on(gguf_files, method, options):
    plain = conversation(make_engine(gguf_files, None), "none", options)
    cache = PrefixCache(2**30, block_size=BLOCK)
    cached = conversation(make_engine(gguf_files, cache), method, options)
    for turn, (want, got) in enumerate(zip(plain, cached)):
        assert got.token_ids == want.token_ids, (method, turn)
        assert logprob_rows(got) == logprob_rows(want), (method, turn)  # bit-identical rows
    assert cached[0].metrics.cached_tokens == 0
    # later turns read the system prompt, the earlier questions and the answers from the cache
    previous = len(SYSTEM) + len(QUESTIONS[0]) + len(cached[0].token_ids)
    assert cached[1].metrics.cached_tokens >= (previous - 1) // BLOCK * BLOCK - BLOCK
    assert cached[2].metrics.cached_tokens > cached[1].metrics.cached_tokens
    assert cache.stats.hits == sum(out.metrics.cached_tokens for out in cached) > 0


@pytest.mark.parametrize("method", ["draft", "tree"])
def test_a_restored_draft_cache_drafts_what_a_recomputed_one_drafts(gguf_files, method):
    # the output cannot show a wrong draft cache (the target verifies); the drafts can: the same
    # drafted and accepted counts every turn mean the draft model saw the same entries
    off = conversation(make_engine(gguf_files, None), method, GREEDY, turns=4, scheduled=True)
    cache = PrefixCache(2**30, block_size=BLOCK)
    on = conversation(make_engine(gguf_files, cache), method, GREEDY, turns=4, scheduled=True)
    for want, got in zip(off, on):
        assert got.token_ids == want.token_ids
        assert got.metrics.spec.num_draft_tokens == want.metrics.spec.num_draft_tokens
        assert got.metrics.spec.num_accepted_tokens == want.metrics.spec.num_accepted_tokens
    assert cache.match(block_hashes(SYSTEM, BLOCK), [f"draft:{method}"]) > 0  # its entries were kept and read


def test_batched_requests_sharing_a_system_prompt_store_it_once(gguf_files):
    alone = [
        make_engine(gguf_files, None).generate(SYSTEM + q, SamplingParams(**SEEDED), spec("draft")).token_ids
        for q in QUESTIONS
    ]
    cache = PrefixCache(2**30, block_size=BLOCK)
    engine = make_engine(gguf_files, cache, max_num_batched_tokens=7)  # chunk boundaries inside blocks
    scheduler = Scheduler(engine, max_num_seqs=4)
    handles = [scheduler.add(SYSTEM + q, SamplingParams(**SEEDED), spec(m)) for q, m in zip(QUESTIONS, METHODS)]
    outputs = {}
    while scheduler.running or scheduler.waiting:
        for handle, chunk in scheduler.step():
            if chunk.output is not None:
                outputs[id(handle)] = chunk.output
    assert [outputs[id(h)].token_ids for h in handles] == alone
    assert sum(outputs[id(h)].metrics.cached_tokens for h in handles[1:]) > 0  # later ones read the first's
    system_blocks = block_hashes(SYSTEM, BLOCK)
    assert all(name in cache for name in system_blocks)  # stored once: one name, one block
    assert all(cache.refs(name) == 0 for name in system_blocks)  # every request let go of them


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_evictions_under_a_small_budget_keep_the_output(gguf_files, method):
    plain = conversation(make_engine(gguf_files, None), "none", GREEDY, turns=4)
    engine = make_engine(gguf_files, None)
    per_block = engine.target.kv_bytes_per_token * BLOCK
    cache = PrefixCache(5 * per_block, block_size=BLOCK)  # five target blocks: evicts every turn
    engine = make_engine(gguf_files, cache)
    cached = conversation(engine, method, GREEDY, turns=4)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert cache.stats.evicted_blocks > 0 and cache.num_bytes <= cache.budget_bytes


def test_cancelled_requests_let_go_of_their_blocks(gguf_files):
    cache = PrefixCache(2**30, block_size=BLOCK)
    engine = make_engine(gguf_files, cache)
    engine.generate(SYSTEM + QUESTIONS[0], SamplingParams(max_tokens=4), spec("draft"))
    scheduler = Scheduler(engine, max_num_seqs=2)
    first = scheduler.add(SYSTEM + QUESTIONS[1], SamplingParams(max_tokens=30), spec("draft"))
    second = scheduler.add(SYSTEM + QUESTIONS[2], SamplingParams(max_tokens=30), spec("none"))
    scheduler.step()
    names = block_hashes(SYSTEM, BLOCK)
    assert cache.refs(names[0]) == 2  # both read the system prompt's blocks
    scheduler.cancel(first)
    assert cache.refs(names[0]) == 1
    scheduler.cancel(second)
    assert all(cache.refs(name) == 0 for name in names)
    stream = engine.stream(SYSTEM + QUESTIONS[3], SamplingParams(max_tokens=30), spec("draft"))
    next(stream)
    assert cache.refs(names[0]) == 1
    stream.close()  # a consumer that stops early
    assert cache.refs(names[0]) == 0


def test_prompt_logprobs_still_get_every_prompt_row(gguf_files):
    cache = PrefixCache(2**30, block_size=BLOCK)
    engine = make_engine(gguf_files, cache)
    params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    engine.generate(SYSTEM + QUESTIONS[0], SamplingParams(max_tokens=4), spec("none"))
    out = engine.generate(SYSTEM + QUESTIONS[0], params, spec("none"))
    want = make_engine(gguf_files, None).generate(SYSTEM + QUESTIONS[0], params, spec("none"))
    assert len(out.prompt_logprobs) == len(SYSTEM + QUESTIONS[0]) - 1
    assert [(lp.token_id, lp.logprob) for lp in out.prompt_logprobs] == [
        (lp.token_id, lp.logprob) for lp in want.prompt_logprobs
    ]
    assert out.metrics.cached_tokens == 0


def test_a_runner_that_cannot_copy_its_cache_is_refused():
    from helpers import BigramRunner

    with pytest.raises(InvalidParameterError, match="prefix cache"):
        SpeculativeEngine(
            BigramRunner(torch.zeros(VOCAB, VOCAB)), PIECES, eos_token_ids=(0,), prefix_cache=PrefixCache(1)
        )


@pytest.mark.parametrize("method", ["eagle", "eagle-tree"])
def test_an_eagle_head_reads_the_cached_features(gguf_files, method):
    from eagle_support import gguf_head
    from verispec.engine.prefix_cache import FEATURES_PART
    from verispec.proposers.eagle import EagleProposer, EagleTreeProposer

    def engine(cache):
        runner = GGUFRunner.from_file(gguf_files["target"], max_context_length=256)
        eagle = EagleProposer(gguf_head(runner))
        proposers = {"eagle": eagle, "eagle-tree": EagleTreeProposer(eagle)}
        return SpeculativeEngine(runner, PIECES, eos_token_ids=(), proposers=proposers, prefix_cache=cache)

    plain = conversation(engine(None), "none", GREEDY)
    cache = PrefixCache(2**30, block_size=BLOCK)
    cached = conversation(engine(cache), method, GREEDY)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert cached[1].metrics.cached_tokens > 0 and cached[2].metrics.cached_tokens > 0
    names = block_hashes(SYSTEM, BLOCK)
    assert cache.match(names, [TARGET_PART, FEATURES_PART]) == len(names)  # features kept with the entries
    assert all(o.metrics.spec.num_draft_tokens > 0 for o in cached[1:])  # the head drafted on cached prefixes
