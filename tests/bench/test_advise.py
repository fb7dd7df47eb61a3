"""The advisor's formulas on known values (Leviathan et al. 2023, §3.3-3.4) and its verdicts."""

from types import SimpleNamespace

import pytest
import torch

from helpers import BigramRunner
from verispec.bench.advise import (
    DrafterFit,
    best_speedup,
    break_even_alpha,
    equivalent_settings,
    expected_speedup,
    iid_acceptance_rate,
    linear_step_costs,
    measure_verify_curve,
    verdict,
)
from verispec.bench.advise_cost import cost_estimate, cost_per_million_tokens, tokens_per_s_with_cache
from verispec.bench.advise_memory import kv_cache_bytes, memory_advice


@pytest.mark.parametrize(
    "alpha, c, best_k, speedup",
    [
        (0.8, 0.05, 8, 3.09),  # the paper's regime: cheap draft, good agreement
        (0.6, 0.05, 4, 1.92),
        (0.8, 0.0, 20, 4.954),  # free draft: the longest draft allowed wins, 1/(1-α) = 5 is the limit
        (0.3, 0.5, 0, 1.0),  # α < c: no draft length pays, plain decoding (k = 0)
        (1.0, 0.1, 20, 21 / 3.0),  # always accepted: k + 1 tokens for k c + 1
    ],
)
def test_best_k_and_speedup_for_linear_costs(alpha, c, best_k, speedup):
    k, value = best_speedup(alpha, linear_step_costs(c, 20))
    assert k == best_k
    assert value == pytest.approx(speedup, abs=0.005)


@pytest.mark.parametrize("c", [0.01, 0.05, 0.3, 0.9])
def test_break_even_alpha_is_c_for_linear_costs(c):
    assert break_even_alpha(linear_step_costs(c, 12)) == pytest.approx(c, abs=1e-5)


def test_break_even_alpha_on_a_measured_curve_matches_brute_force():
    costs = [1.0, 1.2, 1.2, 1.25, 1.3]  # verification nearly flat in k (bf16 CPU table in MODELS.md)
    grid = [a / 10000 for a in range(10001)]
    brute = next(a for a in grid if best_speedup(a, costs)[0] > 0)
    assert break_even_alpha(costs) == pytest.approx(brute, abs=2e-4)
    assert break_even_alpha([1.0, 2.5, 3.6]) == 1.0  # even α = 1 (2 tokens for 2.5) never pays


@pytest.mark.parametrize(
    "alpha, k, costs, coverage, expected",
    [
        (0.8, 8, linear_step_costs(0.05, 8), 1.0, (1 - 0.8**9) / (0.2 * 1.4)),  # Eq. 1 over k c + 1
        (1.0, 1, [1.0, 1.0], 0.5, 1.5),  # half the steps draft 1 free token, always accepted
        (0.5, 2, [1.0, 1.5, 2.0], 0.0, 1.0),  # never drafts: plain decoding
    ],
)
def test_expected_speedup(alpha, k, costs, coverage, expected):
    assert expected_speedup(alpha, k, costs, coverage) == pytest.approx(expected)


@pytest.mark.parametrize(
    "accepted, rejections, expected",
    [(6, 2, 0.75), (0, 3, 0.0), (5, 0, 1.0), (0, 0, None)],  # judged tokens only
)
def test_iid_acceptance_rate(accepted, rejections, expected):
    assert iid_acceptance_rate(accepted, rejections) == expected


def test_kv_cache_bytes_of_the_real_pair():
    qwen_1_5b = SimpleNamespace(num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, hidden_size=1536)
    qwen_0_5b = SimpleNamespace(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896)
    assert kv_cache_bytes(qwen_1_5b, 4096, 2) == 2 * 28 * 2 * 128 * 4096 * 2  # 112 MiB in bf16
    assert kv_cache_bytes(qwen_0_5b, 4096, 2) == 2 * 24 * 2 * 64 * 4096 * 2


