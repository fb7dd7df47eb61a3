"""What :func:`verispec.training.loop.train_head` returns and reports for a fixed seed, pinned
against a file written by the loop before it was split into steps (issue 56): the batch order
(a resumed run's included), the counts and the callbacks exactly; the losses and agreements to
float32's last digits (another CPU may round a matrix product differently).

``PIN_WRITE=1`` rewrites the expected file from the current code: only for a change that is meant.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from helpers import VOCAB, greedy_continuations, single_thread, tiny_qwen2
from verispec.runners.cpu.reduced_vocab import token_counts
from verispec.runners.eagle.head import EagleHead, choose_draft_vocabulary
from verispec.training.loop import TrainOptions, train_head

PIN = Path(__file__).resolve().parent / "data" / "train_head_pin.json"
FLOATS = ("losses", "top1", "held_out_top1_by_step", "held_out_loss_before", "held_out_loss", "held_out_top1_before")


def run() -> dict:
    """A resumed 5-step run over 16 sequences (4 held out), its report and what the callbacks saw."""
    target = tiny_qwen2(0)
    sequences = greedy_continuations(target, seed=1, num=16) + [[3]]  # a 1-token sequence: skipped
    draft_ids = choose_draft_vocabulary(token_counts(sequences, VOCAB), 64, eos_token_ids=[95])
    head = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=4)
    options = TrainOptions(steps=5, steps_before=2, lr=2e-3, batch_positions=40, window=20, held_out=0.25, seed=3)
    teacher_calls, step_calls = [], []
    report = train_head(
        head,
        target,
        sequences,
        options,
        on_step=lambda step, loss, top1, rate: step_calls.append([step, loss, top1]),
        on_teacher=lambda done, total: teacher_calls.append([done, total]),
    )
    return {
        "steps": report.steps,
        "positions": report.positions,
        "losses": report.losses,
        "top1": report.top1,
        "held_out_loss_before": report.held_out_loss_before,
        "held_out_top1_before": report.held_out_top1_before,
        "held_out_loss": report.held_out_loss,
        "held_out_top1": report.held_out_top1,
        "held_out_top1_by_step": report.held_out_top1_by_step,
        "on_teacher": teacher_calls,
        "on_step": step_calls,
        "head_weight_sum": float(sum(p.detach().double().sum() for p in head.parameters())),
    }


def close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-4, abs=1e-6)
    return a == b


def test_train_head_is_pinned():
    got = run()
    if os.environ.get("PIN_WRITE") == "1":
        PIN.parent.mkdir(exist_ok=True)
        PIN.write_text(json.dumps(got, indent=1) + "\n", encoding="utf-8")
    expected = json.loads(PIN.read_text(encoding="utf-8"))
    assert got.keys() == expected.keys()
    assert [got["steps"], got["positions"], got["on_teacher"]] == [
        expected["steps"],
        expected["positions"],
        expected["on_teacher"],
    ]
    assert [s[0] for s in got["on_step"]] == [s[0] for s in expected["on_step"]]
    for key in got:
        assert close(got[key], expected[key]), key
