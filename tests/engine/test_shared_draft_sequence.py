"""``auto``'s draft chain and draft tree over one draft sequence (issue 55): switching between them
feeds only the tokens since either last drafted, each drafts what a drafter over a cache of its
own drafts, and the output stays plain decoding's (tiny random GGUF models on the gguf runner,
whose cache entries do not depend on the pass that computed them)."""

from pathlib import Path

import pytest
import torch

from gguf_models import MIXED, VOCAB, perturbed_copy, write_gguf_model
from helpers import CharTokenizer, default_pieces
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.prefix_cache import PrefixCache
from verispec.engine.scheduler import Scheduler
from verispec.proposers import DraftRequest
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.proposers.factory import for_new_sequence
from verispec.runners.cpu.gguf_runner import GGUFRunner

PIECES = CharTokenizer(default_pieces(VOCAB))
PROMPTS = [[8, 9, 8, 9, 8, 9, 40, 41, 12, 13, 14], [70, 3, 71, 72, 73, 74, 8, 9], [80, 81, 82]]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("shared-draft")
    target = write_gguf_model(directory / "target.gguf", types=MIXED)
    return {"target": target, "draft": perturbed_copy(target, directory / "draft.gguf", "output.weight", 0.3)}


def shared_drafters(path: Path) -> dict:
    chain = DraftModelProposer(GGUFRunner.from_file(path, max_context_length=256))
    tree = DraftTreeProposer(chain.runner, branching=2, max_depth=4).on_sequence_of(chain)
    return {"draft": chain, "tree": tree}


def test_chain_and_tree_share_the_cache_and_draft_what_own_caches_draft(gguf_files):
    shared = shared_drafters(gguf_files["draft"])
    own_runner = GGUFRunner.from_file(gguf_files["draft"], max_context_length=256)
    context = [8, 9, 8, 9, 40, 41, 12]
    for step in range(6):
        request = DraftRequest(context[:5], context[5:], SamplingParams(), torch.Generator())
        name = ("draft", "tree")[step % 2]
        rows = shared[name].catch_up_rows(request)
        if step:
            assert rows <= 4  # the other drafter fed this sequence: only what was accepted since
        drafted = shared[name].propose(request, 4)
        own = (DraftModelProposer if name == "draft" else DraftTreeProposer)(own_runner.new_sequence())
        if name == "tree":
            own.branching, own.max_depth = 2, 4
        assert drafted.draft_token_ids == own.propose(request, 4).draft_token_ids  # recomputed from scratch
        context = context + list(drafted.draft_token_ids[:2]) + [(step * 7 + 3) % 60 + 1]  # two accepted, one bonus
    assert shared["tree"].shares_sequence_with(shared["draft"])
    assert shared["tree"].cached_token_ids is shared["draft"].cached_token_ids


def test_a_new_request_gets_one_new_sequence_for_both(gguf_files):
    shared = shared_drafters(gguf_files["draft"])
    fresh = for_new_sequence(shared)
    assert fresh["tree"].runner is fresh["draft"].runner
    assert fresh["draft"].runner is not shared["draft"].runner
    assert fresh["tree"].shares_sequence_with(fresh["draft"])
    assert not fresh["draft"].shares_sequence_with(shared["draft"])
    fresh["draft"].cached_token_ids = [1, 2]
    assert shared["draft"].cached_token_ids == [] and fresh["tree"].cached_token_ids == [1, 2]


def make_engine(files, cache: PrefixCache | None = None, shared: bool = True) -> SpeculativeEngine:
    if shared:
        proposers = shared_drafters(files["draft"])
    else:
        proposers = {
            "draft": DraftModelProposer(GGUFRunner.from_file(files["draft"], max_context_length=256)),
            "tree": DraftTreeProposer(
                GGUFRunner.from_file(files["draft"], max_context_length=256), branching=2, max_depth=4
            ),
        }
    target = GGUFRunner.from_file(files["target"], max_context_length=256)
    return SpeculativeEngine(target, PIECES, eos_token_ids=(0,), proposers=proposers, prefix_cache=cache)


@pytest.mark.parametrize(
    "options",
    [dict(max_tokens=24), dict(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)],
    ids=["greedy", "seeded"],
)
def test_auto_over_one_draft_sequence_equals_plain_alone_and_batched(gguf_files, options):
    engine = make_engine(gguf_files, PrefixCache(1 << 20, block_size=4))
    plain = make_engine(gguf_files, shared=False)
    params = SamplingParams(logprobs=1, **options)
    expected = [plain.generate(p, params, SpeculativeConfig(method="none")) for p in PROMPTS]
    auto = SpeculativeConfig(method="auto", num_speculative_tokens=4, schedule="constant")
    used = set()
    for prompt, want in zip(PROMPTS, expected):
        out = engine.generate(prompt, params, auto)
        assert out.token_ids == want.token_ids
        assert [(r.token_id, r.logprob, r.top) for r in out.logprobs] == [
            (r.token_id, r.logprob, r.top) for r in want.logprobs
        ]
        used |= {name for name, s in out.metrics.spec.per_drafter.items() if s.num_drafts}
    assert {"draft", "tree"} <= used
    scheduler = Scheduler(engine, max_num_seqs=3)
    handles = [scheduler.add(p, params, auto) for p in PROMPTS]
    done = {}
    while scheduler.running or scheduler.waiting:
        done.update((id(h), c.output) for h, c in scheduler.step() if c.output is not None)
    assert [done[id(h)].token_ids for h in handles] == [w.token_ids for w in expected]
