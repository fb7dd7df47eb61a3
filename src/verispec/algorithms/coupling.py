"""Drafter-invariant sampling: Gumbel-max with counter-based noise keyed by (seed, position).

Owns the noise G(key, position, token id), the coupled sample ``argmax_v (score_v + G_v)`` and
chain and tree verification by coupling (Daliri, Musco, Suresh 2024, "Coupling without
Communication and Drafter-Invariant Speculative Decoding", arXiv 2408.07978, §4). The token at
each absolute position is a function of the target's processed row there and the key alone, so
plain decoding and every drafter emit the same tokens for a seed, and each token is an exact
sample of ``softmax(scores)`` (the Gumbel-max trick). Knows nothing about models, drafters,
batching or how the scores were processed (:mod:`verispec.algorithms.sampling` does that).

Reproducibility. The noise bits are two nested SplitMix64 streams (Steele, Lea, Flood 2014):
``row = mix64(mix64(key) + (position + 1) * GOLDEN)``, ``bits(v) = mix64(row + (v + 1) * GOLDEN)``,
all mod 2**64, integers only. The uniform is ``u = (2 * (bits >> 12) + 1) / 2**53`` (exact, in
(0, 1)) and ``G = -log(-log(u))``. The decision is made in plain Python on IEEE doubles with a
logarithm built from +, *, / and ``frexp`` (:func:`portable_log`), so it is bit-identical on
every host; torch only screens the vocabulary (its own log, within 1e-14 of the portable one) to
find the few tokens within :data:`SCREEN_MARGIN` of the best, which the exact path then decides.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from verispec.algorithms.tree import TokenTree, TreeVerifyResult
from verispec.algorithms.verify import VerifyResult

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 / golden ratio, odd
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's finalizer (Stafford's Mix13)
SCREEN_MARGIN = 1e-6  # nats; torch's float64 log is within ~1e-14 of portable_log on these inputs
# The noise's range: G(1 - 2**-53) - G(2**-53) = 36.737 + 3.604 < 40.35 nats. A token whose score is
# more than this below the best score can never win (the best-scored token's G is >= -3.604), so
# its noise is never computed: masked tokens (-inf: top-k, top-p, grammars) and the far tail.
GUMBEL_SPAN = 40.5
NOISE_CACHE_SIZE = 32  # noise vectors kept (drafter and verifier ask for the same positions)
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # ln 2 = HI + LO (fdlibm)


def _signed(value: int) -> int:
    """A uint64 as the int64 with the same bits (what a torch int64 tensor holds)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64(z: int) -> int:
    """SplitMix64's output function on a uint64 (Python int in [0, 2**64))."""
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def row_key(key: int, position: int) -> int:
    """The uint64 that seeds position ``position``'s noise: output ``position + 1`` of the
    SplitMix64 stream seeded ``mix64(key)``. ``key``: any int (taken mod 2**64); ``position`` >= 0."""
    return mix64((mix64(key & MASK64) + (position + 1) * GOLDEN) & MASK64)


def noise_bits(key: int, position: int, token_id: int) -> int:
    """The 52 noise bits of one token (exact Python arithmetic; the reference for :func:`noise_bits_vector`)."""
    return mix64((row_key(key, position) + (token_id + 1) * GOLDEN) & MASK64) >> 12


@functools.lru_cache(maxsize=4)
def _token_offsets(vocab_size: int) -> Tensor:
    """``[vocab_size]`` int64: ``(v + 1) * GOLDEN mod 2**64`` as int64 bits (read-only)."""
    return (torch.arange(1, vocab_size + 1, dtype=torch.int64) * _signed(GOLDEN)).contiguous()


