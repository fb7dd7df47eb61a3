"""The exact text of ``advise``'s terminal rendering and of report.md, and the exact records of a
session workload, pinned against files written by the code before it was split into steps
(issue 56): a refactoring must leave every byte as it was.

The inputs are fixed here (a faked advice; a real run's results.json, trimmed of its records,
varied to reach every section of the report; faked engines and a faked clock for the sessions).
``PIN_WRITE=1`` rewrites the expected files from the current code: do that only for a change of
output that is meant, and review the diff.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from verispec.bench.advise import Advice, DrafterFit, Verdict
from verispec.bench.advise_render import render
from verispec.bench.figures import ALL
from verispec.bench.report import report_markdown
from verispec.bench.results import BenchResults
from verispec.bench.sessions import run_sessions

PINS = Path(__file__).resolve().parent / "data" / "pins"


def check_pin(name: str, text: str) -> None:
    """``text`` equals the stored ``PINS / name`` (written instead under ``PIN_WRITE=1``)."""
    path = PINS / name
    if os.environ.get("PIN_WRITE") == "1":
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")


def fit(method: str, category: str, alpha: float | None, measured: float | None) -> DrafterFit:
    return DrafterFit(method, category, alpha, 0.875, 0.0425, 0.05, 8, 3.0912, 4, 2.5, measured, num_tested_tokens=120)


def advice(full: bool) -> Advice:
    """An advice with every optional line (``full``) or without them."""
    fits = [fit("ngram", ALL, 0.71, 1.83), fit("draft", ALL, None, None), fit("ngram", "code", 0.8, 2.0)]
    table = [
        {"method": m, "k": k, "expected_tokens": 1 + k * a, "leviathan_speedup": 1 + k * a / 2, "curve_speedup": None}
        for m, a in (("ngram", 0.31), ("draft", 0.12))
        for k in (1, 2, 4)
    ]
    verdicts = [
        Verdict("code", "GO", "ngram", 4, "α 0.80 over break-even 0.05"),
        Verdict("chat", "NO-GO", None, None, "no drafter pays", sample="12 draft tokens; 200 would do"),
        Verdict("all", "GO" if full else "NO-GO", "ngram" if full else "draft", 4 if full else None, "overall"),
    ]
    memory = {
        "context_length": 4096,
        "target_param_bytes": 988 * 2**20,
        "target_kv_bytes": 48 * 2**20,
        "draft_param_bytes": 0 if full else 350 * 2**20,
        "draft_kv_bytes": 0 if full else 12 * 2**20,
        "total_bytes": 1036 * 2**20 if full else 1398 * 2**20,
        "draft_overhead_pct": 0.0 if full else None,
        "head_overhead_pct": 4.25 if full else None,
        "head_within_limit": True,
        "head_param_bytes": 40 * 2**20,
        "head_kv_bytes": 2 * 2**20,
        "budget_bytes": 1024 * 2**20 if full else None,
        "fits": False,
        "fits_without_draft": True,
    }
    cost = {
        "before_per_million_tokens": 12.345,
        "plain_tokens_per_s": 41.5,
        "after_per_million_tokens": 7.01,
        "method": "ngram",
        "chosen_tokens_per_s": 73.25,
        "gpu_cost_per_month": 1500.0,
        "cached_prompt_fraction": 0.4,
    }
    settings = {"ngram": {"transformers": {"prompt_lookup_num_tokens": 4}, "vllm": {"method": "ngram"}}}
    return Advice(4, {1: 0.0121, 2: 0.0125, 4: 0.0131}, fits, table, verdicts, memory, cost if full else None, settings)


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("terminal", [True, False])
def test_advise_rendering_is_pinned(full, terminal):
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=terminal, color_system="standard" if terminal else None)
    render(advice(full), console)
    check_pin(f"advise_{'full' if full else 'bare'}_{'terminal' if terminal else 'log'}.txt", out.getvalue())


def report_input(variant: str) -> BenchResults:
    """The stored run (``as_run``), or it varied to reach the other sections of the report."""
    data = json.loads((PINS / "report_input.json").read_text(encoding="utf-8"))
    if variant == "mismatched":
        data["config"]["dtype"] = "bfloat16"
        data["exactness"] = {
            "greedy": True,
            "compared": True,
            "all_equal": False,
            "mismatches": [{"runner": "gguf:ngram", "prompt_id": "HumanEval/3", "category": "humaneval"}],
        }
        data["memory"].pop("by_runner")
        data["runners"][0]["load_time_s"] = 1.25
        data["curves"] = {"gguf": {"target": {"1": 10.0, "2": 10.5, "8": 14.25}, "draft": {"1": 1.5}}, "hf": {}}
        data["prefill"] = {"gguf": {"128": {"tokens_per_s": 801.25}, 512: {"tokens_per_s": 640.5}}}
        data["quality"] = {"gguf": {"positions": 512, "top1_agreement": 0.98125, "mean_kl_nats": 0.001234}}
        data["audit"] |= {"audited": 7, "agreed": 6, "disagreed": 1, "sampled": 2, "mean_output_logprob": -0.25}
        data["plots"] = []
        for row in data["summary"]:
            row["acceptance_by_output_bucket"] = [0.5] if row["method"] == "auto" else []
            row["speedup_vs_llama_cpp"] = None
    elif variant == "sampled":
        data["config"]["temperature"] = 0.7
        data["exactness"] = {"greedy": False, "compared": False, "all_equal": False, "mismatches": []}
        data["environment"].pop("kernel_isa")
        for row in data["summary"]:
            row["acceptance_by_output_bucket"] = []
    elif variant == "coupled":
        data["exactness"] = {"greedy": False, "compared": True, "all_equal": True, "mismatches": []}
    return BenchResults.from_dict(data)


@pytest.mark.parametrize("variant", ["as_run", "mismatched", "sampled", "coupled"])
def test_report_markdown_is_pinned(variant):
    check_pin(f"report_{variant}.md", report_markdown(report_input(variant)))


class FakeEngine:
    """Answers a prompt with tokens derived from its length; ``cached``: reports the prompt's
    common prefix with the previous one as read from the cache; ``odd``: the request (0-based)
    whose last token differs."""

    def __init__(self, cached: bool, odd: int | None = None):
        self.prefix_cache, self.cached, self.odd = SimpleNamespace(clear=lambda: None), cached, odd
        self.previous, self.calls = [], 0

    def generate(self, ids, params, spec):
        self.calls += 1
        common = next(
            (i for i, (a, b) in enumerate(zip(ids, self.previous)) if a != b), min(len(ids), len(self.previous))
        )
        self.previous = list(ids)
        tokens = [(len(ids) * 7 + i) % 50 for i in range(params.max_tokens - len(ids) % 3)]
        if self.calls - 1 == self.odd:
            tokens[-1] += 1
        metrics = SimpleNamespace(cached_tokens=common if self.cached else 0, ttft_ms=len(ids) / 8)
        return SimpleNamespace(token_ids=tokens, text="".join(chr(97 + t % 26) for t in tokens), metrics=metrics)


class FakeTokenizer:
    chat_template = "{{ messages }}"
    bos_token = bos_token_id = None

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content'][:40]}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 90 for c in text]


def fake_pipe(odd: int | None):
    engines = iter([FakeEngine(cached=True), FakeEngine(cached=False, odd=odd)])
    tokenizer = FakeTokenizer()
    return SimpleNamespace(
        prefix_cache=SimpleNamespace(),
        tokenizer=tokenizer,
        target=SimpleNamespace(name="fake"),
        engine_with_own_suffix_cache=lambda: next(engines),
        encode=tokenizer.encode,
    )


class FakePeer:
    def __init__(self):
        self.reuse_prompt, self.llm, self.calls = False, SimpleNamespace(reset=lambda: None), 0

    def generate(self, ids, params):
        self.calls += 1
        metrics = SimpleNamespace(cached_tokens=None, ttft_ms=len(ids) / 4)
        return SimpleNamespace(token_ids=[1] * (self.calls % 4 + 1), text="x", metrics=metrics)


@pytest.mark.parametrize("workload", ["multiturn", "completion"])
def test_session_records_are_pinned(workload, monkeypatch):
    ticks = iter(range(0, 10**6, 3))
    monkeypatch.setattr("verispec.bench.sessions.time.perf_counter", lambda: next(ticks) / 1e3)
    seen = []
    peer = FakePeer()
    results = run_sessions(
        fake_pipe(odd=None if workload == "completion" else 2),
        workload,
        method="ngram",
        max_tokens=9,
        peer=peer,
        num_sessions=2 if workload == "multiturn" else 3,
        on_request=lambda name, request: seen.append(
            [name, request.session, request.turn, len(request.prompt_token_ids)]
        ),
        editor_requests=["def f(x):\n", "def f(x):\n    return", "def f(x):\n    return x + 1\n", "unused"],
    )
    assert peer.reuse_prompt
    document = results.to_dict() | {"on_request": seen}
    check_pin(f"sessions_{workload}.json", json.dumps(document, indent=1, ensure_ascii=False) + "\n")


def test_the_multiturn_pin_covers_a_mismatch():
    """The faked uncached engine differs on one prompt: an ``identical`` False is pinned too."""
    data = json.loads((PINS / "sessions_multiturn.json").read_text(encoding="utf-8"))
    assert {r["identical"] for r in data["records"]} == {True, False, None}
