"""``verispec advise``: does speculation pay on this workload, this machine, this model pair?

Owns the advisor's arithmetic (expected speedup per draft length, best length, break-even
acceptance rate, cost per million tokens), the measurement it needs (a short benchmark without
peers, and the target's verify-cost curve), the verdict per category and the equivalent settings
for transformers and vLLM. Memory of weights and KV caches is :mod:`verispec.bench.advise_memory`'s.
The expected-tokens formula and the best-length search are the draft-length controller's
(:mod:`verispec.algorithms.control`), not a copy. Knows nothing about how decoding works; it reads
benchmark records.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from verispec.algorithms.control import CostModel, best_draft_length, expected_tokens
from verispec.bench.advise_cost import cost_estimate
from verispec.bench.advise_memory import head_kv_bytes, kv_geometry, memory_advice
from verispec.bench.advise_sample import note_samples
from verispec.bench.figures import ALL, SummaryRow
from verispec.bench.records import VERISPEC_FAMILIES, RunRecord
from verispec.errors import InvalidParameterError
from verispec.runners import Runner, prefill
from verispec.runners.eagle.blocks import head_nbytes

GO_THRESHOLD = 1.05  # a measured speedup below +5 % is within run-to-run noise here
VERIFY_LENGTHS = (0, 1, 2, 4, 8, 16)
NGRAM = "ngram"

# --- formulas -----------------------------------------------------------------------------


def linear_step_costs(cost_ratio: float, max_k: int) -> list[float]:
    """``[max_k + 1]`` step cost ``k * c + 1`` in target forwards: k draft tokens at ``c`` each,
    verification of k + 1 tokens costing one forward (Leviathan et al. 2023, §3.4)."""
    return [k * cost_ratio + 1.0 for k in range(max_k + 1)]


def expected_speedup(
    alpha: float, num_speculative_tokens: int, step_costs: Sequence[float], coverage: float = 1.0
) -> float:
    """Expected speedup over plain decoding with k draft tokens per step.

    ``E(α, k) / step_costs[k]`` (Leviathan et al. 2023, §3.4, Theorem 3.8 with
    ``step_costs = linear_step_costs(c)``), generalised to a drafter that proposes on only a
    fraction ``coverage`` of steps (n-gram lookup): the other steps are plain (1 token, cost 1).
    """
    k, f = num_speculative_tokens, coverage
    return (f * expected_tokens(alpha, k) + (1 - f)) / (f * step_costs[k] + (1 - f))


def best_speedup(alpha: float, step_costs: Sequence[float], coverage: float = 1.0) -> tuple[int, float]:
    """``(k, speedup)`` maximising :func:`expected_speedup` over ``k = 0 .. len(step_costs) - 1``;
    k = 0 (speedup 1) when no draft length pays. With full coverage this is
    :func:`verispec.algorithms.control.best_draft_length`."""
    if coverage >= 1.0:
        return best_draft_length(alpha, step_costs)
    best = (0, 1.0)
    for k in range(1, len(step_costs)):
        speedup = expected_speedup(alpha, k, step_costs, coverage)
        if speedup > best[1]:
            best = (k, speedup)
    return best


def break_even_alpha(step_costs: Sequence[float], tolerance: float = 1e-6) -> float:
    """The acceptance rate below which no draft length beats plain decoding.

    For linear costs ``k c + 1`` it is ``c`` (some k gains iff α > c: Leviathan et al. 2023,
    §3.4); for a measured cost curve it is found by bisection (the best speedup grows with α).
    Returns 1.0 when even α = 1 does not pay.
    """
    if best_draft_length(1.0, step_costs)[1] <= 1.0:
        return 1.0
    low, high = 0.0, 1.0
    while high - low > tolerance:
        middle = (low + high) / 2
        if best_draft_length(middle, step_costs)[0] > 0:
            high = middle
        else:
            low = middle
    return high


def iid_acceptance_rate(num_accepted_tokens: int, num_rejections: int) -> float | None:
    """Per-token acceptance α under Leviathan's i.i.d. model (§3.1, α = E[β]): accepted tokens
    over *judged* tokens (accepted + the one rejected per draft that stopped early). Unlike
    accepted / drafted it does not count tokens after a rejection, never judged, as failures."""
    judged = num_accepted_tokens + num_rejections
    return num_accepted_tokens / judged if judged else None


def equivalent_settings(
    method: str, num_speculative_tokens: int, draft_ref: str | None, min_ngram: int = 2, max_ngram: int = 4
) -> dict:
    """``{"transformers": generate kwargs, "vllm": --speculative-config JSON}`` for ``method``
    (None where the other tool has no equivalent); :func:`verispec.bench.export.export_setup` has
    the whole configuration of each tool (``advise --export``)."""
    from verispec.bench.export import export_setup

    out: dict = {}
    for tool in ("transformers", "vllm"):
        try:
            setup = export_setup(
                tool, method, num_speculative_tokens, "target", draft_ref, min_ngram=min_ngram, max_ngram=max_ngram
            )
        except InvalidParameterError:
            out[tool] = None
            continue
        if tool == "vllm":
            out[tool] = setup.config["speculative_config"]
        else:  # the assistant's settings, where transformers reads them, beside generate's kwargs
            assistant = setup.config["assistant_generation_config"]
            out[tool] = {
                **setup.config["generate_kwargs"],
                **({"assistant_generation_config": assistant} if assistant else {}),
            }
    return out


# --- measurement --------------------------------------------------------------------------


def measure_verify_curve(
    runner: Runner, context_token_ids: Sequence[int], lengths: Sequence[int] = VERIFY_LENGTHS, repeats: int = 3
) -> dict[int, float]:
    """Median seconds of one target pass over the pending token plus k draft tokens, after
    ``context_token_ids``, for each k in ``lengths`` (that fit the context). Leaves the cache empty."""
    context = list(context_token_ids)
    prefill(runner, context)
    base = runner.num_cached_tokens
    curve = {}
    for k in lengths:
        if base + k + 1 > runner.max_context_length:
            break
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward(context[-1:] * (k + 1))
            samples.append(time.perf_counter() - start)
            runner.truncate(base)
        curve[k] = statistics.median(samples)
    runner.truncate(0)
    return curve


@dataclass
class DrafterFit:
    """One drafter on one category: measured α (i.i.d. estimate), coverage (share of decode
    steps that had a draft), cost ratio c, the predictions and the measured speedup."""

    method: str
    category: str
    alpha: float | None
    coverage: float
    cost_ratio: float | None
    leviathan_best_k: int | None
    leviathan_speedup: float | None
    predicted_best_k: int | None
    predicted_speedup: float | None
    break_even_alpha: float | None
    measured_speedup: float | None
    num_tested_tokens: int = 0  # draft tokens verification judged (accepted + rejections): α's sample


def fit_drafter(
    method: str,
    category: str,
    records: Sequence[RunRecord],
    row: SummaryRow | None,
    verify_curve: dict[int, float],
    max_k: int,
) -> DrafterFit:
    """Fit the formulas to one method's records of one category (``all`` pools them)."""
    mine = [
        r for r in records if r.method == method and r.family in VERISPEC_FAMILIES and category in (ALL, r.category)
    ]
    accepted = sum(r.spec.get("num_accepted_tokens", 0) for r in mine)
    rejections = sum(r.spec.get("num_recovered_tokens", 0) for r in mine)
    drafted = sum(r.spec.get("num_draft_tokens", 0) for r in mine)
    drafts = sum(r.spec.get("num_drafts", 0) for r in mine)
    steps = sum(max(r.num_target_forwards - 1, 0) for r in mine)
    alpha = iid_acceptance_rate(accepted, rejections)
    plain_s = verify_curve.get(0)
    token_s = sum(r.draft_ms for r in mine) / 1e3 / drafted if drafted else None
    c = token_s / plain_s if token_s is not None and plain_s else None
    measured = row.speedup if row is not None else None
    if alpha is None or c is None:
        return DrafterFit(
            method, category, alpha, 0.0, c, None, None, None, None, None, measured, accepted + rejections
        )
    coverage = drafts / steps if steps else 1.0
    lev_k, lev = best_draft_length(alpha, linear_step_costs(c, max_k))
    curve_costs = CostModel(verify_s=dict(verify_curve), draft_token_s={method: token_s}).step_costs(method, max_k)
    k, predicted = best_speedup(alpha, curve_costs, coverage)
    return DrafterFit(
        method,
        category,
        alpha,
        coverage,
        c,
        lev_k,
        lev,
        k,
        predicted,
        break_even_alpha(curve_costs),
        measured,
        accepted + rejections,
    )


