"""PNG plots of a benchmark summary (matplotlib, Agg backend: no display needed).

Four figures: speedup by category and runner, acceptance by draft position, acceptance by
output position (long-text decay) and tokens/s of every runner (verispec beside its peers), each
with a footer saying when, where and on what it was measured (:func:`plot_caption`), so a PNG
passed around on its own still says which host it speaks for. Knows nothing about running; reads
:class:`SummaryRow` lists and the results' settings only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from verispec.bench.figures import ALL, SummaryRow
from verispec.metrics import OUTPUT_BUCKET_TOKENS

PLOT_FILES = {
    "speedup": "speedup_by_category.png",
    "draft_position": "acceptance_by_draft_position.png",
    "output_position": "acceptance_by_output_position.png",
    "throughput": "tokens_per_s_vs_peers.png",
}


def plot_caption(config: dict, environment: dict, created_at: str) -> str:
    """The footer of every plot: date, host (CPU model, gguf kernel path, threads), workload and
    prompt count, runners and new tokens, from a results document's ``config``, ``environment``
    and ``created_at`` (:class:`verispec.bench.results.BenchResults`); missing facts are left
    out."""
    host = environment.get("cpu_model") or environment.get("machine") or "unknown CPU"
    if environment.get("kernel_isa"):
        host += f", gguf kernels {environment['kernel_isa']}"
    if environment.get("threads"):
        host += f", {environment['threads']} threads"
    parts = [created_at[:10] or "undated", host]
    if config.get("workload"):
        parts.append(f"workload {config['workload']}, {config.get('num_prompts', '?')} prompts")
    if config.get("runner"):
        parts.append(f"runner {config['runner']}")
    if config.get("max_tokens"):
        parts.append(f"max {config['max_tokens']} new tokens")
    return " · ".join(parts)


def draw_figures(summary: Sequence[SummaryRow], caption: str = "") -> dict:
    """The four figures as matplotlib Figures, ``{key of PLOT_FILES: Figure}``, each with
    ``caption`` as its footer; the caller closes them (:func:`write_plots` does)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}
    for key, draw in (
        ("speedup", _speedup),
        ("draft_position", _draft_position),
        ("output_position", _output_position),
        ("throughput", _throughput),
    ):
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        draw(ax, summary)
        if caption:
            fig.text(0.01, 0.01, caption, fontsize=7, color="0.3", ha="left", va="bottom", wrap=True)
        fig.tight_layout(rect=(0, 0.05 if caption else 0, 1, 1))
        figures[key] = fig
    return figures


def write_plots(summary: Sequence[SummaryRow], out_dir: Path, caption: str = "") -> list[str]:
    """Draw the four PNGs into ``out_dir`` (footer ``caption``, see :func:`plot_caption`);
    returns their file names (relative to it)."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, fig in draw_figures(summary, caption).items():
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
    if runners:  # beside the axes, right: inside, it covers a bar whatever the place
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _draft_position(ax, summary: Sequence[SummaryRow]) -> None:
    for r in summary:
        if r.category == ALL and r.acceptance_per_position:
            ax.plot(range(1, len(r.acceptance_per_position) + 1), r.acceptance_per_position, marker="o", label=r.runner)
    ax.set_xlabel("draft position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    _acceptance_axis(ax, "Acceptance by draft position")


def _output_position(ax, summary: Sequence[SummaryRow]) -> None:
    num_buckets = 1
    for r in summary:
        if r.category == ALL and r.acceptance_by_output_bucket:
            points = [
                ((b + 0.5) * OUTPUT_BUCKET_TOKENS, v)
                for b, v in enumerate(r.acceptance_by_output_bucket)
                if v is not None
            ]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=r.runner)
            num_buckets = max(num_buckets, len(r.acceptance_by_output_bucket))
    ax.set_xlim(0, num_buckets * OUTPUT_BUCKET_TOKENS)  # the buckets' span, even for a single bucket
    if num_buckets <= 16:
        ax.set_xticks(range(0, (num_buckets + 1) * OUTPUT_BUCKET_TOKENS, OUTPUT_BUCKET_TOKENS))
    ax.set_xlabel(f"output position (tokens; each point a {OUTPUT_BUCKET_TOKENS}-token bucket, at its middle)")
    _acceptance_axis(ax, "Acceptance by output position")


def _acceptance_axis(ax, title: str) -> None:
    """The acceptance plots' y axis (0 to 1), title and legend (when anything was drawn)."""
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
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