def _shift_right(z: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 tensors holding uint64 bits."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def noise_bits_vector(key: int, position: int, vocab_size: int, token_ids: Tensor | None = None) -> Tensor:
    """:func:`noise_bits` for every token id (``[vocab_size]`` int64 in [0, 2**52)), or for the
    ``token_ids`` given (int64 ``[n]``: ``[n]`` int64, the same values as the full vector's there).

    int64 multiplication in torch wraps mod 2**64 (two's complement), which is the uint64
    arithmetic of SplitMix64; ``tests/algorithms/test_coupling.py`` checks it against the Python reference.
    """
    offsets = _token_offsets(vocab_size) if token_ids is None else (token_ids + 1) * _signed(GOLDEN)
    z = offsets + _signed(row_key(key, position))
    z = (z ^ _shift_right(z, 30)) * _signed(MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(MIX2)
    return _shift_right(z ^ _shift_right(z, 31), 12)


@functools.lru_cache(maxsize=NOISE_CACHE_SIZE)
def gumbel_noise(key: int, position: int, vocab_size: int) -> Tensor:
    """``[vocab_size]`` float64 Gumbel(0, 1) noise of one position with torch's logarithm: for
    screening and for drafters (within 1e-14 of :func:`exact_gumbel`). Cached; do not modify it."""
    return _gumbel_of_bits(noise_bits_vector(key, position, vocab_size))


def gumbel_noise_at(key: int, position: int, token_ids: Tensor) -> Tensor:
    """:func:`gumbel_noise` at ``token_ids`` (int64 ``[n]``) only: ``[n]`` float64, the same values."""
    return _gumbel_of_bits(noise_bits_vector(key, position, 0, token_ids))


def _gumbel_of_bits(bits: Tensor) -> Tensor:
    u = (bits * 2 + 1).double() * 2.0**-53
    return -torch.log(-torch.log(u))


def portable_log(x: float) -> float:
    """Natural log of a positive finite double from IEEE +, *, / and ``frexp`` only (identical on
    every host). ``x = m 2**e`` with m in [sqrt(1/2), sqrt(2)); ``log m = 2 atanh(s)``,
    ``s = (m - 1) / (m + 1)``, |s| <= 0.1716, series to s**23 (truncation < 1e-17); error < 5e-16
    relative. Raises ValueError for x <= 0."""
    if not x > 0:
        raise ValueError(f"portable_log needs x > 0, got {x}")
    m, e = math.frexp(x)
    if m < 0.7071067811865476:
        m, e = m * 2.0, e - 1
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    series = 0.0
    for k in range(11, 0, -1):  # 1/3 s2 + 1/5 s2**2 + ... + 1/23 s2**11, Horner
        series = (series + 1.0 / (2 * k + 1)) * s2
    return e * _LN2_HI + (e * _LN2_LO + 2.0 * s * (1.0 + series))


def exact_gumbel(key: int, position: int, token_id: int) -> float:
    """G(key, position, token_id) = -log(-log(u)), portable (the value every decision uses)."""
    u = (2 * noise_bits(key, position, token_id) + 1) * 2.0**-53
    return -portable_log(-portable_log(u))


def coupled_sample(scores: Tensor, key: int, position: int) -> int:
    """The coupled sample at one position: ``argmax_v (scores[v] + G(key, position, v))``.

    Args:
        scores: ``[vocab]`` float (any float dtype): log-probabilities up to a constant, e.g.
            logits after temperature, with -inf for tokens top-k / top-p / masks removed.
        key: the request's key (its seed); ``position``: the token's absolute position (>= 0).
    Returns:
        The token id, distributed as ``softmax(scores)`` over keys (Gumbel-max); ties (never seen
        in practice) go to the lowest id.
    Raises:
        ValueError: every score is -inf (nothing to sample).
    Source: Daliri, Musco, Suresh 2024 (arXiv 2408.07978), §4, Gumbel-max coupling.
    """
    return int(coupled_argmax(scores.reshape(1, -1), key, [position])[0])


def coupled_argmax(scores: Tensor, key: int, positions: Sequence[int]) -> Tensor:
    """:func:`coupled_sample` for several rows: ``scores`` ``[num_rows, vocab]``, row i at
    ``positions[i]`` (rows at one position share its noise). Returns ``[num_rows]`` int64."""
    if scores.shape[0] != len(positions):
        raise ValueError(f"{scores.shape[0]} score rows for {len(positions)} positions")
    scores64 = scores.double()
    chosen = []
    for row, position in enumerate(positions):
        top = float(scores64[row].max())
        if top == float("-inf") or math.isnan(top):
            raise ValueError(f"row {row}: no token has a finite score (all masked or NaN), nothing to sample")
        candidates = torch.nonzero(scores64[row] >= top - GUMBEL_SPAN).flatten()  # the others never win
        screened = scores64[row, candidates] + gumbel_noise_at(key, position, candidates)
        best = float(screened.max())
        finalists = candidates[screened >= best - SCREEN_MARGIN].tolist()
        exact = [(float(scores64[row, v]) + exact_gumbel(key, position, v), -v) for v in finalists]
        chosen.append(-max(exact)[1])
    return torch.tensor(chosen, dtype=torch.long)


def coupled_verify_chain(draft_token_ids: Sequence[int], target_token_at: Callable[[int], int]) -> VerifyResult:
    """Chain verification by coupling: accept draft token i while it equals the target's
    coupled sample after the first i draft tokens; at the first difference emit the target's
    token; after a fully accepted draft, the bonus token the same way.

    ``target_token_at(i)``: the target's coupled sample from row i (``0 <= i <= k``); rows past
    the first difference are never asked for (each costs a noise vector over the vocabulary).
    The emitted tokens are exactly plain coupled decoding's, whatever the draft.
    Source: Daliri, Musco, Suresh 2024 (arXiv 2408.07978), §4 (drafter-invariant decoding).
    """
    accepted = []
    for draft_token in draft_token_ids:
        target_token = int(target_token_at(len(accepted)))
        if target_token != int(draft_token):
            return VerifyResult(len(accepted), accepted + [target_token], is_bonus=False)
        accepted.append(target_token)
    return VerifyResult(len(accepted), accepted + [int(target_token_at(len(accepted)))], is_bonus=True)


def coupled_tree_verify(tree: TokenTree, target_token_at: Callable[[int], int]) -> TreeVerifyResult:
    """Tree verification by coupling: from the root, move to the child whose token equals the
    target's coupled sample from the current node's row; stop at a node without one and emit
    the target's token. ``target_token_at(node)``: that sample (asked only along the path).
    Rowan, Phan, Khisti 2025 (arXiv 2506.05632) show Gumbel-max keeps drafter invariance with
    several drafts per position; this is its per-node form."""
    node, accepted = 0, []
    while True:
        wanted = int(target_token_at(node))
        match = next((c for c in tree.children(node) if tree.token_ids[c] == wanted), None)
        if match is None:
            return TreeVerifyResult(accepted, [tree.token_ids[c] for c in accepted] + [wanted])
        accepted.append(match)
        node = match
