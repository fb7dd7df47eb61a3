"""Is ``verispec advise``'s sample large enough to decide a verdict, and if not, what would be?

Owns two checks on a category's measurement: the new tokens per prompt (below
:data:`MIN_NEW_TOKENS` the end-to-end speedup of a prompt is mostly its prefill, which
speculation does not shorten and a draft model lengthens) and the precision of each drafter's
acceptance rate against its break-even rate (a normal-approximation 95 % interval of a binomial
proportion over the tested draft tokens; Leviathan et al. 2023, §3.1, treat the tokens as i.i.d.
trials of rate α, which is what :func:`verispec.bench.advise.iid_acceptance_rate` estimates). Knows
nothing about running; reads the fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z_95 = 1.96  # two-sided 95 % normal quantile
MIN_NEW_TOKENS = 64  # new tokens a prompt below which prefill dominates a prompt's measured speedup
MIN_MARGIN = 0.05  # an α this close to break-even is a tie: sized to tell them apart by this much


def alpha_half_width(alpha: float, num_tested_tokens: int) -> float:
    """Half-width of the 95 % interval of an acceptance rate ``alpha`` measured over
    ``num_tested_tokens`` (> 0) i.i.d. draft tokens: ``1.96 * sqrt(a (1 - a) / n)``, with ``a``
    kept at least ``1 / (n + 1)`` from 0 and 1 (an all-accepted sample is not a certainty)."""
    floor = 1.0 / (num_tested_tokens + 1)
    a = min(max(alpha, floor), 1.0 - floor)
    return Z_95 * math.sqrt(a * (1.0 - a) / num_tested_tokens)


def tokens_to_decide(alpha: float, break_even: float) -> int:
    """Tested draft tokens for the 95 % interval of ``alpha`` to exclude ``break_even`` (or, for a
    near tie, to narrow to :data:`MIN_MARGIN`): ``ceil(1.96^2 a (1 - a) / d^2)``."""
    margin = max(abs(alpha - break_even), MIN_MARGIN)
    a = min(max(alpha, 0.05), 0.95)
    return math.ceil(Z_95**2 * a * (1.0 - a) / margin**2)


def sample_note(fits: Sequence, num_prompts: int, prompts_per_limit: int, limit: int, max_tokens: int) -> str:
    """Why the sample of one category is too small to decide, and what would do; ``""`` when it
    is large enough.

    Args:
        fits: the category's :class:`verispec.bench.advise.DrafterFit` (``alpha``,
            ``break_even_alpha``, ``num_tested_tokens``).
        num_prompts: prompts measured in the category (``all``: every prompt).
        prompts_per_limit: prompts one more ``--limit`` adds to it (1 for a category, the number
            of categories for ``all``).
        limit, max_tokens: the ``--limit`` and ``--max-tokens`` of the run.
    """
    reasons, needed_prompts = [], 0.0  # prompts at this run's --max-tokens
    if max_tokens < MIN_NEW_TOKENS:
        reasons.append(f"{max_tokens} new tokens a prompt, where prefill dominates the measured speedup")
    for fit in fits:
        n, alpha, break_even = fit.num_tested_tokens, fit.alpha, fit.break_even_alpha
        if alpha is None or break_even is None or n <= 0:
            continue
        half = alpha_half_width(alpha, n)
        if abs(alpha - break_even) <= half:
            reasons.append(
                f"{fit.method}'s α {alpha:.2f} ± {half:.2f} from {n} tested tokens straddles its "
                f"break-even {break_even:.2f}"
            )
            needed_prompts = max(needed_prompts, tokens_to_decide(alpha, break_even) * num_prompts / n)
    if not reasons:
        return ""
    new_max = max(max_tokens, MIN_NEW_TOKENS)
    advice = f"--max-tokens {new_max}"
    if needed_prompts:  # tested tokens grow with the prompts and (about) with the new tokens a prompt
        prompts = needed_prompts * max_tokens / new_max
        new_limit = max(limit, math.ceil(prompts / prompts_per_limit))
        advice = f"--limit {new_limit} {advice}"
    return "sample too small to decide: " + "; ".join(reasons) + f"; try {advice}"


def note_samples(verdicts: Sequence, fits: Sequence, prompt_categories: Sequence[str], max_tokens: int) -> None:
    """Set each verdict's ``sample`` to :func:`sample_note` of its category (the last verdict, ``all``,
    pools every prompt). ``prompt_categories``: the category of each measured prompt, in order."""
    counts: dict[str, int] = {}
    for category in prompt_categories:
        counts[category] = counts.get(category, 0) + 1
    limit = max(counts.values(), default=0)  # --limit took at most this many prompts of each category
    for v in verdicts:
        mine = [f for f in fits if f.category == v.category]
        if v.category in counts:
            v.sample = sample_note(mine, counts[v.category], 1, counts[v.category], max_tokens)
        else:  # all: one more --limit adds a prompt of every category
            v.sample = sample_note(mine, len(prompt_categories), len(counts), limit, max_tokens)
