"""A request alone prefills in passes of the runner's ``prefill_chunk_rows``, and a draft model
catches up on a long prompt the same way: the output is the output of one whole-prompt pass, bit
for bit (tiny random GGUF models on the gguf runner, batch-invariant), for every model method,
greedy and seeded, with logprobs."""

from pathlib import Path

import pytest

from gguf_models import MIXED, VOCAB, perturbed_copy, write_gguf_model
from helpers import CharTokenizer, default_pieces
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.draft_tree import DraftTreeProposer
from verispec.runners.cpu.gguf_runner import GGUFRunner

PIECES = CharTokenizer(default_pieces(VOCAB))
PROMPT = [8 + (i * 7) % 50 for i in range(45)]  # 45 tokens: 9 passes of 5 rows, the last one short


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("chunk-gguf")
    target = write_gguf_model(directory / "target.gguf", types=MIXED)
    return {"target": target, "draft": perturbed_copy(target, directory / "draft.gguf", "output.weight", 0.3)}


def make_engine(files, chunk_rows: int | None) -> SpeculativeEngine:
    runners = [GGUFRunner.from_file(files[name], max_context_length=256) for name in ("target", "draft", "draft")]
    for runner in runners:
        runner.prefill_chunk_rows = chunk_rows  # the class's 128 would not split a 45-token prompt
    proposers = {
        "draft": DraftModelProposer(runners[1]),
        "tree": DraftTreeProposer(runners[2], branching=2, max_depth=4),
    }
    return SpeculativeEngine(runners[0], PIECES, eos_token_ids=(0,), proposers=proposers)


def test_the_cpu_runners_declare_their_prefill_chunk(gguf_files):
    assert GGUFRunner.from_file(gguf_files["target"], max_context_length=64).prefill_chunk_rows == 128


@pytest.mark.parametrize("method", ["none", "draft", "tree"])
@pytest.mark.parametrize("options", [dict(max_tokens=20), dict(max_tokens=20, temperature=0.8, seed=3)])
def test_chunked_prefill_alone_equals_one_pass(gguf_files, method, options):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, schedule="constant")
    outputs = {}
    for chunk_rows in (None, 5):
        engine = make_engine(gguf_files, chunk_rows)
        outputs[chunk_rows] = engine.generate(PROMPT, SamplingParams(logprobs=2, **options), spec)
        if method == "draft":  # the draft cache followed the whole prompt, however it was fed
            drafter = engine.proposers["draft"]
            assert drafter.runner.num_cached_tokens == len(drafter.cached_token_ids)
            assert drafter.cached_token_ids[: len(PROMPT)] == PROMPT
    whole, chunked = outputs[None], outputs[5]
    assert chunked.token_ids == whole.token_ids
    assert [lp.logprob for lp in chunked.logprobs] == [lp.logprob for lp in whole.logprobs]
    # the prompt went in 9 passes instead of 1
    assert chunked.metrics.num_target_forwards == whole.metrics.num_target_forwards + 8