# --- verdicts -----------------------------------------------------------------------------


@dataclass
class Verdict:
    """``GO`` (a model drafter pays), ``GO with n-gram only`` or ``NO-GO``, with the reason."""

    category: str
    decision: str
    method: str | None
    num_speculative_tokens: int | None
    reason: str
    sample: str = ""  # why the sample is too small to decide, and what would do (advise_sample.sample_note)


def pays(fit: DrafterFit, threshold: float = GO_THRESHOLD) -> bool:
    """A drafter pays when it measured at least ``threshold`` and the formula, fed its α and c,
    also finds a draft length that beats plain decoding (a measured gain the model cannot
    explain is taken for noise). Without a measurement the prediction must reach ``threshold``."""
    predicted_gain = fit.predicted_best_k is not None and fit.predicted_best_k > 0
    if fit.measured_speedup is None:
        return predicted_gain and (fit.predicted_speedup or 0.0) >= threshold
    return predicted_gain and fit.measured_speedup >= threshold


def verdict(category: str, fits: Sequence[DrafterFit], threshold: float = GO_THRESHOLD) -> Verdict:
    """GO when a model drafter (not n-gram) :func:`pays` (the best measured one), else "GO with
    n-gram only" when n-gram lookup pays, else NO-GO with the best drafter's figures as reason."""

    def score(fit: DrafterFit) -> float:
        return fit.measured_speedup if fit.measured_speedup is not None else (fit.predicted_speedup or 0.0)

    paying = sorted((f for f in fits if pays(f, threshold)), key=score, reverse=True)
    models = [f for f in paying if f.method != NGRAM]
    if models:
        return Verdict(category, "GO", models[0].method, models[0].predicted_best_k, _reason(models[0]))
    if paying:
        return Verdict(category, "GO with n-gram only", NGRAM, paying[0].predicted_best_k, _reason(paying[0]))
    best = max(fits, key=score, default=None)
    return Verdict(category, "NO-GO", None, None, _reason(best) if best else "no drafter measured")


