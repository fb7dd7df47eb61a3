"""What the README claims against llama.cpp is said per host, and every figure of it is on the
benchmarks page (issue 44, item 12: "faster than llama.cpp on a CPU" did not hold on a Xeon)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_SECTION = "### Against llama.cpp, per host"
BENCHMARKS_SECTION = "## Against llama.cpp, host by host"


def section(path: Path, heading: str) -> str:
    text = path.read_text(encoding="utf-8")
    assert heading in text, f"{path.name} has no {heading!r}"
    body = text.split(heading, 1)[1]
    level = heading.split(" ", 1)[0]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", body, flags=re.M)]
    return body[: ends[0]] if ends else body


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/install.md"])
def test_no_page_claims_plain_decoding_beats_llama_cpp_on_every_cpu(page):
    text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
    assert "faster than llama.cpp on a CPU" not in text


def test_every_figure_of_the_readme_host_table_is_on_the_benchmarks_page():
    readme = section(ROOT / "README.md", README_SECTION)
    benchmarks = " ".join(section(ROOT / "docs/benchmarks.md", BENCHMARKS_SECTION).split())
    figures = re.findall(r"\d+\.\d+(?:-\d+\.\d+)?x", readme)
    assert len(figures) >= 8  # three hosts, plain and speculative
    for figure in figures:
        assert figure in benchmarks, figure
    for host in ("Zen 3", "Xeon", "AVX-512 VNNI"):  # one row per host kind measured
        assert host in readme and host in benchmarks


def test_the_readme_headline_is_the_latest_run_of_one_command_per_host():
    # issue 54, item 9: the headline was a 2026-12-01 table of another CPU's (64 tokens, k = 5)
    headline = section(ROOT / "README.md", "## Headline figures").split("\n### ")[0]  # before the per-host claims
    latest = " ".join(section(ROOT / "docs/benchmarks.md", "## Latest run per host").split())
    rows = [line for line in headline.splitlines() if line.startswith("| AMD") or line.startswith("| Intel")]
    assert len(rows) >= 2  # one row per host measured with the command
    for row in rows:
        assert re.search(r"20\d\d-\d\d-\d\d", row) and ("Zen" in row or "Xeon" in row)  # dated, the CPU named
    figures = re.findall(r"\d+\.\d+x?", "\n".join(rows))
    assert figures and all(figure in latest for figure in figures)
    assert headline.count("verispec bench") == 1  # one command
