"""``verispec advise`` on a terminal: the advice as rich tables and verdict lines."""

from __future__ import annotations

from verispec.bench.advise import Advice
from verispec.bench.figures import ALL


def _f(value, pattern="{:.2f}") -> str:
    """``value`` through ``pattern``, or a dash for None."""
    return "—" if value is None else pattern.format(value)


def _mib(value: int) -> str:
    """Bytes as whole MiB."""
    return f"{value / 2**20:.0f} MiB"


def render(advice: Advice, console) -> None:
    """Print the advice as rich tables and lines."""
    if not console.is_terminal:
        console.width = max(console.width, 160)  # a log file: do not squeeze the tables
    console.print(
        "target pass over the pending token + k draft tokens: "
        + ", ".join(f"k={k} {s * 1e3:.0f} ms" for k, s in advice.verify_curve_s.items())
    )
    console.print(_fits_table(advice))
    console.print(_per_k_table(advice))
    console.print(_verdicts_table(advice))
    for v in advice.verdicts:
        if v.sample:
            console.print(f"{v.category}: {v.sample}", highlight=False, markup=False)
    console.print(_memory_line(advice.memory))
    if advice.cost:
        console.print(_cost_line(advice.cost))
    _print_settings(advice, console)


def _fits_table(advice: Advice):
    """The table of each drafter's fit over all prompts."""
    from rich.table import Table

    fitted = Table(title=f"measured per drafter (all prompts; measured speedup at k={advice.num_speculative_tokens})")
    for name in (
        "drafter",
        "α",
        "drafts on",
        "c",
        "break-even α",
        "Leviathan best k",
        "Leviathan speedup",
        "best k (curve)",
        "predicted",
        "measured",
    ):
        fitted.add_column(name, justify="right")
    for fit in (x for x in advice.fits if x.category == ALL):
        fitted.add_row(
            fit.method,
            _f(fit.alpha),
            f"{fit.coverage:.0%}",
            _f(fit.cost_ratio, "{:.3f}"),
            _f(fit.break_even_alpha),
            _f(fit.leviathan_best_k, "{}"),
            _f(fit.leviathan_speedup, "{:.2f}×"),
            _f(fit.predicted_best_k, "{}"),
            _f(fit.predicted_speedup, "{:.2f}×"),
            _f(fit.measured_speedup, "{:.2f}×"),
        )
    return fitted


def _per_k_table(advice: Advice):
    """The table of each drafter's expected tokens and speedups by draft length k."""
    from rich.table import Table

    methods = list(dict.fromkeys(row["method"] for row in advice.table))
    per_k = Table(title="expected speedup by draft length k (Leviathan: verify cost flat; curve: measured verify cost)")
    per_k.add_column("k", justify="right")
    for method in methods:
        per_k.add_column(f"{method} E(tokens)", justify="right")
        per_k.add_column(f"{method} Leviathan", justify="right")
        per_k.add_column(f"{method} curve", justify="right")
    for k in sorted({row["k"] for row in advice.table}):
        cells = [str(k)]
        for method in methods:
            row = next(r for r in advice.table if r["method"] == method and r["k"] == k)
            cells += [
                _f(row["expected_tokens"]),
                _f(row["leviathan_speedup"], "{:.2f}×"),
                _f(row["curve_speedup"], "{:.2f}×"),
            ]
        per_k.add_row(*cells)
    return per_k


def _verdicts_table(advice: Advice):
    """The table of the verdict per category, GO in green and NO-GO in red."""
    from rich.table import Table

    decided = Table(title="verdict per category")
    for name in ("category", "verdict", "method", "k", "reason"):
        decided.add_column(name)
    for v in advice.verdicts:
        color = "green" if v.decision.startswith("GO") else "red"
        mark = " (sample too small)" if v.sample else ""
        decided.add_row(
            v.category,
            f"[{color}]{v.decision}[/{color}]{mark}",
            v.method or "—",
            _f(v.num_speculative_tokens, "{}"),
            v.reason,
        )
    return decided


