"""Coupled (Gumbel-max) sampling: the noise, its distribution, and drafter invariance of the verifier.

Chi-square tests use hand-computed statistics against critical values at p = 0.001 (scipy is not
a dependency): df 5 -> 20.515, df 15 -> 37.697 (any statistics table). Each test also shows it can
fail: the same statistic against a wrong distribution is far above the critical value.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from verispec.algorithms import coupling
from verispec.algorithms.coupling import (
    GOLDEN,
    MASK64,
    coupled_argmax,
    coupled_sample,
    coupled_tree_verify,
    coupled_verify_chain,
    exact_gumbel,
    gumbel_noise,
    mix64,
    noise_bits,
    noise_bits_vector,
    portable_log,
)
from verispec.algorithms.draft import DraftOutput
from verispec.algorithms.sampling import SamplingParams, logits_to_probs, process_logits
from verispec.algorithms.step import pick_token, verify_chain, verify_tree
from verispec.algorithms.tree import TokenTree
from verispec.algorithms.verify import rejection_sample

CHI2_DF5_P001, CHI2_DF15_P001 = 20.515, 37.697


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_splitmix64_matches_published_outputs():
    # SplitMix64 seeded 0: first outputs 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4 (Vigna's reference)
    assert mix64(GOLDEN) == 0xE220A8397B1DCDAF
    assert mix64((2 * GOLDEN) & MASK64) == 0x6E789E6AA1B965F4


@pytest.mark.parametrize(
    "key, position, vocab",
    [
        (0, 0, 1000),  # the smallest key and position
        (11, 5, 4096),  # a seed as a user gives it
        (2**64 - 1, 10**9, 151936),  # the largest key, a far position, Qwen's vocabulary
        (2**63, 123, 32000),  # the sign bit alone: int64 wrap-around in torch
    ],
)
def test_torch_noise_bits_equal_the_python_reference(key, position, vocab):
    bits = noise_bits_vector(key, position, vocab)
    ids = sorted(set(range(0, vocab, max(1, vocab // 500))) | {vocab - 1})
    assert [int(bits[i]) for i in ids] == [noise_bits(key, position, i) for i in ids]
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**52


def test_noise_values_are_pinned():
    # a change of generator changes every seeded output: it must be deliberate
    assert [noise_bits(0, 0, 0), noise_bits(11, 5, 7), noise_bits(2**64 - 1, 10**9, 151935)] == [
        2938366760112535,
        3173912344064199,
        2486878285535807,
    ]


@pytest.mark.parametrize("x", [1e-16, 2.0**-53, 1e-5, 0.5, 0.7071067811865476, 1.0, 1.0 + 2**-52, 2.0, 36.7, 1e300])
def test_portable_log_is_within_a_few_ulp_of_libm(x):
    assert portable_log(x) == pytest.approx(math.log(x), rel=5e-16, abs=5e-16)


def test_screen_noise_is_within_the_margin_of_the_exact_noise():
    noise = gumbel_noise(7, 3, 2000)
    worst = max(abs(float(noise[v]) - exact_gumbel(7, 3, v)) for v in range(2000))
    assert worst < coupling.SCREEN_MARGIN / 1000


def test_same_key_and_position_same_token_and_masked_tokens_never_win():
    scores = torch.tensor([0.0, float("-inf"), 1.0, float("-inf"), 0.5])
    tokens = [coupled_sample(scores, key, 0) for key in range(300)]
    assert tokens == [coupled_sample(scores, key, 0) for key in range(300)]  # deterministic
    assert set(tokens) == {0, 2, 4}  # -inf (top-k / top-p / grammar) never sampled
    with pytest.raises(ValueError):
        coupled_sample(torch.full((3,), float("-inf")), 0, 0)


def test_coupled_sample_is_distributed_as_softmax_of_the_scores():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    params = SamplingParams(temperature=0.8)
    rows = process_logits(logits, params, [1, 2], [])
    counts = torch.zeros(6)
    for key in range(3000):
        counts[pick_token(rows, torch.Generator().manual_seed(key), position=17)] += 1
    target_probs = logits_to_probs(logits, params)[0]
    assert chi_square(counts, target_probs) < CHI2_DF5_P001
    assert chi_square(counts, torch.full((6,), 1 / 6)) > 5 * CHI2_DF5_P001  # the test can fail


def test_positions_are_independent():
    """Uniform scores over 4 tokens: the pair (token at t, token at t + 1) is uniform over 16 cells."""
    scores = torch.zeros(4)
    counts = torch.zeros(16)
    for key in range(200):
        tokens = [coupled_sample(scores, key, t) for t in range(21)]
        for a, b in itertools.pairwise(tokens):
            counts[4 * a + b] += 1
    assert chi_square(counts, torch.full((16,), 1 / 16)) < CHI2_DF15_P001


def test_rejection_mode_first_token_is_distributed_as_the_target():
    draft_probs = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05])
    target_probs = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.1, 0.1])
    rows = torch.stack([target_probs, torch.full((6,), 1 / 6)])
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(6)
    for _ in range(4000):
        x = int(torch.multinomial(draft_probs, 1, generator=generator))
        counts[rejection_sample([x], draft_probs[None], rows, generator).token_ids[0]] += 1
    assert chi_square(counts, target_probs) < CHI2_DF5_P001
    assert chi_square(counts, draft_probs) > 5 * CHI2_DF5_P001  # the test can fail


@pytest.mark.parametrize(
    "draft, targets, accepted, tokens, bonus",
    [
        ([5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8], True),  # all accepted, bonus is row 3's sample
        ([5, 9, 7], [5, 6, 7, 8], 1, [5, 6], False),  # differs at 1: the target's sample there
        ([9], [5, 6], 0, [5], False),  # first token differs
        ([], [4], 0, [4], True),  # no draft: plain decoding's token
    ],
)
def test_coupled_verify_chain(draft, targets, accepted, tokens, bonus):
    asked = []
    result = coupled_verify_chain(draft, lambda i: asked.append(i) or targets[i])
    assert (result.num_accepted_tokens, result.token_ids, result.is_bonus) == (accepted, tokens, bonus)
    assert asked == list(range(len(tokens)))  # rows past the first difference are never computed


@pytest.mark.parametrize(
    "targets, accepted, tokens",
    [
        ({0: 2, 2: 4, 4: 9}, [2, 4], [2, 4, 9]),  # second child of the root, then its child, then the target's
        ({0: 7}, [], [7]),  # no child matches: the target's sample
        ({0: 1, 1: 3, 3: 8}, [1, 3], [1, 3, 8]),  # the first branch to its leaf, then the bonus
    ],
)
def test_coupled_tree_verify(targets, accepted, tokens):
    # root 0 -> nodes 1 (token 1), 2 (token 2); 1 -> 3 (token 3); 2 -> 4 (token 4)
    tree = TokenTree((0, 1, 2, 3, 4), (-1, 0, 0, 1, 2))
    result = coupled_tree_verify(tree, lambda node: targets[node])
    assert (result.accepted_nodes, result.token_ids) == (accepted, tokens)


VOCAB = 12


def toy_logits(context: list[int]) -> torch.Tensor:
    """A deterministic toy target: ``[1, VOCAB]`` float32 logits from the context alone."""
    generator = torch.Generator().manual_seed(hash(tuple(context)) % 2**63)
    return torch.randn(1, VOCAB, generator=generator) * 2


def plain_decode(prompt: list[int], params: SamplingParams, seed: int, num_tokens: int) -> list[int]:
    out = []
    for _ in range(num_tokens):
        rows = process_logits(toy_logits(prompt + out), params, prompt, out)
        out.append(pick_token(rows, torch.Generator().manual_seed(seed), len(prompt) + len(out)))
    return out


def drafts(kind: str, prompt: list[int], out: list[int], plain: list[int], step: int) -> list[int]:
    k = 1 + step % 4  # the draft length changes from step to step, as under the cost schedule
    truth = plain[len(out) : len(out) + k]
    if kind == "target":  # the target itself: all accepted
        return truth
    if kind == "random":  # nothing accepted (almost)
        return [(7 * step + i) % VOCAB for i in range(k)]
    return [t if i != 1 else (t + 1) % VOCAB for i, t in enumerate(truth)]  # an oracle with an error at 1


@pytest.mark.parametrize("kind", ["target", "random", "oracle"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.3, presence_penalty=0.5),
    ],
)
def test_chain_speculation_gives_plain_coupled_tokens_whatever_the_drafter(kind, params):
    prompt, seed, num_tokens = [3, 1, 4], 11, 24
    plain = plain_decode(prompt, params, seed, num_tokens)
    assert plain != plain_decode(prompt, params, seed + 1, num_tokens)  # the seed matters
    out, step = [], 0
    while len(out) < num_tokens:
        draft = drafts(kind, prompt, out, plain, step)
        logits = torch.cat([toy_logits(prompt + out + draft[:i]) for i in range(len(draft) + 1)])
        result, _ = verify_chain(logits, DraftOutput(draft), params, prompt, out, torch.Generator().manual_seed(seed))
        out += result.token_ids
        step += 1
    assert out[:num_tokens] == plain


def test_tree_speculation_gives_plain_coupled_tokens():
    params, prompt, seed = SamplingParams(temperature=1.0, repetition_penalty=1.2), [2, 7], 3
    plain = plain_decode(prompt, params, seed, 16)
    out = []
    while len(out) < 16:
        paths = [plain[len(out) : len(out) + 3], [(plain[len(out)] + 1) % VOCAB, 0]]  # a right and a wrong branch
        tree = TokenTree.from_paths(prompt[-1] if not out else out[-1], paths)
        paths = [[tree.token_ids[j] for j in tree.path_to(i)] for i in range(tree.num_nodes)]
        logits = torch.cat([toy_logits(prompt + out + path) for path in paths])
        result, _ = verify_tree(tree, logits, params, prompt, out, torch.Generator().manual_seed(seed))
        out += result.token_ids
    assert out[:16] == plain


def test_coupled_argmax_rows_share_the_noise_of_their_position():
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = coupled_argmax(scores, 9, [4, 5, 4])
    assert rows.tolist() == [coupled_sample(scores[i], 9, p) for i, p in enumerate([4, 5, 4])]


def test_rejection_mode_is_kept_and_unknown_modes_refused():
    rows = process_logits(torch.zeros(1, 4), SamplingParams(temperature=1.0, sampling="rejection"), [1], [])
    assert rows.scores is None and rows.probs is not None
    with pytest.raises(Exception, match="sampling must be one of"):
        SamplingParams(temperature=1.0, sampling="gumbel")


def test_tokens_far_below_the_best_are_skipped_without_changing_a_sample(monkeypatch):
    # scores spread over ~120 nats: most tokens lie more than GUMBEL_SPAN below the best and get
    # no noise; every sample still equals the argmax over the whole vocabulary's noise
    from verispec.algorithms import coupling

    scores = torch.randn(3000, generator=torch.Generator().manual_seed(5)) * 20.0
    scores[7] = float("-inf")
    full = [torch.argmax(scores.double() + coupling.gumbel_noise(key, 9, 3000)).item() for key in range(200)]
    computed = []
    real_bits = coupling.noise_bits_vector

    def counting_bits(key, position, vocab_size, token_ids=None):
        bits = real_bits(key, position, vocab_size, token_ids)
        computed.append(bits.numel())
        return bits

    monkeypatch.setattr(coupling, "noise_bits_vector", counting_bits)
    assert [coupling.coupled_sample(scores, key, 9) for key in range(200)] == full
    assert len(computed) == 200 and max(computed) == int((scores >= scores.max() - coupling.GUMBEL_SPAN).sum()) < 1500
