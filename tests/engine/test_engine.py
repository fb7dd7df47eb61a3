"""The generate loop: exactness against plain decoding, sampling distribution, stops, errors."""

import itertools

import pytest
import torch

from helpers import BigramRunner, CharTokenizer, chain_table, make_engine, sequence_distribution
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.errors import ContextLengthError, InvalidParameterError
from verispec.proposers.draft_model import DraftModelProposer

PROMPTS = [[5, 17, 33, 2, 9], [70, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY_40 = SamplingParams(max_tokens=40)


@pytest.fixture(scope="module")
def plain_outputs(target_model):
    engine = make_engine(target_model)
    return [engine.generate(p, GREEDY_40, SpeculativeConfig(method="none")).token_ids for p in PROMPTS]


@pytest.mark.parametrize("draft_kind", ["target", "random", "partial"])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_plain(
    draft_kind, k, target_model, random_draft_model, partial_draft_model, plain_outputs
):
    draft = {"target": target_model, "random": random_draft_model, "partial": partial_draft_model}[draft_kind]
    engine = make_engine(target_model, draft)
    for prompt, expected in zip(PROMPTS, plain_outputs):
        out = engine.generate(prompt, GREEDY_40, SpeculativeConfig(num_speculative_tokens=k, schedule="constant"))
        assert out.token_ids == expected
        rate = out.metrics.spec.acceptance_rate
        if draft_kind == "target":
            assert rate == 1.0  # the target drafting for itself is always right
        elif draft_kind == "random":
            assert rate < 0.1


def test_partial_draft_is_really_partial(target_model, partial_draft_model):
    engine = make_engine(target_model, partial_draft_model)
    stats = [
        engine.generate(p, GREEDY_40, SpeculativeConfig(num_speculative_tokens=2, schedule="constant")).metrics.spec
        for p in PROMPTS
    ]
    accepted = sum(s.num_accepted_tokens for s in stats) / sum(s.num_draft_tokens for s in stats)
    assert 0.15 < accepted < 0.9


def test_plain_decoding_matches_transformers_generate(target_model):
    engine = make_engine(target_model)
    prompt = PROMPTS[0]
    ours = engine.generate(prompt, SamplingParams(max_tokens=20), SpeculativeConfig(method="none")).token_ids
    with torch.no_grad():
        ref = target_model.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert ours == ref[0, len(prompt) :].tolist()


def test_speculative_counts_and_metrics(target_model):
    engine = make_engine(target_model, target_model)
    out = engine.generate(
        PROMPTS[0], SamplingParams(max_tokens=21), SpeculativeConfig(num_speculative_tokens=4, schedule="constant")
    )
    spec = out.metrics.spec
    # 1 token from prefill, then 4 steps of 4 accepted + 1 bonus = 21 tokens, 5 target forwards
    assert (len(out.token_ids), spec.num_drafts, spec.num_accepted_tokens, spec.num_bonus_tokens) == (21, 4, 16, 4)
    assert out.metrics.num_target_forwards == 5
    assert spec.mean_acceptance_length == 5.0
    assert out.finish_reason == "length"


def test_stream_chunks_concatenate_to_output(target_model, partial_draft_model):
    engine = make_engine(target_model, partial_draft_model)
    chunks = list(
        engine.stream(PROMPTS[1], GREEDY_40, SpeculativeConfig(num_speculative_tokens=3, schedule="constant"))
    )
    output = chunks[-1].output
    assert "".join(c.text for c in chunks) == output.text
    assert list(itertools.chain.from_iterable(c.token_ids for c in chunks)) == output.token_ids
    assert all(c.output is None for c in chunks[:-1])


# Bigram "models": token a is followed by b. EOS = 0. Text pieces chosen for stop strings.
PIECES = ["<eos>", "s", "E", "ND", "x", "y", "z", "w"]


def bigram_engine(next_of, draft_next_of=None, max_context_length=512):
    target = BigramRunner(chain_table(next_of, len(PIECES)), max_context_length)
    proposers = {}
    if draft_next_of is not None:
        proposers["draft"] = DraftModelProposer(BigramRunner(chain_table(draft_next_of, len(PIECES))))
    return SpeculativeEngine(target, CharTokenizer(PIECES), eos_token_ids=[0], proposers=proposers)


CHAIN = {1: 4, 4: 5, 5: 2, 2: 3, 3: 6, 6: 0}  # s -> x y E ND z <eos>


@pytest.mark.parametrize(
    "params, text, ids, reason",
    [
        (SamplingParams(), "xyENDz", [4, 5, 2, 3, 6], "stop"),  # EOS inside the accepted block
        (SamplingParams(stop=("END",)), "xy", [4, 5, 2, 3], "stop"),  # stop string over two tokens
        (SamplingParams(stop=("z", "yE")), "x", [4, 5, 2], "stop"),  # later-listed stop occurs first
        (SamplingParams(max_tokens=2), "xy", [4, 5], "length"),  # max_tokens < accepted block
    ],
)
def test_stops_inside_accepted_blocks(params, text, ids, reason):
    for method in ("none", "draft"):
        engine = bigram_engine(CHAIN, draft_next_of=CHAIN)
        out = engine.generate(
            [1], params, SpeculativeConfig(method=method, num_speculative_tokens=8, schedule="constant")
        )
        assert (out.text, out.token_ids, out.finish_reason) == (text, ids, reason), method
        if method == "draft":
            assert out.metrics.num_target_forwards == 2  # prefill + one verify pass covered the block


def test_context_window_ends_with_length():
    engine = bigram_engine({1: 4, 4: 4}, draft_next_of={1: 4, 4: 4}, max_context_length=6)
    for method in ("none", "draft"):
        out = engine.generate(
            [1, 1], SamplingParams(max_tokens=50), SpeculativeConfig(method=method, schedule="constant")
        )
        assert out.token_ids == [4, 4, 4, 4] and out.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, spec, error",
    [
        ([], SpeculativeConfig(method="none"), InvalidParameterError),  # empty prompt
        ([1] * 6, SpeculativeConfig(method="none"), ContextLengthError),  # prompt fills the window
        ([1], SpeculativeConfig(method="draft", schedule="constant"), InvalidParameterError),  # no drafter loaded
    ],
)
def test_request_errors(prompt, spec, error):
    engine = bigram_engine(CHAIN, max_context_length=6)
    with pytest.raises(error):
        engine.generate(prompt, SamplingParams(), spec)


@pytest.mark.parametrize("kwargs", [{"method": "magic"}, {"num_speculative_tokens": 0}, {"num_speculative_tokens": 65}])
def test_speculative_config_validation(kwargs):
    with pytest.raises(InvalidParameterError):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=3),  # coupled (the default)
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=3),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=3, sampling="rejection"),  # modified rejection sampling
    ],
)
def test_sampled_sequences_follow_target_distribution(params):
    """20,000 three-token samples through the whole loop (prefill + one 2-token draft), in both
    sampling modes: each gives the target's distribution whatever the draft."""
    target_table = torch.tensor(
        [[0.0, 1.0, 2.0, 0.5], [2.0, 0.0, 1.0, 1.5], [1.0, 1.0, 0.0, 2.0], [0.0, 2.0, 1.0, 0.0]]
    )
    draft_table = torch.tensor([[2.0, 0.0, 0.0, 1.0], [0.0, 2.0, 1.0, 0.0], [1.0, 0.0, 2.0, 0.0], [2.0, 1.0, 0.0, 1.0]])
    engine = SpeculativeEngine(
        BigramRunner(target_table),
        CharTokenizer("abcd"),
        eos_token_ids=[],
        proposers={"draft": DraftModelProposer(BigramRunner(draft_table))},
    )
    spec = SpeculativeConfig(num_speculative_tokens=4, schedule="constant")
    counts: dict = {}
    num_draws = 20000
    generator_params = params
    accepted = drafted = 0
    for seed in range(num_draws):
        out = engine.generate([0], SamplingParams(**{**generator_params.__dict__, "seed": seed}), spec)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        accepted += out.metrics.spec.num_accepted_tokens
        drafted += out.metrics.spec.num_draft_tokens
    exact = sequence_distribution(target_table, params, first=0, length=3)
    tv = 0.5 * sum(abs(counts.get(seq, 0) / num_draws - p) for seq, p in exact.items())
    # 64 outcomes, 20,000 draws: the expected TV from sampling noise alone is about 0.02.
    assert tv < 0.04, tv
    # The draft is a different distribution (so rejections and recoveries happened; coupling
    # accepts less than rejection sampling where the two differ this much: >= (1 - TV) / (1 + TV)) ...
    assert 0.05 < accepted / drafted < 0.9
    # ... and sampling the draft's sequences instead would fail the bound.
    draft_dist = sequence_distribution(draft_table, params, first=0, length=3)
    assert 0.5 * sum(abs(draft_dist[s] - exact[s]) for s in exact) > 0.2
