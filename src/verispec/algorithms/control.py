"""Draft-length control: how many tokens to draft in the next step.

Owns the expected-speedup model of Leviathan et al. 2023 (§3.3, §3.4), the online estimates it
feeds on (acceptance rate, draft cost per token, target cost of verifying k tokens); the
schedules users choose between live in :mod:`verispec.algorithms.schedules`. Knows nothing about
models, drafters or tokens: it sees counts and seconds.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

OUTPUT_LENGTH_HISTORY = (
    16  # finished requests whose output lengths predict the next one's (a short memory: workloads shift)
)
CATCH_UP_MIN_ROWS = 4  # a model drafter feeding at least this many unseen tokens is catching up
PLAIN_STEP_WINDOW = 256  # plain passes averaged into the plain step, the unit of every cost (see CostModel)


def expected_tokens(alpha: float, num_speculative_tokens: int) -> float:
    """Expected tokens emitted by one target pass over ``k`` drafted tokens.

    Each drafted token is accepted independently with probability ``alpha`` (in [0, 1]) and the
    pass always adds one target token: ``E = (1 - alpha^(k+1)) / (1 - alpha)``, ``k + 1`` at
    ``alpha = 1``. (Leviathan et al. 2023, §3.3, Eq. 1.)
    """
    k = num_speculative_tokens
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_draft_length(alpha: float, step_costs: Sequence[float]) -> tuple[int, float]:
    """The k in ``0 .. len(step_costs) - 1`` maximising ``expected_tokens(alpha, k) / step_costs[k]``.

    ``step_costs[k]`` is the time of one step that drafts k tokens and verifies them
    (``cost_draft(k) + cost_verify(k)``) in units of one plain decoding step, so
    ``step_costs[0]`` is 1 and the maximum is the expected speedup over plain decoding
    (Leviathan et al. 2023, §3.4, Theorem 3.8 for ``cost(k) = k c + 1``). k = 0 wins when no
    draft length beats plain decoding; ties go to the smaller k. Returns ``(k, speedup)``.
    """
    best_k, best = 0, expected_tokens(alpha, 0) / step_costs[0]
    for k in range(1, len(step_costs)):
        speedup = expected_tokens(alpha, k) / step_costs[k]
        if speedup > best:
            best_k, best = k, speedup
    return best_k, best


def catch_up_pays(speedup: float, remaining_tokens: float, catch_up_cost: float) -> bool:
    """Whether a drafter that must first catch up (feed context it has not seen) is worth it.

    Drafting the ``remaining_tokens`` at ``speedup`` (expected tokens per plain-step cost, the
    schedule's prediction) takes ``remaining_tokens / speedup`` plain steps instead of
    ``remaining_tokens``; it pays when that saving exceeds ``catch_up_cost`` (plain steps).
    ``remaining_tokens`` are the tokens the drafter's own steps are expected to emit (the
    policy scales the rest of the answer by the drafter's measured ``coverage``). An
    investment rule on top of Leviathan et al. 2023's per-step model (§3.4), which prices a
    steady step only: on a short answer the draft's prefill costs more than its steps save.
    """
    return speedup > 1.0 and remaining_tokens * (1.0 - 1.0 / speedup) > catch_up_cost


def interpolate(points: dict[int, float], k: int) -> float:
    """Value at ``k`` of the piecewise-linear curve through ``points`` (at least one).

    Below the first point: the first value. Past the last: the slope of the last two points,
    never negative (verify cost does not fall with more tokens); flat with a single point.
    """
    xs = sorted(points)
    if k <= xs[0]:
        return points[xs[0]]
    for lo, hi in itertools.pairwise(xs):
        if k <= hi:
            return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)
    last = xs[-1]
    if len(xs) == 1:
        return points[last]
    before = xs[-2]
    slope = max(0.0, (points[last] - points[before]) / (last - before))
    return points[last] + slope * (k - last)


@dataclass(frozen=True)
class ControllerConfig:
    """Knobs of the online estimates and of switching speculation off.

    Attributes:
        alpha_prior: acceptance rate assumed before a drafter's first draft on an engine.
        alpha_weight: weight of one tested draft token in the acceptance EWMA (0, 1]. 0.1 (was
            0.2): replaying the schedule on the default draft's real agreement with the target's
            answers (`scripts/draft_length_sim.py`; 10 HumanEval and 104 Spec-Bench answers, the
            draft seeing 64 prompt tokens; an estimate for three measured AVX2 cost curves, the
            catch-up pricing left out) gave 1.894 / 1.463 / 1.832 vs 1.833 / 1.470 / 1.798
            plain-step speedup on HumanEval, 1.547 / 1.272 / 1.496 vs 1.515 / 1.248 / 1.464 on
            Spec-Bench: at 0.2 a few rejections in a row push the estimate below the switch-off
            point and the request decodes plain until the next probe (Spec-Bench qa, calm
            costs: 1.191 at 0.2, 1.441 at 0.1).
        tree_weight: weight of one verified tree in a tree drafter's accepted-length EWMAs
            (:class:`verispec.algorithms.schedules.TreeAcceptance`) (0, 1].
        carried_alpha_weight: weight of one tested draft token in the acceptance a new request
            starts from (:meth:`CostModel.record_acceptance`: an EWMA across requests), (0, 1].
            Small, so that the last few tokens of a short answer do not decide it: in a HumanEval
            bench (the methods interleaved on one engine) a 13-token answer left the per-request
            estimate at 0.564, the next two requests began priced at that, the catch-up pricing
            declined the draft's prefill at every step, and both 128-token answers decoded plain
            (alone, the same draft accepted 69 and 67 tokens on them).
        cost_weight: weight of one timing in the cost EWMAs (0, 1].
        probe_interval: after this many switched-off steps, draft ``probe_length`` tokens once.
        probe_length: tokens drafted by a probe.
        price_catch_up: the ``cost`` schedule also prices a model drafter's catch-up (its
            prefill at a request's first proposal) against the rest of the answer
            (:func:`catch_up_pays`); False: steady steps only, as before.
        lookups_against_models: ``auto``'s lookup drafter sits a step out when a model drafter
            behind it has realised more than the lookup's draft is predicted to give
            (:meth:`verispec.engine.policy.DraftPolicy.draft`); False: a lookup drafts whenever
            it beats plain decoding, as before.
        confident_chains: under the ``cost`` schedule a model drafter's chain that drafts at all
            is asked for up to ``num_speculative_tokens`` and stops where its own probabilities
            say another token no longer pays (:func:`verispec.algorithms.schedules.chain_continues`);
            False: the schedule's length, as before.
    """

    alpha_prior: float = 0.6
    alpha_weight: float = 0.1
    tree_weight: float = 0.2
    carried_alpha_weight: float = 0.02
    cost_weight: float = 0.3
    probe_interval: int = 16
    probe_length: int = 1
    price_catch_up: bool = True
    lookups_against_models: bool = True
    confident_chains: bool = True


class AcceptanceEstimate:
    """Exponentially weighted per-token acceptance rate of one drafter in one request.

    A draft of k tokens with n accepted tested ``n + 1`` tokens when ``n < k`` (n successes,
    one failure) and k when all were accepted: later tokens were never judged, so counting them
    as rejected would bias the estimate down for long drafts.
    """

    def __init__(self, prior: float, weight: float) -> None:
        self.alpha = prior
        self.weight = weight

    def update(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        outcomes = [1.0] * num_accepted_tokens + ([0.0] if num_accepted_tokens < num_draft_tokens else [])
        for outcome in outcomes:
            self.alpha += self.weight * (outcome - self.alpha)


@dataclass
class CostModel:
    """What one engine has measured, shared by its requests: step costs in seconds (EWMA).

    ``verify_s[k]``: target pass over the pending token and k drafted ones (k = 0 is a plain
    step: the mean of the last :data:`PLAIN_STEP_WINDOW` plain passes, not an EWMA of the
    last few; see :meth:`record_verify`). ``draft_token_s[name]``: one drafted token of drafter
    ``name``; ``draft_ratio[name]``: the same relative to the target pass of the same step (what
    :meth:`step_costs` prefers, as load on a shared machine changes). Costs are properties of the
    runners and the machine, so they carry across requests. ``last_alpha[name]``: the
    acceptance a new request's estimate starts from (:meth:`record_acceptance`: a slow EWMA over
    the drafter's tested tokens across requests; each request then keeps its own estimate:
    acceptance depends on the text).
    ``drafter_rate[name]``: realised tokens per plain-step cost of the drafter's steady steps
    (``auto`` compares the draft model's chain and tree with it). ``catch_up_s[name]``: the
    seconds a model drafter's proposal spends beyond its steady cost when it first feeds ``rows``
    context tokens it has not seen (its prefill at a request's first proposal, or the tokens of
    the steps other drafters drafted), by power-of-two ``rows``. ``output_lengths``: output
    tokens of the engine's last :data:`OUTPUT_LENGTH_HISTORY` requests (what a catch-up is
    amortised over: :meth:`expected_remaining_tokens`). ``coverage[name]``: the share of a
    request's output, from a model drafter's first catch-up on, that its own steps emitted
    (EWMA over requests; :meth:`record_coverage`). ``priced_out_probes[name]``: probes of a
    switched-off model drafter its catch-up priced out since one last went ahead.
    """

    weight: float = 0.3
    verify_s: dict[int, float] = field(default_factory=dict)
    draft_token_s: dict[str, float] = field(default_factory=dict)
    last_alpha: dict[str, float] = field(default_factory=dict)
    draft_ratio: dict[str, float] = field(default_factory=dict)
    drafter_rate: dict[str, float] = field(default_factory=dict)
    catch_up_s: dict[str, dict[int, float]] = field(default_factory=dict)
    output_lengths: deque = field(default_factory=lambda: deque(maxlen=OUTPUT_LENGTH_HISTORY))
    plain_steps: deque = field(default_factory=lambda: deque(maxlen=PLAIN_STEP_WINDOW))
    coverage: dict[str, float] = field(default_factory=dict)
    seed_ratios: dict[int, float] = field(default_factory=dict)
    priced_out_probes: dict[str, int] = field(default_factory=dict)  # see DraftPolicy's catch-up pricing

    def verify_points(self) -> dict[int, float]:
        """Seconds of a target pass by extra rows ``k``: the passes timed here (``verify_s``),
        and for the lengths not yet timed, the seeded shape (``seed_ratios``: a pass of ``k``
        extra rows over a one-row pass, from a cost curve measured on this machine,
        :func:`verispec.runners.costs.seed_cost_model`) times the plain step measured now. The
        seed gives the curve's shape, never its level: a curve timed while the machine was
        busier (or idler) would otherwise price every untimed length wrongly, and a length
        priced too high is never drafted, so never timed, so never corrected."""
        if not self.seed_ratios or 0 not in self.verify_s:
            return self.verify_s
        plain = self.verify_s[0]
        seeded = {k: ratio * plain for k, ratio in self.seed_ratios.items() if k not in self.verify_s}
        return {**seeded, **self.verify_s}

    def record_catch_up(self, drafter: str, rows: int, seconds: float) -> None:
        """A proposal that first fed ``rows`` (>= 1) unseen context tokens took ``seconds`` more
        than its steady cost; kept per power-of-two bucket of ``rows``, scaled to the bucket."""
        bucket = 1 << max(0, round(math.log2(rows)))
        _ewma(self.catch_up_s.setdefault(drafter, {}), bucket, max(0.0, seconds) * bucket / rows, self.weight)

    def catch_up_cost(self, drafter: str, rows: int, batch_size: int = 1) -> float | None:
        """Estimated cost of ``drafter`` feeding ``rows`` unseen context tokens, in plain steps
        (of a pass holding ``batch_size`` requests); None before one was measured."""
        points, plain = self.catch_up_s.get(drafter), self.plain_step_s(batch_size - 1)
        if not points or not plain:
            return None
        return interpolate(points, rows) / plain

    def record_acceptance(
        self, drafter: str, num_draft_tokens: int, num_accepted_tokens: int, weight: float, prior: float
    ) -> None:
        """A verified draft of ``num_draft_tokens`` with ``num_accepted_tokens`` accepted: moves
        ``last_alpha[drafter]`` (from ``prior`` the first time) by ``weight`` per tested token, the
        tokens counted as :class:`AcceptanceEstimate` counts them."""
        carried = AcceptanceEstimate(self.last_alpha.get(drafter, prior), weight)
        carried.update(num_draft_tokens, num_accepted_tokens)
        self.last_alpha[drafter] = carried.alpha

    def record_output_length(self, num_output_tokens: int) -> None:
        """A finished request's output tokens (users' requests only, not warm-ups)."""
        self.output_lengths.append(num_output_tokens)

    def expected_remaining_tokens(self, num_generated: int, max_remaining: int) -> float:
        """Tokens a request that has ``num_generated`` is expected to still emit: the mean of
        ``L - num_generated`` over the recorded output lengths ``L > num_generated`` (the
        empirical ``E[L - g | L > g]``), at most ``max_remaining``; ``max_remaining`` when no
        recorded request was that long (nothing is known, so nothing is assumed)."""
        longer = [length - num_generated for length in self.output_lengths if length > num_generated]
        if not longer:
            return float(max_remaining)
        return min(float(max_remaining), sum(longer) / len(longer))

    def record_coverage(self, drafter: str, num_drafter_tokens: int, num_tokens: int) -> None:
        """A finished request emitted ``num_tokens`` (> 0) from ``drafter``'s first catch-up on,
        ``num_drafter_tokens`` of them in that drafter's own steps (accepted tokens plus the
        target's one). A catch-up buys only those: the lookup drafter takes the steps it
        matches, the schedule switches the drafter off and back on (each time catching up)."""
        if num_tokens > 0:
            _ewma(self.coverage, drafter, min(1.0, num_drafter_tokens / num_tokens), self.weight)

    def record_rate(self, drafter: str, tokens_per_plain_step: float, carried: Sequence[str] = ()) -> None:
        """One step's realised tokens over its cost in plain decoding steps (its speedup).

        ``carried``: drafters whose rates move by the same factor as ``drafter``'s (the rates
        of the drafters that did not run, measured on earlier text: see
        :meth:`verispec.engine.ranking.DrafterRanking.record`)."""
        before = self.drafter_rate.get(drafter)
        _ewma(self.drafter_rate, drafter, tokens_per_plain_step, self.weight)
        if before:
            factor = self.drafter_rate[drafter] / before
            for name in carried:
                if name != drafter and name in self.drafter_rate:
                    self.drafter_rate[name] *= factor

    def record_verify(self, num_draft_tokens: int, seconds: float) -> None:
        """A target pass over the pending token and ``num_draft_tokens`` more took ``seconds``.

        Drafted passes update an EWMA per length. The plain step (``num_draft_tokens`` 0), the
        unit every cost and speedup is expressed in, is the mean of the last
        :data:`PLAIN_STEP_WINDOW` plain passes instead: an EWMA of the last few is what the
        schedules act on, and they act on it selectively. A plain pass that happened to be slow
        raises it, drafting then looks cheap, and while the request drafts no plain pass comes
        to correct it (measured on 40 Spec-Bench translation questions, a 2-core host: the
        EWMA at drafted passes averaged 57.2 ms, the mean of all plain passes 48.6 ms). A seeded
        value (:func:`verispec.runners.costs.seed_cost_model`) counts as one pass; ``weight`` 0
        freezes it as it freezes the EWMAs.
        """
        if num_draft_tokens != 0 or (self.weight == 0 and 0 in self.verify_s):
            _ewma(self.verify_s, num_draft_tokens, seconds, self.weight)
            return
        if not self.plain_steps and 0 in self.verify_s:
            self.plain_steps.append(self.verify_s[0])
        self.plain_steps.append(seconds)
        self.verify_s[0] = sum(self.plain_steps) / len(self.plain_steps)

    def record_draft(self, drafter: str, num_draft_tokens: int, seconds: float) -> None:
        if num_draft_tokens > 0:
            _ewma(self.draft_token_s, drafter, seconds / num_draft_tokens, self.weight)

    def record_draft_ratio(self, drafter: str, num_draft_tokens: int, draft_s: float, verify_s: float) -> None:
        """One step's seconds per drafted token over the seconds of the target pass of the *same*
        step: a ratio that a machine-wide slowdown (other processes, a longer context) leaves
        alone, unlike absolute times measured at different moments."""
        if num_draft_tokens > 0 and verify_s > 0:
            _ewma(self.draft_ratio, drafter, draft_s / num_draft_tokens / verify_s, self.weight)

    def plain_step_s(self, base_rows: int = 0) -> float | None:
        """Estimated seconds of one plain decoding step (in a pass that also holds ``base_rows``
        rows of other requests); None before any target pass."""
        return interpolate(self.verify_points(), base_rows) if self.verify_s else None

    def verify_ratios(self, max_k: int, batch_size: int = 1) -> list[float]:
        """``[max_k + 1]`` verify cost of k drafted tokens over a plain step's, never below 1 and
        never falling with k (a pass over more tokens does not cost less; noisy timings taken at
        different moments can say otherwise).

        ``batch_size``: requests decoding in the same pass (continuous batching). The ratio is
        then the pass where each of them drafts k tokens (``batch_size * (k + 1)`` rows) over
        the pass where none drafts (``batch_size`` rows), so speculation shrinks where the
        batched pass turns compute-bound."""
        points = self.verify_points()
        plain = interpolate(points, batch_size - 1)
        ratios, highest = [], 1.0
        for k in range(max_k + 1):
            highest = max(highest, interpolate(points, batch_size - 1 + batch_size * k) / plain)
            ratios.append(highest)
        return ratios

    def step_costs(self, drafter: str, max_k: int, batch_size: int = 1) -> list[float] | None:
        """``[max_k + 1]`` step cost of drafting k tokens with ``drafter``, in plain steps.

        ``verify_ratios[k] + k * c`` with ``c`` the drafter's per-token cost relative to a
        target pass (:meth:`record_draft_ratio`; else ``draft_token_s / verify_s(0)``).
        Unmeasured verify lengths are interpolated. None until the drafter and the target have
        been timed at least once.

        In a batch of ``batch_size`` decoding requests the cost is the batch's: every request
        drafting k (``verify_ratios(max_k, batch_size)[k] + batch_size * k * c``, with ``c``
        one request's share of a drafted token, ``draft_token_s``, over the batch's plain pass)
        against none drafting, so the expected tokens per cost is the batch's tokens per second
        over plain decoding's. Pricing one request's k with the others' drafts held fixed
        instead is a trap: the others' rows make the pass, and so this request's plain step,
        long, which makes its own draft look cheap to every request in turn; all of them then
        draft into a compute-bound pass slower than plain decoding of the batch.
        """
        plain = self.plain_step_s(batch_size - 1)
        if plain is None or plain <= 0:
            return None
        if drafter in self.draft_ratio and (batch_size == 1 or drafter not in self.draft_token_s):
            per_token = self.draft_ratio[drafter]
        elif drafter in self.draft_token_s:
            per_token = self.draft_token_s[drafter] / plain
        else:
            return None
        ratios = self.verify_ratios(max_k, batch_size)
        return [ratio + batch_size * k * per_token for k, ratio in enumerate(ratios)]


def _ewma(values: dict, key, sample: float, weight: float) -> None:
    values[key] = sample if key not in values else values[key] + weight * (sample - values[key])
