"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft): speculative == plain, greedy."""

import pytest

from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, SpeculativePipeline
from verispec.models.store import ModelStore


@pytest.fixture(scope="module")
def real_pipeline():
    store = ModelStore()  # the suite's own home, then the user's models folder (read only)
    missing = [name for name in (DEFAULT_TARGET, DEFAULT_DRAFT) if store.cache_state(name) == "missing"]
    if missing:  # the suite never downloads them: its home is thrown away at the end
        pytest.skip(f"not in the model cache: {', '.join(missing)} (verispec models fetch NAME)")
    return SpeculativePipeline.load(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="float32")


@pytest.mark.real_model
def test_real_pair_32_greedy_tokens_speculative_equals_plain(real_pipeline):
    params = SamplingParams(max_tokens=32)
    prompt = "def fibonacci(n):"
    plain = real_pipeline.generate(prompt, params, SpeculativeConfig(method="none"))
    speculative = real_pipeline.generate(prompt, params, SpeculativeConfig(method="draft", num_speculative_tokens=5))
    assert len(plain.token_ids) == 32 and plain.finish_reason == "length"
    assert speculative.token_ids == plain.token_ids
    assert speculative.text == plain.text
    spec = speculative.metrics.spec
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0  # the draft really drafted
    assert speculative.metrics.num_target_forwards < plain.metrics.num_target_forwards


@pytest.mark.real_model
def test_real_pair_chat_template_and_eos(real_pipeline):
    ids = real_pipeline.encode("Say hi", chat=True)
    text = real_pipeline.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert 151645 in real_pipeline.target.eos_token_ids  # <|im_end|> ends a chat turn
