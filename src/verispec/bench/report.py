"""Benchmark renderings: report.md and the rich tables of a run's results.

Owns the text of the summary (the category matrix, the overall table, the curves, prefill and
quality tables, the memory and audit lines). The results.json document it renders is
:mod:`verispec.bench.results`'s. Knows nothing about running.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from verispec.bench.figures import ALL, SummaryRow
from verispec.bench.records import plain_method, reference_participant
from verispec.bench.results import BenchResults
from verispec.metrics import OUTPUT_BUCKET_TOKENS


def kernel_line(environment: dict) -> str | None:
    """Which kernels ran, from the environment facts: ``gguf kernels avx512 (CPU features: ...) ·
    int8 kernel onednn``; None when neither runner ran."""
    parts = []
    if environment.get("kernel_isa"):
        parts.append(
            f"gguf kernels {environment['kernel_isa']} (CPU features: "
            f"{environment.get('cpu_features') or 'none detected'})"
        )
    if environment.get("int8_kernel"):
        parts.append(f"int8 kernel {environment['int8_kernel']}")
    return " · ".join(parts) or None


def _fmt(value, pattern: str = "{:.2f}") -> str:
    return "—" if value is None else pattern.format(value)


def _cell(row: SummaryRow) -> str:
    """speedup, then α and τ (mean acceptance length) for runners that report them."""
    text = _fmt(row.speedup, "{:.2f}×")
    if row.acceptance_rate is not None:
        text += f" α{row.acceptance_rate:.2f} τ{row.mean_acceptance_length:.2f}"
    return text


def category_matrix(summary: Sequence[SummaryRow]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-category table: one row per runner, one column per category
    (``name (n prompts)``). A plain-decoding row shows its end-to-end tokens/s; every other row
    its speedup over plain decoding of its own runner, with α and τ where it drafts."""
    categories = list(dict.fromkeys(r.category for r in summary))
    names = list(dict.fromkeys(r.runner for r in summary))
    index = {(r.runner, r.category): r for r in summary}
    header = ["runner"] + [f"{c} ({next(r.num_prompts for r in summary if r.category == c)})" for c in categories]
    rows = []
    for name in names:
        cells = [name]
        for category in categories:
            row = index.get((name, category))
            if row is None:
                cells.append("—")
            elif row.method == plain_method(row.family):
                cells.append(_fmt(row.total_tokens_per_s, "{:.2f} tok/s"))
            else:
                cells.append(_cell(row))
        rows.append(cells)
    return header, rows