def _memory_line(m: dict) -> str:
    """The memory line: target, draft, an EAGLE head's share, the budget's verdict."""
    line = (
        f"memory at {m['context_length']} tokens: target {_mib(m['target_param_bytes'])} + KV "
        f"{_mib(m['target_kv_bytes'])}, "
        f"draft {_mib(m['draft_param_bytes'])} + KV {_mib(m['draft_kv_bytes'])}; total {_mib(m['total_bytes'])}; "
        f"draft overhead {_f(m['draft_overhead_pct'], '{:.1f}')} %"
    )
    if m.get("head_overhead_pct") is not None:
        within = "within" if m["head_within_limit"] else "OVER"
        line += (
            f"; EAGLE head {_mib(m['head_param_bytes'])} + KV {_mib(m['head_kv_bytes'])} = "
            f"{m['head_overhead_pct']:.1f} % of the target's ({within} the 10 % target)"
        )
    if m["budget_bytes"] is not None:
        line += f"; budget {_mib(m['budget_bytes'])}: {'fits' if m['fits'] else 'does NOT fit'}"
        line += "" if m["fits"] else f" ({'fits' if m['fits_without_draft'] else 'does not fit'} without the draft)"
    return line


def _cost_line(c: dict) -> str:
    """The cost line: per million tokens with plain decoding and with the chosen drafter."""
    return (
        f"cost per million tokens: {_f(c['before_per_million_tokens'], '{:.2f}')} plain "
        f"({_f(c['plain_tokens_per_s'])} tok/s) → "
        f"{_f(c['after_per_million_tokens'], '{:.2f}')} with {c['method']} ({_f(c['chosen_tokens_per_s'])} tok/s), "
        f"at {c['gpu_cost_per_month']:g} per month"
        + (
            f" (estimate: {c['cached_prompt_fraction']:.0%} of each prompt read from the prefix cache)"
            if c.get("cached_prompt_fraction")
            else ""
        )
    )


def _print_settings(advice: Advice, console) -> None:
    """The overall verdict's transformers and vLLM settings, or that it has none."""
    import json

    overall = advice.verdicts[-1]
    s = advice.settings.get(overall.method or "", {})
    if s.get("transformers"):
        console.print(f"transformers settings: {json.dumps(s['transformers'])}")
    if s.get("vllm"):
        console.print(f"vLLM --speculative-config '{json.dumps(s['vllm'])}'")
    if overall.method and not s.get("vllm"):
        console.print(f"{overall.method}: no equivalent setting in transformers / vLLM")


def export_advice(
    advice, tool: str, path, target: str, draft: str | None, drafters, console, *, eagle_dir: str | None = None
) -> None:
    """``advise --export``: the overall verdict's setup as ``tool``'s configuration
    (:func:`verispec.bench.export.export_setup`; ``eagle_dir``: the head's EAGLE-3 checkpoint when
    the verdict is an EAGLE method), JSON on stdout or in ``path``; the command and the notes on
    ``console``. Raises what ``export_setup`` raises, and VerispecError when ``path`` cannot be
    written."""
    from verispec.bench.export import export_setup
    from verispec.errors import VerispecError

    overall = advice.verdicts[-1]
    setup = export_setup(
        tool,
        overall.method,
        overall.num_speculative_tokens,
        target,
        draft,
        min_ngram=drafters.min_ngram,
        max_ngram=drafters.max_ngram,
        eagle_dir=eagle_dir,
    )
    if path is None:
        print(setup.to_json())
    else:
        try:
            path.write_text(setup.to_json() + "\n")
        except OSError as exc:
            raise VerispecError(f"cannot write {path}: {exc.strerror or exc}") from None
        console.print(f"{tool} configuration written to {path}", highlight=False, markup=False)
    console.print(f"{tool}: {setup.command}", highlight=False, markup=False)
    for note in setup.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
