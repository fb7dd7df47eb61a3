"""The session workloads (issue 53): the same requests to verispec with and without its prefix
cache, the later ones read from the cache, every output identical; the editor's prompts grow at
the cursor; the workloads' refusals."""

import itertools

import pytest

from gguf_models import write_gguf_model
from verispec.bench.sessions import (
    SESSION_WORKLOADS,
    check_sessions_limit,
    editor_file,
    editor_prompts,
    run_sessions,
    session_markdown,
    support_policy,
)
from verispec.engine.loader import SpeculativePipeline
from verispec.errors import InvalidParameterError
from verispec.runners.select import RunnerOptions


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    path = write_gguf_model(tmp_path_factory.mktemp("sessions") / "target.gguf")
    return SpeculativePipeline.load(str(path), None, runners=RunnerOptions(kind="gguf"), prefix_cache_gib=0.25)


def test_editor_prompts_grow_at_the_cursor():
    prompts = editor_prompts(editor_file())
    assert len(prompts) == 6
    assert all(
        later.startswith(earlier) and len(later) > len(earlier) for earlier, later in itertools.pairwise(prompts)
    )
    assert len(support_policy().split()) > 800  # a long system prompt (~1,150 tokens of Qwen's vocabulary)


def test_the_completion_workload_reads_earlier_requests_from_the_cache(pipe):
    text = "".join(f"line {i}: abcdefghij\n" for i in range(40))
    requests = editor_prompts(text, 4, first_line=10, last_line=16)
    results = run_sessions(pipe, "completion", method="ngram", max_tokens=6, editor_requests=requests)
    cached = [r for r in results.records if r.participant == "verispec:ngram (prefix cache)"]
    assert [r.turn for r in cached] == [0, 1, 2, 3]
    assert cached[0].cached_tokens == 0 and all(r.cached_tokens > 0 for r in cached[1:])
    assert all(r.identical for r in cached)  # the same tokens as without the cache
    summary = {row["participant"]: row for row in results.summary()}
    assert summary["verispec:ngram (prefix cache)"]["identical"] == "4/4"
    assert summary["verispec:ngram (no cache)"]["cached_tokens"] == 0
    assert "| verispec:ngram (prefix cache) | 4 |" in session_markdown(results)


def test_refusals(pipe):
    with pytest.raises(InvalidParameterError, match="chat template"):
        run_sessions(pipe, "multiturn")  # the tiny model has none
    with pytest.raises(InvalidParameterError, match="unknown session workload"):
        run_sessions(pipe, "chat")
    with pytest.raises(InvalidParameterError, match="1..2"):
        check_sessions_limit(3, "multiturn")
    assert set(SESSION_WORKLOADS) == {"multiturn", "completion"}