def test_memory_advice_budget_and_overhead():
    config = SimpleNamespace(
        num_hidden_layers=1, num_attention_heads=1, hidden_size=4
    )  # KV = 2 * 1 * 1 * 4 * 10 * 1 = 80 bytes
    memory = memory_advice(config, config, 920, 120, context_length=10, bytes_per_element=1, budget_bytes=1100)
    assert memory["total_bytes"] == 920 + 80 + 120 + 80
    assert memory["draft_overhead_pct"] == pytest.approx(20.0)
    assert (memory["fits"], memory["fits_without_draft"]) == (False, True)


def test_kv_geometry_of_a_gguf_runner_comes_from_the_header(tmp_path):
    from gguf_models import write_gguf_model
    from verispec.bench.advise_memory import kv_geometry

    path = write_gguf_model(tmp_path / "m.gguf", num_layers=2, heads=4, kv_heads=2)  # hidden 256: head_dim 64
    loaded = SimpleNamespace(model=None, path=path)
    config, element = kv_geometry(loaded, "gguf")
    assert element == 4 and kv_cache_bytes(config, 10, element) == 2 * 2 * 2 * 64 * 10 * 4  # float32 KV
    assert kv_geometry(loaded, "llamacpp")[1] == 2  # llama.cpp keeps float16


@pytest.mark.parametrize(
    "per_month, tokens_per_s, expected",
    [(1000.0, 10.0, 1000 / 25.92), (2592.0, 1000.0, 1.0), (100.0, 0.0, None)],
)
def test_cost_per_million_tokens(per_month, tokens_per_s, expected):
    value = cost_per_million_tokens(per_month, tokens_per_s)
    assert value == (pytest.approx(expected) if expected is not None else None)


def test_equivalent_settings():
    draft = equivalent_settings("draft", 4, "/models/draft.gguf")
    assert draft["vllm"] == {"method": "draft_model", "model": "/models/draft.gguf", "num_speculative_tokens": 4}
    assert draft["transformers"]["assistant_generation_config"]["num_assistant_tokens"] == 4
    ngram = equivalent_settings("ngram", 6, None, 2, 4)
    assert ngram["vllm"] == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    assert ngram["transformers"] == {"prompt_lookup_num_tokens": 6, "max_matching_ngram_size": 4}
    assert equivalent_settings("layer-skip", 3, None) == {"transformers": None, "vllm": None}


def fit(method, measured, predicted=1.5, best_k=4, alpha=0.7):
    return DrafterFit(method, "c", alpha, 1.0, 0.1, 4, 2.0, best_k, predicted, 0.1, measured)


@pytest.mark.parametrize(
    "fits, decision, method",
    [
        ([fit("draft", 1.4), fit("ngram", 1.8)], "GO", "draft"),  # a model drafter that pays wins
        ([fit("draft", 0.8), fit("ngram", 1.3)], "GO with n-gram only", "ngram"),
        ([fit("draft", 0.8), fit("ngram", 1.02)], "NO-GO", None),  # +2 % is noise
        ([fit("draft", 1.08, predicted=1.0, best_k=0)], "NO-GO", None),  # α < break-even: the gain is noise
        ([fit("draft", None, predicted=1.5)], "GO", "draft"),  # nothing measured: the prediction decides
        ([fit("draft", None, predicted=1.02)], "NO-GO", None),
        ([fit("ngram", 1.0, None, None, alpha=None)], "NO-GO", None),  # never drafted
        ([], "NO-GO", None),
    ],
)
def test_verdict(fits, decision, method):
    v = verdict("c", fits)
    assert (v.decision, v.method) == (decision, method)
    assert v.reason


def test_measure_verify_curve_times_each_length_and_empties_the_cache():
    runner = BigramRunner(torch.zeros(8, 8), max_context_length=12)
    curve = measure_verify_curve(runner, [1, 2, 3], lengths=(0, 1, 4, 16), repeats=2)
    assert list(curve) == [0, 1, 4]  # 16 does not fit a 12-token context
    assert all(seconds >= 0 for seconds in curve.values())
    assert runner.num_cached_tokens == 0


