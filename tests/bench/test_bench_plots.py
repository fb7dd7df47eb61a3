"""The PNGs say where they were measured, and their legends and axes stay readable (issue 44,
item 9): a footer with date, host, workload and prompt count; the speedup legend beside the bars,
not over them; the output-position axis spanning the buckets, even a single one."""

import pytest

from bench_support import record, spec
from verispec.bench.figures import summarize
from verispec.bench.plots import PLOT_FILES, draw_figures, plot_caption, write_plots
from verispec.metrics import OUTPUT_BUCKET_TOKENS

CONFIG = {"workload": "specbench", "num_prompts": 26, "runner": "gguf", "max_tokens": 128}
ENVIRONMENT = {
    "cpu_model": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
    "kernel_isa": "avx512",
    "threads": 2,
    "machine": "x86_64",
}
CAPTION = plot_caption(CONFIG, ENVIRONMENT, "2026-12-05T10:00:00+00:00")


def one_bucket_records():
    """Two categories, three methods, every answer within one output bucket."""
    rows = []
    for category in ("coding", "qa"):
        for prompt in ("p1", "p2"):
            name = f"{category}-{prompt}"
            rows.append(record("gguf:none", name, 10.0, category=category))
            for method, tps in (("draft", 19.0), ("ngram", 18.0), ("auto", 20.0)):
                rows.append(
                    record(
                        f"gguf:{method}",
                        name,
                        tps,
                        category=category,
                        spec=spec(2, 8, 6, ([2, 2, 1, 1], [2, 2, 2, 2]), ([6], [8])),
                    )
                )
    return rows


@pytest.fixture
def figures():
    drawn = draw_figures(summarize(one_bucket_records()), CAPTION)
    yield drawn
    import matplotlib.pyplot as plt

    for fig in drawn.values():
        plt.close(fig)


def test_caption_names_date_host_kernels_workload_and_prompts():
    assert CAPTION == (
        "2026-12-05 · Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, gguf kernels avx512, 2 threads · "
        "workload specbench, 26 prompts · runner gguf · max 128 new tokens"
    )
    assert plot_caption({}, {}, "") == "undated · unknown CPU"  # an old results file: nothing invented


def test_every_figure_carries_the_caption(figures):
    assert set(figures) == set(PLOT_FILES)
    for key, fig in figures.items():
        assert [t.get_text() for t in fig.texts] == [CAPTION], key


def test_speedup_legend_sits_outside_the_bars(figures):
    fig = figures["speedup"]
    fig.canvas.draw()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # beside the axes, so over no bar
    assert legend.x1 <= fig.bbox.x1 + 1  # and still inside the picture
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["gguf:draft", "gguf:ngram", "gguf:auto"]


def test_output_position_axis_spans_a_single_bucket(figures):
    (ax,) = figures["output_position"].axes
    assert ax.get_xlim() == (0.0, float(OUTPUT_BUCKET_TOKENS))  # was -0.04 .. 0.04 around one point at 0
    assert [list(line.get_xdata()) for line in ax.lines] == [[OUTPUT_BUCKET_TOKENS / 2]] * 3  # mid-bucket, per method


def test_write_plots_writes_the_four_files(tmp_path):
    written = write_plots(summarize(one_bucket_records()), tmp_path, CAPTION)
    assert written == list(PLOT_FILES.values())
    assert all((tmp_path / name).stat().st_size > 0 for name in written)
