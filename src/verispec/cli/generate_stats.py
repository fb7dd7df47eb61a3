"""What ``verispec generate`` prints after the text: the stats table of one generation and the
``--compare-plain`` comparison with plain decoding of the same prompt. Knows nothing about
decoding; reads :class:`verispec.engine.GenerationOutput` and its metrics.
"""

from __future__ import annotations

from rich.table import Table

from verispec.algorithms.sampling import SamplingParams
from verispec.engine import GenerationOutput
from verispec.metrics import peak_rss_bytes


def plain_comparison(output: GenerationOutput, plain: GenerationOutput, params: SamplingParams) -> dict:
    """Speculative vs plain decoding of the same prompt with the same ``params``, measured in this
    process (tokens/s).

    ``identical`` compares the tokens where they must be equal: greedy, or sampled with a seed under
    coupled sampling (a seed gives plain decoding's tokens under every method, docs/methods.md). It
    is None otherwise (no seed, or ``rejection``): the two runs draw different samples from the
    same distribution, so a token comparison says nothing.
    """
    comparable = params.temperature == 0 or (params.seed is not None and params.sampling == "coupled")
    spec_rate, plain_rate = output.metrics.decode_tokens_per_s, plain.metrics.decode_tokens_per_s
    return {
        "speculative_decode_tokens_per_s": spec_rate,
        "plain_decode_tokens_per_s": plain_rate,
        "speculative_total_tokens_per_s": output.metrics.total_tokens_per_s,
        "plain_total_tokens_per_s": plain.metrics.total_tokens_per_s,
        "measured_speedup": spec_rate / plain_rate if spec_rate and plain_rate else None,
        "identical": list(output.token_ids) == list(plain.token_ids) if comparable else None,
    }


SLOWDOWN_HINT_BELOW = 0.95  # a speedup under this (measured, or estimated from step times) gets a hint


def slowdown_hint(output: GenerationOutput, method: str, comparison: dict | None = None) -> str | None:
    """One line for stderr when speculation cost more than it saved on this request: the measured
    speedup with ``--compare-plain``, else the estimate from its step times (each drafted step's
    draft + target time against a plain step's); None when it paid, or nothing was drafted."""
    spec = output.metrics.spec
    if method == "none" or not spec.num_draft_tokens:
        return None
    measured = None if comparison is None else comparison.get("measured_speedup")
    speedup, how = (
        (measured, "measured against plain decoding")
        if measured is not None
        else (spec.realised_speedup, "estimated from its step times")
    )
    if speedup is None or speedup >= SLOWDOWN_HINT_BELOW:
        return None
    rate = "—" if spec.acceptance_rate is None else f"{spec.acceptance_rate:.2f}"
    return (
        f"note: --method {method} was {speedup:.2f}x plain decoding on this request ({how}; acceptance rate "
        f"{rate}): the drafts cost more than they saved here; --method none decodes this kind of request faster"
    )


def stats_table(output: GenerationOutput, method: str, models: list[dict], comparison: dict | None = None) -> Table:
    """The stats a user reads after a generation (ms, tokens/s, MiB)."""
    m = output.metrics
    table = Table(title=f"verispec · method={method} · finish={output.finish_reason}", show_header=False)
    table.add_column("metric", style="cyan")
    table.add_column("value", justify="right")
    rows = [
        ("prompt / output tokens", f"{m.prompt_tokens} / {m.output_tokens}"),
        ("TTFT (ms)", _fmt(m.ttft_ms)),
        ("TPOT (ms)", _fmt(m.tpot_ms)),
        ("decode tokens/s", _fmt(m.decode_tokens_per_s, "{:.2f}")),
        ("total tokens/s", _fmt(m.total_tokens_per_s, "{:.2f}")),
        ("target forwards", str(m.num_target_forwards)),
        ("time in target / draft (ms)", f"{m.target_ms:.0f} / {m.draft_ms:.0f}"),
    ]
    if method != "none":
        rows += _speculation_rows(m.spec)
    for model in models:
        rows.append(
            (
                f"{model['role']}: {model['name']}",
                f"load {model['load_time_s']:.1f} s · {model['param_bytes'] / 2**20:.0f} MiB",
            )
        )
    if comparison is not None:
        identical = {True: "yes", False: "NO", None: "not compared (sampled: no seed, or --sampling rejection)"}[
            comparison["identical"]
        ]
        rows += [
            ("plain decoding, same prompt: decode tokens/s", _fmt(comparison["plain_decode_tokens_per_s"], "{:.2f}")),
            ("measured speedup vs plain (decode)", _fmt(comparison["measured_speedup"], "{:.2f}x")),
            ("tokens identical to plain", identical),
        ]
    rows.append(("peak RSS (MiB)", f"{peak_rss_bytes() / 2**20:.0f}"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def _fmt(value, pattern="{:.1f}") -> str:
    return "—" if value is None else pattern.format(value)


def _speculation_rows(spec) -> list[tuple[str, str]]:
    """The drafting's rows: drafts and acceptance overall, the schedule's choices, the speedup
    estimates, then each drafter's share."""
    rows = [
        ("drafts / drafted / accepted", f"{spec.num_drafts} / {spec.num_draft_tokens} / {spec.num_accepted_tokens}"),
        ("acceptance rate", _fmt(spec.acceptance_rate, "{:.3f}")),
        ("mean acceptance length", _fmt(spec.mean_acceptance_length, "{:.2f}")),
        ("acceptance per position", " ".join(f"{r:.2f}" for r in spec.acceptance_rate_per_position)),
        ("accepted-length histogram", " ".join(str(c) for c in spec.accepted_length_histogram)),
        ("chosen k histogram (k = 0, 1, ...)", " ".join(str(c) for c in spec.chosen_k_histogram)),
        # estimates: in units of the controller's plain-step cost, not a plain run (--compare-plain measures one)
        (
            "speedup estimate: predicted / from step times",
            f"{_fmt(spec.predicted_speedup, '{:.2f}')} / {_fmt(spec.realised_speedup, '{:.2f}')}",
        ),
    ]
    for name, drafter in sorted(spec.per_drafter.items()):
        rows.append(
            (
                f"{name}: drafts / drafted / accepted",
                f"{drafter.num_drafts} / {drafter.num_draft_tokens} / {drafter.num_accepted_tokens} "
                f"(rate {_fmt(drafter.acceptance_rate, '{:.3f}')}, length "
                f"{_fmt(drafter.mean_acceptance_length, '{:.2f}')})",
            )
        )
    return rows