def test_memory_advice_prices_an_eagle_head():
    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=1, hidden_size=4)  # target KV: 80 bytes
    memory = memory_advice(
        config, None, 920, 0, context_length=10, bytes_per_element=1, budget_bytes=None, head_param_bytes=60, head_kv=40
    )
    assert memory["total_bytes"] == 920 + 80 + 60 + 40
    assert memory["head_overhead_pct"] == pytest.approx(10.0) and memory["head_within_limit"] is True
    over = memory_advice(
        config, None, 920, 0, context_length=10, bytes_per_element=1, budget_bytes=None, head_param_bytes=61, head_kv=40
    )
    assert over["head_within_limit"] is False
    plain = memory_advice(config, None, 920, 0, context_length=10, bytes_per_element=1, budget_bytes=None)
    assert plain["head_overhead_pct"] is None and plain["head_within_limit"] is None


def test_head_bytes_count_its_own_weights_and_one_layer_of_kv():
    from helpers import tiny_qwen2
    from verispec.bench.advise_memory import head_kv_bytes
    from verispec.runners.eagle.blocks import head_nbytes, quantize_head_
    from verispec.runners.eagle.head import EagleHead

    target = tiny_qwen2(0)
    head = EagleHead.from_target(target, draft_token_ids=torch.arange(64), seed=0)
    own = sum(p.numel() * 4 for p in head.parameters()) + sum(
        b.numel() * b.element_size() for b in head.buffers()
    )  # d2t, RoPE
    assert head_nbytes(head) == own  # the borrowed target embedding is not counted
    assert own < sum(p.numel() * 4 for p in target.parameters())
    quantize_head_(head, "q8_0")
    assert 0 < head_nbytes(head) < own  # 8.5 bits per weight in the blocks, norms stay float32
    shape = head.shape
    assert head_kv_bytes(head, 100) == 2 * shape.num_key_value_heads * shape.head_dim * 100 * 4


def summary_row(total_tokens_per_s, ttft_ms, tpot_ms, output_tokens):
    return SimpleNamespace(
        total_tokens_per_s=total_tokens_per_s, ttft_ms=ttft_ms, tpot_ms=tpot_ms, output_tokens=output_tokens
    )


def test_cached_prompt_share_cuts_only_the_prefill():
    # 1 s of prefill, 63 x 50 ms of decoding (4.15 s): 64 tokens in 4.15 s measured as 15.42 tok/s
    row = summary_row(15.42, 1000.0, 50.0, 64.0)
    assert tokens_per_s_with_cache(row, 0.0) == 15.42  # nothing cached: the measured figure
    # 90 % of the prompt cached: 0.1 s of prefill + 3.15 s of decoding
    assert tokens_per_s_with_cache(row, 0.9) == pytest.approx(15.42 * 4.15 / 3.25)
    assert tokens_per_s_with_cache(summary_row(15.42, None, 50.0, 64.0), 0.5) is None


def test_cost_estimate_with_the_prefix_cache():
    plain, chosen = summary_row(10.0, 2000.0, 100.0, 21.0), summary_row(20.0, 2000.0, 40.0, 21.0)
    cost = cost_estimate(3000.0, "draft", plain, chosen, 0.5)
    assert cost["plain_tokens_per_s"] == pytest.approx(10.0 * 4.0 / 3.0)  # 2 + 2 s -> 1 + 2 s
    assert cost["chosen_tokens_per_s"] == pytest.approx(20.0 * 2.8 / 1.8)  # 2 + 0.8 s -> 1 + 0.8 s
    assert cost["after_per_million_tokens"] == pytest.approx(cost_per_million_tokens(3000.0, 20.0 * 2.8 / 1.8))
    assert cost_estimate(3000.0, None, plain, None)["chosen_tokens_per_s"] == 10.0
