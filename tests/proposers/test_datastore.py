"""The suffix drafter's corpus datastore (``verispec datastore build``): lookups against a brute-force
search, damaged and misplaced datastores as clear errors, a pipeline drafting from one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.errors import InvalidParameterError
from verispec.proposers import DraftRequest
from verispec.proposers.suffix import SuffixCache, SuffixProposer


def request(prompt, output=()):
    return DraftRequest(list(prompt), list(output), SamplingParams(), torch.Generator())


def test_datastore_finds_the_longest_tail_in_the_corpus(tmp_path):
    from verispec.proposers.datastore import Datastore, build_datastore

    documents = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7], [3, 4, 5, 8], [], [2, 3]]
    summary = build_datastore(documents, tmp_path / "ds", depth=4)
    assert summary == {"format": 1, "num_tokens": 17, "num_documents": 4, "depth": 4}
    store = Datastore(tmp_path / "ds")
    n, found = store.continuations([0, 2, 3, 4], 3, min_ngram=2, max_ngram=8)
    assert n == 3 and sorted(found) == [[5, 6], [7]]  # never past a document's end
    n, found = store.continuations([7, 3, 4], 2)
    assert n == 2 and sorted(found) == [[5, 6], [5, 8], [7]]
    assert store.continuations([6, 1], 2) == (0, [])  # 6 1 spans two documents: no match
    # the suffix drafter reads it when neither the request nor the cache matches longer
    proposer = SuffixProposer(SuffixCache(), datastore=store)
    assert proposer.propose(request([0, 2, 3, 4]), 8).draft_token_ids in ([5, 6], [7])
    with pytest.raises(InvalidParameterError, match="not a verispec datastore"):
        Datastore(tmp_path)


def test_datastore_agrees_with_a_brute_force_search(tmp_path):
    import random

    from verispec.proposers.datastore import Datastore, build_datastore

    rng = random.Random(0)
    documents = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    build_datastore(documents, tmp_path / "ds", depth=3)
    store = Datastore(tmp_path / "ds")
    for _ in range(200):
        pattern = [rng.randrange(5) for _ in range(3)]
        expected = sum(1 for d in documents for i in range(len(d) - 2) if d[i : i + 3] == pattern)
        lo, hi = store._range(pattern)
        assert hi - lo == expected


def test_damaged_datastores_are_clear_errors(tmp_path):
    import json as json_module

    from verispec.proposers.datastore import Datastore, build_datastore

    build_datastore([[1, 2, 3, 4]], tmp_path / "ds", depth=2)
    Datastore(tmp_path / "ds")
    np.save(tmp_path / "ds" / "suffixes.npy", np.load(tmp_path / "ds" / "suffixes.npy").reshape(1, -1))
    with pytest.raises(InvalidParameterError, match="damaged"):
        Datastore(tmp_path / "ds")
    for summary in ([1], {"format": 1}, {"format": 1, "depth": "x"}, {"format": 1, "depth": 0}):
        build_datastore([[1, 2, 3, 4]], tmp_path / "ds", depth=2)
        (tmp_path / "ds" / "datastore.json").write_text(json_module.dumps(summary))
        with pytest.raises(InvalidParameterError):
            Datastore(tmp_path / "ds")


def test_datastore_build_refuses_an_out_that_is_not_a_new_directory(tmp_path):
    from typer.testing import CliRunner

    from verispec.cli import app

    (tmp_path / "corpus.txt").write_text("x = 1\n")
    (tmp_path / "file").write_text("keep me")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me too")
    for out in (tmp_path / "file", tmp_path / "other"):
        result = CliRunner().invoke(app, ["datastore", "build", str(tmp_path / "corpus.txt"), "--out", str(out)])
        assert result.exit_code == 2 and "must be a new or empty directory" in " ".join(result.output.split())
    assert (tmp_path / "file").read_text() == "keep me"


def test_a_pipeline_given_a_datastore_drafts_from_it(tmp_path):
    """``serve --datastore`` (and every replica) names it in the pipeline's drafter options."""
    from server_support import tiny_pipeline
    from verispec.proposers.datastore import build_datastore
    from verispec.proposers.factory import DrafterOptions

    pipe = tiny_pipeline()
    params = SamplingParams(max_tokens=16)
    prompt = pipe.encode("def fib(n):")
    plain = pipe.engine.generate(prompt, params, SpeculativeConfig(method="none"), learn=False).token_ids
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=8, schedule="constant")
    without = pipe.engine.generate(prompt, params, spec, learn=False)
    build_datastore([prompt + plain], tmp_path / "ds", depth=8)  # the corpus holds the answer
    pipe = tiny_pipeline(DrafterOptions(datastore=tmp_path / "ds"))
    out = pipe.engine.generate(prompt, params, spec)
    assert out.token_ids == without.token_ids == plain
    assert out.metrics.spec.num_accepted_tokens > without.metrics.spec.num_accepted_tokens
    with pytest.raises(InvalidParameterError, match="not a verispec datastore"):
        tiny_pipeline(DrafterOptions(datastore=tmp_path))
