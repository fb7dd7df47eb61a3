"""A seed fixes the text (issue 47): with coupled sampling every method gives plain decoding's
sampled tokens for a seed, alone and batched with 7 other requests, under the constant and the
cost schedule, on the gguf runner (tiny random GGUF models: bit-identical rows whatever the batch).
"""

from pathlib import Path

import pytest

from gguf_models import MIXED, VOCAB, perturbed_copy, write_gguf_model
from helpers import CharTokenizer, default_pieces
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.scheduler import Scheduler
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.runners.cpu.gguf_runner import GGUFRunner

PIECES = CharTokenizer(default_pieces(VOCAB))
METHODS = ["none", "ngram", "suffix", "draft", "tree", "auto"]
PROMPT = [8, 9, 8, 9, 8, 9, 8, 40, 41]  # a repeat, so the lookups find something
OTHERS = [([70, 3], 5), ([11, 12, 13, 14, 15], 6)]  # the batch's other two requests: (prompt, seed)
PARAMS = [  # one row per sampling setting the issue names
    dict(temperature=0.7, top_p=0.9, repetition_penalty=1.2),  # nucleus and the CTRL penalty
    dict(temperature=1.0, top_k=20, presence_penalty=0.5, frequency_penalty=0.3),  # top-k, OpenAI penalties
]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("seeded-gguf")
    target = write_gguf_model(directory / "target.gguf", types=MIXED)
    return {"target": target, "draft": perturbed_copy(target, directory / "draft.gguf", "output.weight", 0.3)}


def make_engine(files) -> SpeculativeEngine:
    target = GGUFRunner.from_file(files["target"], max_context_length=256)
    proposers = {
        "draft": DraftModelProposer(GGUFRunner.from_file(files["draft"], max_context_length=256)),
        "tree": DraftTreeProposer(
            GGUFRunner.from_file(files["draft"], max_context_length=256), branching=2, max_depth=4
        ),
    }
    return SpeculativeEngine(target, PIECES, eos_token_ids=(0,), proposers=proposers)


def spec(method: str, schedule: str) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_speculative_tokens=4, schedule=schedule)


@pytest.mark.parametrize("schedule", ["constant", "cost"])
@pytest.mark.parametrize("options", PARAMS)
def test_every_method_gives_plain_sampled_tokens_alone_and_batched(gguf_files, options, schedule):
    engine = make_engine(gguf_files)
    params = SamplingParams(max_tokens=28, seed=11, **options)
    plain = engine.generate(PROMPT, params, spec("none", schedule)).token_ids
    other_seed = engine.generate(PROMPT, SamplingParams(max_tokens=28, seed=12, **options), spec("none", schedule))
    assert other_seed.token_ids != plain  # the seed matters (the test can fail)
    drafted = {}
    for method in METHODS:
        out = engine.generate(PROMPT, params, spec(method, schedule))
        assert out.token_ids == plain, method  # alone
        drafted[method] = out.metrics.spec.num_draft_tokens
    if schedule == "constant":  # speculation really ran (the cost schedule may decline it)
        assert drafted["draft"] > 0 and drafted["tree"] > 0
    # batched: the six methods of this request and two others share every pass (8 requests)
    requests = [(PROMPT, params, spec(m, schedule)) for m in METHODS]
    requests += [(p, SamplingParams(max_tokens=20, seed=s, **options), spec("draft", schedule)) for p, s in OTHERS]
    scheduler = Scheduler(engine, max_num_seqs=8)
    for i, r in enumerate(requests):
        scheduler.add(*r, tag=i)
    outputs, largest = [None] * len(requests), 0
    while scheduler.running or scheduler.waiting:
        largest = max(largest, len(scheduler.running))
        for handle, chunk in scheduler.step():
            if chunk.output is not None:
                outputs[handle.tag] = chunk.output.token_ids
    assert largest == 8
    assert outputs[: len(METHODS)] == [plain] * len(METHODS)
    for (prompt, other_params, _), out in zip(requests[len(METHODS) :], outputs[len(METHODS) :]):
        assert out == engine.generate(prompt, other_params, spec("none", schedule)).token_ids


def test_rejection_mode_stays_exact_for_greedy_and_runs_sampled(gguf_files):
    engine = make_engine(gguf_files)
    greedy = SamplingParams(max_tokens=20, sampling="rejection")
    assert (
        engine.generate(PROMPT, greedy, spec("draft", "constant")).token_ids
        == engine.generate(PROMPT, greedy, spec("none", "constant")).token_ids
    )
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=3, sampling="rejection")
    out = engine.generate(PROMPT, sampled, spec("draft", "constant"))
    assert len(out.token_ids) == 20 and out.metrics.spec.num_draft_tokens > 0