def _reason(fit: DrafterFit) -> str:
    def f(value, pattern="{:.2f}"):
        return "—" if value is None else pattern.format(value)

    if fit.alpha is None:
        return f"{fit.method}: never drafted (measured {f(fit.measured_speedup, '{:.2f}×')})"
    best = "no k beats plain decoding" if not fit.predicted_best_k else f"best k={fit.predicted_best_k}"
    text = f"{fit.method}: measured {f(fit.measured_speedup, '{:.2f}×')}, "
    text += f"predicted {f(fit.predicted_speedup, '{:.2f}×')} ({best})"
    text += f" (α {f(fit.alpha)} vs break-even {f(fit.break_even_alpha)}, c {f(fit.cost_ratio, '{:.3f}')}"
    return text + (f", drafts on {fit.coverage:.0%} of steps)" if fit.coverage < 0.99 else ")")


# --- the whole advice ---------------------------------------------------------------------


@dataclass
class Advice:
    """What ``verispec advise`` prints (and writes with ``--json``)."""

    num_speculative_tokens: int
    verify_curve_s: dict[int, float]
    fits: list[DrafterFit]
    table: list[dict]  # per drafter and k: expected tokens, Leviathan and measured-curve speedup
    verdicts: list[Verdict]
    memory: dict
    cost: dict | None
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["verify_curve_s"] = {str(k): v for k, v in self.verify_curve_s.items()}
        return data


def speedup_table(fits: Sequence[DrafterFit], verify_curve: dict[int, float], max_k: int) -> list[dict]:
    """Rows ``{method, k, expected_tokens, leviathan_speedup, curve_speedup}`` for k = 1..max_k
    from each drafter's pooled (``all``) fit."""
    rows = []
    for fit in fits:
        if fit.category != ALL or fit.alpha is None or fit.cost_ratio is None:
            continue
        token_s = fit.cost_ratio * verify_curve[0]
        curve = CostModel(verify_s=dict(verify_curve), draft_token_s={fit.method: token_s}).step_costs(
            fit.method, max_k
        )
        linear = linear_step_costs(fit.cost_ratio, max_k)
        for k in range(1, max_k + 1):
            rows.append(
                {
                    "method": fit.method,
                    "k": k,
                    "expected_tokens": expected_tokens(fit.alpha, k),
                    "leviathan_speedup": expected_speedup(fit.alpha, k, linear),
                    "curve_speedup": expected_speedup(fit.alpha, k, curve, fit.coverage),
                }
            )
    return rows


