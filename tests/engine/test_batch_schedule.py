"""The library's default schedule under continuous batching: ``cost`` prices every step for the
whole batch, so a :class:`Scheduler` of 8 ``auto`` requests never drafts where its own cost model
says the batch would run slower than plain decoding (the ``constant`` schedule does, which is why
it is no longer the default), and every output still equals plain decoding.

The cost model is fixed here (measurements off) so that the test decides what the machine is
like: a compute-bound pass (each row costs the same: drafting never pays in a batch) or a
memory-bound one (a pass costs the same whatever its rows: drafting pays)."""

import pytest

from batching_support import PROMPTS, gguf_engine
from verispec.algorithms.control import CostModel
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.policy import DraftPolicy
from verispec.engine.scheduler import Scheduler

NUM_REQUESTS = 8
MAX_TOKENS = 24


def fixed_costs(engine, monkeypatch, pass_s) -> None:
    """The engine's cost model: a pass of ``rows`` rows takes ``pass_s(rows)`` seconds, every
    drafter 1% of a plain pass per token; nothing measured during the run changes it."""
    for name in ("record_verify", "record_draft", "record_draft_ratio", "record_catch_up"):
        monkeypatch.setattr(CostModel, name, lambda self, *args, **kwargs: None)
    costs = engine.cost_model
    costs.verify_s = {rows - 1: pass_s(rows) for rows in range(1, 8 * NUM_REQUESTS + 2)}
    for name in list(engine.proposers) + ["ngram"]:
        costs.draft_token_s[name] = 0.01 * pass_s(1)
        costs.draft_ratio[name] = 0.01


def watch_drafts(monkeypatch) -> list[tuple[int, int, float | None]]:
    """Every drafting decision as ``(batch_size, tokens drafted or deferred, predicted speedup)``."""
    seen = []
    draft = DraftPolicy.draft

    def watched(self, request, limit, batch_size=1, defer=()):
        step = draft(self, request, limit, batch_size, defer)
        drafted = len(step.draft.draft_token_ids) or step.deferred
        speedup = step.predicted[0] / step.predicted[1] if step.predicted else None
        seen.append((batch_size, drafted, speedup))
        return step

    monkeypatch.setattr(DraftPolicy, "draft", watched)
    return seen


def run(engine, spec: SpeculativeConfig) -> list[list[int]]:
    scheduler = Scheduler(engine, max_num_seqs=NUM_REQUESTS)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    handles = [scheduler.add(PROMPTS[i], params, spec, tag=i) for i in range(NUM_REQUESTS)]
    outputs = [None] * len(handles)
    while scheduler.running or scheduler.waiting:
        for handle, chunk in scheduler.step():
            if chunk.output is not None:
                outputs[handle.tag] = chunk.output.token_ids
    return outputs


@pytest.fixture(scope="module")
def plain(gguf_files):
    return run(gguf_engine(gguf_files), SpeculativeConfig(method="none"))


def test_the_library_default_schedule_is_cost():
    assert SpeculativeConfig().schedule == "cost"
    assert SpeculativeConfig(method="auto").schedule == "cost"


def test_a_compute_bound_batch_of_auto_requests_does_not_draft(gguf_files, plain, monkeypatch):
    engine = gguf_engine(gguf_files)
    fixed_costs(engine, monkeypatch, lambda rows: 0.01 * rows)
    seen = watch_drafts(monkeypatch)
    assert run(engine, SpeculativeConfig(method="auto")) == plain
    batched = [(size, drafted) for size, drafted, _ in seen if size >= 2]
    assert max(size for size, _ in batched) == NUM_REQUESTS
    assert sum(drafted for _, drafted in batched) == 0


def test_a_memory_bound_batch_drafts_and_only_where_its_estimate_beats_plain(gguf_files, plain, monkeypatch):
    engine = gguf_engine(gguf_files)
    fixed_costs(engine, monkeypatch, lambda rows: 0.01)
    seen = watch_drafts(monkeypatch)
    assert run(engine, SpeculativeConfig(method="auto")) == plain
    drafting = [(size, speedup) for size, drafted, speedup in seen if drafted > 0]
    assert any(size == NUM_REQUESTS for size, _ in drafting)
    assert all(speedup is not None and speedup >= 1.0 for size, speedup in drafting if size >= 2)


def test_the_constant_schedule_drafts_into_a_compute_bound_batch(gguf_files, plain, monkeypatch):
    """What the default avoids: the same batch with ``constant`` drafts at an estimate below plain."""
    engine = gguf_engine(gguf_files)
    fixed_costs(engine, monkeypatch, lambda rows: 0.01 * rows)
    seen = watch_drafts(monkeypatch)
    assert run(engine, SpeculativeConfig(method="auto", schedule="constant")) == plain
    slower = [speedup for size, drafted, speedup in seen if size >= 2 and drafted > 0 and speedup is not None]
    assert slower and max(slower) < 1.0
