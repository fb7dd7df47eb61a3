"""A reduced draft head with context rows (runners/cpu/context_head.py): a sequence's logits are the
full head's, bit for bit, on the kept rows and on every token it has seen, -inf elsewhere; sequences
never share their rows, alone or batched; speculative output (greedy and seeded) equals plain."""

from pathlib import Path

import pytest
import torch

from gguf_models import DRAFT_LIKE, VOCAB, perturbed_copy, write_gguf_model
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import SpeculativePipeline
from verispec.errors import InvalidParameterError
from verispec.proposers.base import DraftRequest
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners import ForwardCall, forward_batch
from verispec.runners.cpu import context_head
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.select import RunnerOptions, make_runner

KEPT = torch.arange(0, 40, 3)  # 14 rows; the prompts below mostly lie outside them
PROMPT = [5, 17, 33, 2, 9, 61, 88]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("context-head")
    target = write_gguf_model(directory / "target.gguf")
    return {
        "target": target,
        "draft": write_gguf_model(directory / "draft.gguf", types=DRAFT_LIKE, seed=1),
        "partial": perturbed_copy(target, directory / "partial.gguf", "output.weight", 0.3),
    }


def reduced(path: Path, **options) -> GGUFRunner:
    return GGUFRunner.from_file(path, max_context_length=128, head_token_ids=KEPT, context_rows=True, **options)


def scored(token_ids) -> torch.Tensor:
    """The columns a reduced head with context rows scores after seeing ``token_ids``."""
    return torch.tensor(sorted(set(KEPT.tolist()) | set(token_ids)))


def assert_full_heads_columns(logits: torch.Tensor, full: torch.Tensor, seen) -> None:
    columns = scored(seen)
    assert torch.equal(logits[:, columns], full[:, columns])  # the full head's bits
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[columns] = False
    assert bool(outside.any()) and torch.all(logits[:, outside] == float("-inf"))


def test_a_sequence_scores_the_kept_rows_and_every_token_it_has_seen(files):
    full = GGUFRunner.from_file(files["draft"], max_context_length=128)
    r = reduced(files["draft"])
    assert_full_heads_columns(r.forward(PROMPT), full.forward(PROMPT), PROMPT)
    assert_full_heads_columns(r.forward([50, 71]), full.forward([50, 71]), PROMPT + [50, 71])
    r.truncate(3)  # rolled-back tokens keep their rows (a superset), the cache its three entries
    full.truncate(3)
    assert_full_heads_columns(r.forward([90]), full.forward([90]), PROMPT + [50, 71, 90])


def test_sequences_keep_their_own_rows_alone_and_batched(files):
    first, second = [5, 17, 33, 61], [70, 3, 44, 95]
    base = reduced(files["draft"])
    alone = [base.new_sequence().forward(first), base.new_sequence().forward(second)]
    a, b = base.new_sequence(), base.new_sequence()
    batched = forward_batch([ForwardCall(a, first), ForwardCall(b, second)])
    for one, many in zip(alone, batched):
        assert torch.equal(one, many)
    assert torch.all(batched[1][:, [17, 61]] == float("-inf"))  # first's tokens are not second's rows
    assert torch.all(batched[0][:, [70, 44, 95]] == float("-inf"))


def test_copies_imports_and_release_carry_the_rows_with_the_cache(files):
    full = GGUFRunner.from_file(files["draft"], max_context_length=128)
    full.forward(PROMPT)
    source = reduced(files["draft"])
    source.forward(PROMPT)
    copied = source.new_sequence()
    copied.copy_prefix(source, len(PROMPT))
    assert_full_heads_columns(copied.forward([50]), full.forward([50]), PROMPT + [50])
    imported = source.new_sequence()
    imported.import_kv(source.export_kv(0, len(PROMPT)), 0)
    imported.note_context_tokens(PROMPT)
    full.truncate(len(PROMPT))
    assert_full_heads_columns(imported.forward([71]), full.forward([71]), PROMPT + [71])
    imported.release()
    fresh = GGUFRunner.from_file(files["draft"], max_context_length=128)
    assert_full_heads_columns(imported.forward([7, 8]), fresh.forward([7, 8]), [7, 8])


def test_rows_added_one_at_a_time_are_merged_and_capped(files, monkeypatch):
    full = GGUFRunner.from_file(files["draft"], max_context_length=128)
    r = reduced(files["draft"])
    tokens = [50, 52, 53, 55, 56, 58, 59, 61]  # one new row a pass
    for token in tokens:
        logits, expected = r.forward([token]), full.forward([token])
    assert len(r._head_rows.parts) <= context_head.MAX_PARTS
    assert_full_heads_columns(logits, expected, tokens)
    monkeypatch.setattr(context_head, "MAX_CONTEXT_ROWS", 2)
    capped = reduced(files["draft"])
    out = capped.forward([50, 52, 53])
    assert torch.isfinite(out[:, [50, 52]]).all() and torch.all(out[:, 53] == float("-inf"))


def test_the_default_draft_head_gives_plain_output_greedy_and_seeded(files, tmp_path, monkeypatch):
    from verispec.runners import select

    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    monkeypatch.setattr(select, "DEFAULT_DRAFT_VOCAB", 16)  # the test vocabulary is 96 tokens
    pipe = SpeculativePipeline.load(str(files["target"]), str(files["partial"]))
    weights = pipe.draft_runner.weights
    assert weights.context_head is not None and 16 <= len(weights.head_token_ids) < VOCAB  # the default
    assert pipe.target_runner.weights.head_token_ids is None  # the target's head is never reduced
    for params in (SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.9, seed=7)):
        plain = pipe.generate("ab!c", params, SpeculativeConfig(method="none"))
        for method in ("draft", "tree", "auto"):
            config = SpeculativeConfig(method=method, num_speculative_tokens=4, schedule="constant")
            out = pipe.generate("ab!c", params, config)
            assert out.token_ids == plain.token_ids
    full = SpeculativePipeline.load(
        str(files["target"]), str(files["partial"]), runners=RunnerOptions(kind="gguf", draft_vocab_size=0)
    )
    assert full.draft_runner.weights.head_token_ids is None and full.draft_runner.weights.context_head is None


def test_impossible_head_options_are_refused(files):
    with pytest.raises(InvalidParameterError, match=">= 0"):
        RunnerOptions(draft_vocab_size=-1)
    with pytest.raises(InvalidParameterError, match="needs --runner gguf"):
        make_runner("int8", None, head_token_ids=KEPT, context_rows=True)


def test_the_draft_sees_every_prompt_token_in_its_head_beyond_its_window(files):
    prompt = [50, 52, 53, 55, 56, 58, 3, 6]  # a window of 2 feeds the draft 3 and 6 only (both kept)
    drafter = DraftModelProposer(reduced(files["draft"]), context_window=2)
    drafter.propose(DraftRequest(prompt, [], SamplingParams(max_tokens=8), torch.Generator()), 3)
    held = list(drafter.cached_token_ids)
    assert held[:2] == [3, 6]
    expected = GGUFRunner.from_file(files["draft"], max_context_length=128).forward(held + [9], num_logits=1)
    assert_full_heads_columns(drafter.runner.forward([9]), expected, prompt + held + [9])
    drafter.release()
    assert torch.all(drafter.runner.forward([1])[:, 50] == float("-inf"))  # a released sequence starts over