def model_ref(loaded) -> str:
    """The reference a loaded model was asked for: its built-in name, else its path."""
    from verispec.models.registry import BUILTIN_MODELS

    return loaded.name if loaded.name in BUILTIN_MODELS else str(loaded.path or loaded.name)


def advise(
    pipe,
    items,
    config,
    *,
    max_k: int = 10,
    context_length: int = 4096,
    memory_budget_bytes: int | None = None,
    gpu_cost_per_month: float | None = None,
    cached_prompt_fraction: float = 0.0,
    on_run=None,
) -> Advice:
    """Measure ``config``'s methods (a :class:`BenchConfig` without peers) on ``items`` and the
    target's verify curve, then fit, predict and decide. ``cached_prompt_fraction``: the share of
    each prompt the prefix cache serves in production; the cost estimate prefills only the rest
    (:func:`tokens_per_s_with_cache`). Raises as :func:`run_bench` does, and
    InvalidParameterError for a fraction outside [0, 1)."""
    if not 0.0 <= cached_prompt_fraction < 1.0:
        raise InvalidParameterError(
            f"the cached prompt fraction must be in [0, 1) (at least the last prompt token is computed), "
            f"got {cached_prompt_fraction}"
        )
    from verispec.bench.figures import summarize
    from verispec.bench.run import encode, run_bench

    records, _, _ = run_bench(pipe, items, config, on_run)
    kind = pipe.runner_kind  # records are named "<kind>:<method>"
    rows = {(r.runner, r.category): r for r in summarize(records)}
    lengths = sorted({k for k in VERIFY_LENGTHS if k <= max_k} | {max_k})
    curve = measure_verify_curve(pipe.engine.target, encode(pipe, items[0], config.chat), lengths)
    drafters = [m for m in config.methods if m != "none"]
    categories = list(dict.fromkeys(item.category for item in items)) + [ALL]
    fits = [
        fit_drafter(m, c, records, rows.get((f"{kind}:{m}", c)), curve, max_k) for c in categories for m in drafters
    ]
    verdicts = [verdict(c, [f for f in fits if f.category == c]) for c in categories]
    note_samples(verdicts, fits, [item.category for item in items], config.max_tokens)
    overall = verdicts[-1]
    target_kv, element = kv_geometry(pipe.target, pipe.runner_kind)  # the KV cache the runner keeps
    draft_kv = kv_geometry(pipe.draft, pipe.runner_kind)[0] if pipe.draft else None
    head = getattr(pipe.engine.proposers.get("eagle"), "head", None)  # a loaded EAGLE head, else None
    memory = memory_advice(
        target_kv,
        draft_kv,
        pipe.target.param_bytes,
        pipe.draft.param_bytes if pipe.draft else 0,
        context_length,
        element,
        memory_budget_bytes,
        head_nbytes(head) if head is not None else 0,
        head_kv_bytes(head, context_length) if head is not None else 0,
    )
    cost = None
    if gpu_cost_per_month is not None:
        plain_row = rows[(f"{kind}:none", ALL)]
        chosen = rows.get((f"{kind}:{overall.method}", ALL)) if overall.method else None
        cost = cost_estimate(gpu_cost_per_month, overall.method, plain_row, chosen, cached_prompt_fraction)
    draft_ref = model_ref(pipe.draft) if pipe.draft else None
    best_k = {f.method: f.predicted_best_k or config.num_speculative_tokens for f in fits if f.category == ALL}
    settings = {
        m: equivalent_settings(m, best_k[m], draft_ref, pipe.drafters.min_ngram, pipe.drafters.max_ngram)
        for m in drafters
    }
    return Advice(
        config.num_speculative_tokens, curve, fits, speedup_table(fits, curve, max_k), verdicts, memory, cost, settings
    )
