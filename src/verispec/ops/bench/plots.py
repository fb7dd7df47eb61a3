"""PNG plots of a benchmark summary (matplotlib, Agg backend: no display needed).

Four figures: speedup by category and runner, acceptance by draft position, acceptance by
output position (long-text decay) and tokens/s of every runner (verispec beside its peers).
Knows nothing about running; reads :class:`SummaryRow` lists only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from verispec.ops.bench.figures import ALL, SummaryRow
from verispec.metrics import OUTPUT_BUCKET_TOKENS

PLOT_FILES = {
    "speedup": "speedup_by_category.png",
    "draft_position": "acceptance_by_draft_position.png",
    "output_position": "acceptance_by_output_position.png",
    "throughput": "tokens_per_s_vs_peers.png",
}


def write_plots(summary: Sequence[SummaryRow], out_dir: Path) -> list[str]:
    """Draw the four PNGs into ``out_dir``; returns their file names (relative to it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, draw in (("speedup", _speedup), ("draft_position", _draft_position), ("output_position", _output_position), ("throughput", _throughput)):
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        draw(ax, summary)
        fig.tight_layout()
        fig.savefig(out_dir / PLOT_FILES[key])
        plt.close(fig)
        written.append(PLOT_FILES[key])
    return written


def _speedup(ax, summary: Sequence[SummaryRow]) -> None:
    categories = list(dict.fromkeys(r.category for r in summary))
    runners = [n for n in dict.fromkeys(r.runner for r in summary) if not n.endswith((":none", ":plain"))]
    index = {(r.runner, r.category): r.speedup for r in summary}
    width = 0.8 / max(1, len(runners))
    for i, runner in enumerate(runners):
        xs = [c + (i - (len(runners) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(xs, [index.get((runner, c)) or 0.0 for c in categories], width, label=runner)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain decoding (geomean)")
    ax.set_title("Speedup by category")
    if runners:
        ax.legend(fontsize=8)


def _draft_position(ax, summary: Sequence[SummaryRow]) -> None:
    for r in summary:
        if r.category == ALL and r.acceptance_per_position:
            ax.plot(range(1, len(r.acceptance_per_position) + 1), r.acceptance_per_position, marker="o", label=r.runner)
    ax.set_xlabel("draft position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    if ax.lines:
        ax.legend(fontsize=8)


def _output_position(ax, summary: Sequence[SummaryRow]) -> None:
    for r in summary:
        if r.category == ALL and r.acceptance_by_output_bucket:
            points = [(b * OUTPUT_BUCKET_TOKENS, v) for b, v in enumerate(r.acceptance_by_output_bucket) if v is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=r.runner)
    ax.set_xlabel(f"output position (bucket start, {OUTPUT_BUCKET_TOKENS} tokens per bucket)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by output position")
    if ax.lines:
        ax.legend(fontsize=8)


def _throughput(ax, summary: Sequence[SummaryRow]) -> None:
    rows = [r for r in summary if r.category == ALL]
    names = [r.runner for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.decode_tokens_per_s or 0.0 for r in rows], 0.4, label="decode tokens/s")
    ax.bar([x + 0.2 for x in xs], [r.total_tokens_per_s or 0.0 for r in rows], 0.4, label="end-to-end tokens/s")
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.set_ylabel("tokens/s (mean over prompts)")
    ax.set_title("Tokens/s: verispec and peers")
    ax.legend(fontsize=8)
