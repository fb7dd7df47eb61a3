"""The draft model's context window: it sees only the prompt's last tokens (less to prefill on
long prompts), and the output is still exactly plain decoding's."""

from __future__ import annotations

import pytest

from batching_support import PROMPTS, gguf_engine
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import DrafterOptions
from verispec.errors import InvalidParameterError
from verispec.proposers import DraftRequest


@pytest.mark.parametrize("method", ["draft", "tree", "auto"])
@pytest.mark.parametrize("window", [1, 4, None])
def test_a_short_draft_context_keeps_the_output(gguf_files, method, window):
    engine = gguf_engine(gguf_files)
    for name in ("draft", "tree"):
        engine.proposers[name].context_window = window
    prompt = PROMPTS[6]  # 37 tokens
    params = SamplingParams(max_tokens=24)
    plain = engine.generate(prompt, params, SpeculativeConfig(method="none"))
    got = engine.generate(prompt, params, SpeculativeConfig(method=method, num_speculative_tokens=4))
    assert got.token_ids == plain.token_ids
    assert got.metrics.spec.num_draft_tokens > 0


def test_the_draft_sees_the_prompts_last_tokens_and_the_output(gguf_files):
    proposer = gguf_engine(gguf_files).proposers["draft"]
    proposer.context_window = 3
    request = DraftRequest([1, 2, 3, 4, 5], [6, 7], SamplingParams(), None)
    assert proposer.draft_context(request) == [3, 4, 5, 6, 7]
    proposer.propose(request, 2)
    assert proposer.cached_token_ids[:5] == [3, 4, 5, 6, 7]  # the cache starts at the window, not the prompt
    with pytest.raises(InvalidParameterError, match="draft_context_window"):
        DrafterOptions(draft_context_window=0)