def overall_rows(summary: Sequence[SummaryRow]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-runner table over all prompts (a "vs llama.cpp:plain" column
    when the peer ran)."""
    peer = any(r.speedup_vs_llama_cpp is not None for r in summary)
    header = ["runner", "speedup", f"vs {reference_participant(r.runner for r in summary)}"] + (
        ["vs llama.cpp:plain"] if peer else []
    )
    header += ["decode tok/s", "e2e tok/s", "TTFT ms", "TPOT ms", "α", "τ", "tok/target fwd", "exact"]
    rows = []
    for r in summary:
        if r.category != ALL:
            continue
        exact = f"{r.exact_equal}/{r.exact_checked}" if r.exact_checked else "—"
        rows.append(
            [r.runner, _fmt(r.speedup, "{:.2f}×"), _fmt(r.speedup_vs_reference, "{:.2f}×")]
            + ([_fmt(r.speedup_vs_llama_cpp, "{:.2f}×")] if peer else [])
            + [
                _fmt(r.decode_tokens_per_s),
                _fmt(r.total_tokens_per_s),
                _fmt(r.ttft_ms, "{:.0f}"),
                _fmt(r.tpot_ms, "{:.0f}"),
                _fmt(r.acceptance_rate),
                _fmt(r.mean_acceptance_length),
                _fmt(r.tokens_per_target_forward),
                exact,
            ]
        )
    return header, rows


def curve_rows(curves: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the cost-curve table: target ms per k, cost(8) / cost(1), draft ms."""
    ks = sorted({int(k) for c in curves.values() for k in c.get("target", {})})
    header = ["runner"] + [f"k={k}" for k in ks] + ["cost(8)/cost(1)", "draft ms (k=1)", "draft / target k=1"]
    rows = []
    for kind, c in curves.items():
        target = {int(k): v for k, v in c.get("target", {}).items()}
        draft = {int(k): v for k, v in c.get("draft", {}).items()}.get(1)
        one = target.get(1)
        rows.append(
            [kind]
            + [_fmt(target.get(k), "{:.1f}") for k in ks]
            + [
                _fmt(target[8] / one if one and 8 in target else None),
                _fmt(draft, "{:.1f}"),
                _fmt(draft / one if draft and one else None),
            ]
        )
    return header, rows


def prefill_rows(prefill: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the prefill table: tokens/s of one prefill of each length, per runner."""
    lengths = sorted({int(n) for by_length in prefill.values() for n in by_length})
    header = ["runner"] + [f"{n} tokens: tok/s" for n in lengths]
    rows = [
        [name]
        + [_fmt((by_length.get(n) or by_length.get(str(n)) or {}).get("tokens_per_s"), "{:.1f}") for n in lengths]
        for name, by_length in prefill.items()
    ]
    return header, rows


def quality_rows(quality: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the quality table: each target runner against the float32 model."""
    header = ["runner", "positions", "top-1 agreement", "mean KL (nats)"]
    rows = [
        [name, str(q.get("positions")), _fmt(q.get("top1_agreement"), "{:.4f}"), _fmt(q.get("mean_kl_nats"), "{:.5f}")]
        for name, q in quality.items()
    ]
    return header, rows


def rich_table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right", style="cyan" if i == 0 else None, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _mib(value) -> str:
    return "—" if value is None else f"{value / 2**20:.0f} MiB"


def report_markdown(results: BenchResults) -> str:
    """report.md: settings (and the kernels that ran), the two tables, exactness, long-text decay, memory,
    audit, plots."""
    lines = [
        "# verispec benchmark",
        "",
        _settings_line(results),
        "",
        "Speedup: geometric mean over prompts of end-to-end tokens/s over plain decoding of the same runner "
        "(α acceptance rate, τ mean acceptance length).",
        "",
        "## Per category",
        "",
        markdown_table(*category_matrix(results.summary)),
        "",
        "## Per runner (all prompts)",
        "",
        markdown_table(*overall_rows(results.summary)),
        "",
        "## Runners",
        "",
    ]
    lines += _runner_lines(results)
    lines += ["", "## Exactness", ""] + _exactness_lines(results)
    lines += ["", f"## Acceptance by output position (buckets of {OUTPUT_BUCKET_TOKENS} tokens)", ""]
    lines += _decay_lines(results.summary)
    lines += ["", "## Memory and load time", ""] + _memory_lines(results)
    lines += _optional_sections(results)
    lines += ["", "Environment: " + ", ".join(f"{k} {v}" for k, v in results.environment.items()), ""]
    return "\n".join(lines)


def _settings_line(results: BenchResults) -> str:
    """The run's settings in one line, with the kernels that ran."""
    c = results.config
    kernels = kernel_line(results.environment)
    return (
        f"{results.created_at} · workload `{c.get('workload')}` · {c.get('num_prompts')} prompts · "
        f"max tokens {c.get('max_tokens')} · "
        f"{'greedy' if c.get('temperature', 0) == 0 else 'temperature ' + str(c.get('temperature'))} · "
        f"k = {c.get('num_speculative_tokens')} · "
        f"threads {results.environment.get('threads')} · dtype {c.get('dtype')}" + (f" · {kernels}" if kernels else "")
    )


def _runner_lines(results: BenchResults) -> list[str]:
    """One bullet per participant: its status, load time and settings."""
    lines = []
    for r in results.runners:
        load = f", loaded in {r.load_time_s:.1f} s" if r.load_time_s is not None else ""
        lines.append(f"- `{r.name}`: {r.status}{load}" + (f" · {json.dumps(r.settings)}" if r.settings else ""))
    return lines


def _exactness_lines(results: BenchResults) -> list[str]:
    """Whether every method's tokens equal plain decoding's, or where they differ and why they may."""
    ex, dtype = results.exactness, results.config.get("dtype")
    kind = "Greedy" if ex.get("greedy") else "Sampled by coupling (one seed per prompt)"
    if not ex.get("compared", ex.get("greedy")):
        return [
            "Modified rejection sampling: outputs are not compared token by token (the text depends on the drafter)."
        ]
    if ex.get("all_equal"):
        return [f"{kind}: every method's tokens equal plain decoding of the same runner on every prompt."]
    lines = [f"{kind}: tokens differ from plain decoding of the same runner on:"]
    lines += [f"- `{m['runner']}` on prompt {m['prompt_id']} ({m['category']})" for m in ex.get("mismatches", [])]
    if dtype != "float32":
        lines += [
            "",
            f"With {dtype} weights a pass over k + 1 tokens and a pass over one token round "
            "differently, so a near-tie between two tokens can flip; float32 makes that far rarer.",
        ]
    return lines


def _decay_lines(summary: Sequence[SummaryRow]) -> list[str]:
    """The acceptance rate per bucket of output positions, per drafting runner over all prompts."""
    decay = [r for r in summary if r.category == ALL and r.acceptance_by_output_bucket]
    if not decay:
        return ["No drafts."]
    width = max(len(r.acceptance_by_output_bucket) for r in decay)
    header = ["runner"] + [f"{b * OUTPUT_BUCKET_TOKENS}-{(b + 1) * OUTPUT_BUCKET_TOKENS - 1}" for b in range(width)]
    rows = [
        [r.runner]
        + [_fmt(v) for v in r.acceptance_by_output_bucket]
        + ["—"] * (width - len(r.acceptance_by_output_bucket))
        for r in decay
    ]
    return [markdown_table(header, rows)]


def _memory_lines(results: BenchResults) -> list[str]:
    """Parameters and RSS per runner kind, the run's peak RSS, each model's load time."""
    c = results.config
    lines = []
    by_runner = results.memory.get("by_runner") or {c.get("runner"): results.memory}
    for kind, m in by_runner.items():
        before, after = m.get("rss_before_load_bytes"), m.get("rss_after_draft_bytes")
        lines += [
            f"- {kind}: parameters held: target {_mib(m.get('target_param_bytes'))}, "
            f"draft {_mib(m.get('draft_param_bytes'))} "
            f"(draft overhead {_fmt(m.get('draft_overhead_pct'), '{:.1f}')} % of the target); "
            f"RSS added by loading both {_mib(after - before if None not in (before, after) else None)}",
        ]
    lines.append(f"- peak RSS of the whole run: {_mib(results.memory.get('peak_rss_bytes'))}")
    lines += [
        f"- {model.get('runner', c.get('runner'))} {model['role']} `{model['name']}`: loaded in "
        f"{model['load_time_s']:.1f} s"
        for model in results.models
    ]
    return lines


def _optional_sections(results: BenchResults) -> list[str]:
    """The sections only some runs have: cost curves, prefill, quality, audit, plots."""
    lines = []
    if results.curves:
        lines += ["", "## Cost of one target pass (ms, median)", "", markdown_table(*curve_rows(results.curves))]
    if results.prefill:
        lines += ["", "## One prefill from an empty cache", "", markdown_table(*prefill_rows(results.prefill))]
    if results.quality:
        lines += [
            "",
            "## Agreement with the float32 model (teacher-forced on its greedy output)",
            "",
            markdown_table(*quality_rows(results.quality)),
        ]
    a = results.audit
    if a.get("audited"):
        lines += [
            "",
            "## Audit",
            "",
            f"{a['audited']} audited: {a['agreed']} agreed, {a['disagreed']} disagreed, {a['sampled']} sampling audits "
            f"(target log-prob per token: output {_fmt(a.get('mean_output_logprob'), '{:.3f}')}, plain "
            f"{_fmt(a.get('mean_plain_logprob'), '{:.3f}')}).",
        ]
    if results.plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in results.plots]
    return lines
