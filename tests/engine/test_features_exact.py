"""logprobs, logit_bias and min_tokens under speculation on the batch-invariant gguf runner: every
method gives plain decoding's tokens and bit-identical log-probabilities, alone and batched."""

from __future__ import annotations

import pytest

from batching_support import PROMPTS, gguf_engine
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.scheduler import Scheduler

METHODS = ["draft", "ngram", "auto", "tree"]


def generate(engine, prompt, method, **params):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4)
    return engine.generate(prompt, SamplingParams(max_tokens=24, logprobs=3, **params), spec)


@pytest.fixture(scope="module")
def engine(gguf_files):
    return gguf_engine(gguf_files)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "params",
    [{}, {"logit_bias": {7: 3.0, 12: -100.0}}, {"repetition_penalty": 1.3}, {"min_tokens": 6, "logit_bias": {0: 8.0}}],
    ids=["plain", "logit_bias", "penalty", "min_tokens"],
)
def test_logprobs_bit_identical_to_plain_decoding(engine, method, params):
    for prompt in PROMPTS[:4]:
        plain = generate(engine, prompt, "none", **params)
        got = generate(engine, prompt, method, **params)
        assert got.token_ids == plain.token_ids
        assert got.logprobs == plain.logprobs  # TokenLogprob: floats compared exactly
        assert len(got.logprobs) == len(got.token_ids)


def test_min_tokens_masks_eos_until_the_output_is_long_enough(engine):
    # EOS (id 0) boosted: plain decoding stops at once, min_tokens delays it exactly that long.
    assert generate(engine, PROMPTS[0], "none", logit_bias={0: 100.0}).token_ids == []
    for method in ["none"] + METHODS:
        out = generate(engine, PROMPTS[0], method, logit_bias={0: 100.0}, min_tokens=5)
        assert len(out.token_ids) == 5 and out.finish_reason == "stop"


def test_logprobs_batched_equal_alone(engine):
    requests = [
        (
            prompt,
            SamplingParams(max_tokens=20, logprobs=2, logit_bias={3: 2.0}, min_tokens=i),
            SpeculativeConfig(method=m),
        )
        for i, (prompt, m) in enumerate(zip(PROMPTS, ["draft", "ngram", "auto", "tree", "none", "draft"]))
    ]
    alone = [engine.generate(*r).logprobs for r in requests]
    scheduler = Scheduler(engine, max_num_seqs=8)
    handles = [scheduler.add(*r, tag=i) for i, r in enumerate(requests)]
    batched = [None] * len(requests)
    while scheduler.running or scheduler.waiting:
        for handle, chunk in scheduler.step():
            if chunk.output is not None:
                batched[handle.tag] = chunk.output.logprobs
    assert batched == alone and len(handles) == 6


def test_prompt_logprobs_are_the_prefill_rows(engine):
    prompt = PROMPTS[2]
    out = engine.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1), SpeculativeConfig(method="draft"))
    assert [e.token_id for e in out.prompt_logprobs] == prompt[1:]
    assert all(e.logprob <= 0 and len(e.top) == 1 for e in out.prompt_logprobs)
