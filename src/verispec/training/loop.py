"""Training an EAGLE-3 head by self-distillation from its target (Li et al. 2025, "EAGLE-3",
arXiv 2503.01840, §3: feature fusion, no feature loss, training-time test).

Owns, over the teacher data (:mod:`verispec.training.teacher`: the target run teacher-forced over
the caller's token sequences), the training-time-test unroll and its attention mask, the loss, the
optimiser loop and the held-out agreement. Knows nothing about the engine, drafting policy or where sequences come from.

Alignment, for a sequence ``x_0 .. x_{L-1}`` whose target features are ``f_t`` and whose target
next-token distributions are ``P_t`` (``P_t`` predicts ``x_{t+1}``): draft step ``j`` at anchor
``t`` feeds the embedding of ``x_{t+j+1}`` with ``f_t`` (step 0) or the head's own output of step
``j - 1`` (steps >= 1), sits at position ``t + j``, and is trained towards ``P_{t+j+1}`` restricted
to the draft vocabulary (soft cross-entropy), with weight ``step_decay ** j``. Step ``j``'s row
attends to step 0's rows of anchors ``<= t`` of its window (causal) and to its own anchor's rows
of steps ``1 .. j`` (the diagonal), which is what the head's cache holds when it drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError
from verispec.runners.eagle.head import EagleHead
from verispec.training.step import (  # noqa: F401  (re-exported: the loop's public names before the step had its room)
    TrainStep,
    distillation_loss,
    make_optimizer,
    target_draft_head,
    ttt_unroll,
)
from verispec.training.teacher import Teacher, runner_teacher, teacher  # noqa: F401  (runner_teacher: re-exported)

Window = tuple[int, int, int]  # (sequence index, first anchor, end anchor): anchors start .. end - 1


@dataclass
class TrainOptions:
    """Budget and optimiser settings of :func:`train_head`.

    Attributes:
        steps / minutes: stop after this many optimiser steps / minutes of wall time, whichever
            comes first (None: no such limit; at least one must be set).
        lr, weight_decay: AdamW's; max_grad_norm: gradient clipping (EAGLE's 0.5).
        batch_positions: anchors per optimiser step (whole windows are added until reached).
        window: anchors the head attends over at most; longer sequences are cut into windows
            (the target still sees each whole sequence).
        ttt_steps: draft steps unrolled (EAGLE-3 §3, "training-time test"); step_decay: loss
            weight ratio between consecutive steps.
        held_out: fraction of the sequences kept for the agreement figures; seed: the split, the
            batch order (the head's initialisation is its own seed).
        steps_before: optimiser steps earlier runs took on the same data (``--resume``): the
            batch order continues after them instead of starting over.
        precision: ``"f32"`` or ``"bf16"`` (fp32 master weights, bf16 matrix products, fp32 loss:
            :mod:`verispec.training.step`; :func:`~verispec.training.precision.choose_precision`
            says which pays on a host). Checkpoints and the optimiser state are fp32 either way.
    """

    steps: int | None = 200
    minutes: float | None = None
    lr: float = 3e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    batch_positions: int = 512
    window: int = 512
    ttt_steps: int = 3
    step_decay: float = 0.8
    held_out: float = 0.1
    seed: int = 0
    steps_before: int = 0
    precision: str = "f32"

    def __post_init__(self) -> None:
        """Raises InvalidParameterError naming the first setting out of range (before any data is made)."""
        checks = [
            (self.steps is None or self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
            (self.minutes is None or self.minutes > 0, f"minutes must be > 0, got {self.minutes}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.max_grad_norm > 0, f"max_grad_norm must be > 0, got {self.max_grad_norm}"),
            (self.batch_positions >= 1, f"batch_positions must be >= 1, got {self.batch_positions}"),
            (self.window >= 1, f"window must be >= 1, got {self.window}"),
            (self.ttt_steps >= 1, f"ttt_steps must be >= 1, got {self.ttt_steps}"),
            (0 <= self.held_out < 1, f"held_out must be in [0, 1), got {self.held_out}"),
            (self.precision in ("f32", "bf16"), f"precision must be f32 or bf16, not {self.precision!r}"),
        ]
        for ok, message in checks:
            if not ok:  # NaN fails every comparison: refused too
                raise InvalidParameterError(message)


@dataclass
class TrainReport:
    """What :func:`train_head` did.

    Attributes:
        losses, top1: per optimiser step, the weighted soft cross-entropy (nats) and the batch's
            first-step agreement (fraction).
        held_out_top1_before / held_out_top1: first-draft-step agreement on the held-out
            sequences before and after training: the head's argmax mapped to target ids equals
            the target's own argmax (over its full vocabulary). NaN without held-out positions.
        held_out_top1_by_step: the same after training, per unrolled step.
        held_out_loss_before / held_out_loss: the weighted loss there.
        positions: anchors trained on (repeats counted); seconds: wall time of the loop.
    """

    losses: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    held_out_top1_before: float = float("nan")
    held_out_top1: float = float("nan")
    held_out_top1_by_step: list[float] = field(default_factory=list)
    held_out_loss_before: float = float("nan")
    held_out_loss: float = float("nan")
    steps: int = 0
    positions: int = 0
    seconds: float = 0.0


@dataclass
class Batch:
    """Packed windows of anchors (``P`` rows) and their ``K`` unrolled steps.

    Attributes:
        features: ``[P, layers * hidden]`` target features of the anchors.
        positions, segments: int64 ``[P]`` anchor position ``t`` and window index within the batch.
        token_ids, target_argmax: int64 ``[K, P]`` token ``x_{t+j+1}`` fed at step ``j``; the
            target's argmax at ``t+j+1`` (the token step ``j`` should draft).
        teacher_hidden: ``[K, P, hidden]`` the target's final hidden state at ``t+j+1``.
        valid: bool ``[K, P]`` whether ``t + j + 1`` lies inside the sequence.
    """

    features: Tensor
    positions: Tensor
    segments: Tensor
    token_ids: Tensor
    target_argmax: Tensor
    teacher_hidden: Tensor
    valid: Tensor


def pack(
    teachers: Sequence[Teacher], windows: Sequence[Window], ttt_steps: int, device: torch.device | str = "cpu"
) -> Batch:
    """A :class:`Batch` of windows ``(sequence index, first anchor, end anchor)``, on ``device``
    (the teacher's tensors stay where they are: on the CPU, with the teacher cache)."""
    parts = []
    for segment, (index, start, stop) in enumerate(windows):
        data, anchors = teachers[index], torch.arange(start, stop)
        last = data.token_ids.numel() - 1
        ahead = anchors[None, :] + torch.arange(1, ttt_steps + 1)[:, None]  # [K, rows]: t + j + 1
        rows = ahead.clamp(max=last)
        segments = torch.full_like(anchors, segment)
        parts.append(
            (
                data.features[anchors],
                anchors,
                segments,
                data.token_ids[rows],
                data.target_argmax[rows],
                data.final_hidden[rows],
                ahead <= last,
            )
        )
    columns = list(zip(*parts))
    dims = (0, 0, 0, 1, 1, 1, 1)
    return Batch(*(torch.cat(column, dim=dim).to(device) for column, dim in zip(columns, dims)))


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def windows_of(teachers: Sequence[Teacher], indices: Sequence[int], window: int) -> list[Window]:
    """Windows ``(sequence, first anchor, end anchor)`` of at most ``window`` anchors; anchors
    are ``0 .. L - 2`` (the last token has no next token to pair with)."""
    return [
        (i, start, min(start + window, teachers[i].token_ids.numel() - 1))
        for i in indices
        for start in range(0, teachers[i].token_ids.numel() - 1, window)
    ]


def batches(windows: Sequence[Window], batch_positions: int) -> list[list[Window]]:
    """Consecutive windows grouped until each group holds ``batch_positions`` anchors."""
    groups, current, size = [], [], 0
    for w in windows:
        current.append(w)
        size += w[2] - w[1]
        if size >= batch_positions:
            groups.append(current)
            current, size = [], 0
    return groups + ([current] if current else [])


@torch.no_grad()
def evaluate(
    head: EagleHead, teachers: Sequence[Teacher], groups: Sequence[Sequence[Window]], target_head, options: TrainOptions
) -> tuple[float, list[float]]:
    """Weighted loss (mean over the batches ``groups``) and per-step agreement (fraction of
    valid rows)."""
    losses, hits, counts = [], [0] * options.ttt_steps, [0] * options.ttt_steps
    for group in groups:
        batch = pack(teachers, group, options.ttt_steps, head.fc.weight.device)
        loss, agreements = distillation_loss(head, batch, target_head, options.step_decay)
        losses.append(float(loss))
        for step, agree in enumerate(agreements):
            hits[step] += int(agree.sum())
            counts[step] += agree.numel()
    nan = float("nan")
    return (sum(losses) / len(losses) if losses else nan), [h / c if c else nan for h, c in zip(hits, counts)]


def _within_budget(options: TrainOptions, steps_done: int, seconds: float) -> bool:
    steps_left = options.steps is None or steps_done < options.steps
    return steps_left and (options.minutes is None or seconds < 60 * options.minutes)


def train_head(
    head: EagleHead,
    target: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    options: TrainOptions | None = None,
    on_step: Callable[[int, float, float, float], None] | None = None,
    on_teacher: Callable[[int, int], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    read: Callable[[Sequence[int]], Teacher] | None = None,
) -> TrainReport:
    """Train ``head`` (in place, AdamW) to draft what ``target`` would say (EAGLE-3 §3).

    Args:
        target: the transformers causal LM the head was built for (``EagleHead.from_target``);
            left unchanged, run once per sequence.
        sequences: token id lists (length >= 2 used, others skipped), e.g. the target's own
            outputs; a seeded ``held_out`` fraction is kept out of training.
        on_step: called after each optimiser step with ``(step, loss, top1, rate)``: the 1-based
            step, its loss and first-step agreement, and the anchors trained per second of the
            loop so far (the held-out evaluation before it not counted).
        on_teacher: called with ``(done, total)`` as the target reads each sequence (before the
            budget starts: one float32 forward per sequence, minutes on a CPU for a real target).
        optimizer: the optimiser to step (:func:`make_optimizer`, e.g. with an earlier run's
            state); None: a new AdamW.
        read: how the target reads one sequence (e.g. :func:`runner_teacher` over the gguf
            runner); None: :func:`teacher` over ``target`` (float32 transformers). ``target``'s
            ``lm_head`` rows give the draft-vocabulary distributions either way.
    Returns:
        :class:`TrainReport`. Deterministic for a fixed seed and a ``steps`` budget.
    Raises:
        InvalidParameterError: no budget, bad options, or no sequence of length >= 2 to train on.
    """
    options = options or TrainOptions()
    if options.steps is None and options.minutes is None:
        raise InvalidParameterError("train_head needs a budget: steps, minutes or both")
    usable = [list(s) for s in sequences if len(s) >= 2]
    generator = torch.Generator().manual_seed(options.seed)
    order = torch.randperm(len(usable), generator=generator).tolist()
    num_held = round(len(usable) * options.held_out)
    if len(usable) - num_held < 1:
        raise InvalidParameterError("train_head needs at least one training sequence of two or more tokens")
    teachers = _read_teachers(head, target, usable, read, on_teacher)
    device = head.fc.weight.device  # where the head trains (--device); the teacher data stays on the CPU
    target_head = tuple(
        None if t is None else t.to(device) for t in target_draft_head(target, head.d2t.to(_device_of(target)))
    )
    held_groups = batches(windows_of(teachers, sorted(order[:num_held]), options.window), options.batch_positions)
    train_windows = windows_of(teachers, sorted(order[num_held:]), options.window)
    report = TrainReport()
    report.held_out_loss_before, before = evaluate(head, teachers, held_groups, target_head, options)
    report.held_out_top1_before = before[0]
    step = TrainStep(head, optimizer or make_optimizer(head, options), target_head, options)
    start, groups = time.monotonic(), _epochs(train_windows, options.batch_positions, generator)
    for _ in range(options.steps_before):  # earlier runs' batches: the order goes on after them
        next(groups)
    _optimise(report, step, lambda: pack(teachers, next(groups), options.ttt_steps, device), options, on_step, start)
    report.held_out_loss, report.held_out_top1_by_step = evaluate(head, teachers, held_groups, target_head, options)
    report.held_out_top1 = report.held_out_top1_by_step[0]
    return report


def _read_teachers(
    head: EagleHead,
    target: torch.nn.Module,
    usable: Sequence[list[int]],
    read: Callable[[Sequence[int]], Teacher] | None,
    on_teacher: Callable[[int, int], None] | None,
) -> list[Teacher]:
    """The target's reading of each sequence (``read``, or float32 :func:`teacher`), reported as it goes."""
    teachers = []
    for sequence in usable:
        teachers.append(read(sequence) if read is not None else teacher(target, sequence, head.shape.feature_layers))
        if on_teacher is not None:
            on_teacher(len(teachers), len(usable))
    return teachers


def _epochs(windows: Sequence[Window], batch_positions: int, generator: torch.Generator) -> Iterator[list[Window]]:
    """The training batches without end: each epoch the windows in a new seeded order."""
    while True:
        shuffled = [windows[i] for i in torch.randperm(len(windows), generator=generator).tolist()]
        yield from batches(shuffled, batch_positions)


def _optimise(
    report: TrainReport,
    step: TrainStep,
    next_batch: Callable[[], Batch],
    options: TrainOptions,
    on_step: Callable[[int, float, float, float], None] | None,
    start: float,
) -> None:
    """Optimiser steps on ``next_batch()`` until the budget (from ``start``) is spent, each in ``report``."""
    while _within_budget(options, report.steps, time.monotonic() - start):
        batch = next_batch()
        loss, agreements = step(batch)
        report.steps += 1
        report.positions += batch.positions.numel()
        report.losses.append(float(loss))
        report.top1.append(float(agreements[0].float().mean()) if agreements[0].numel() else float("nan"))
        if on_step is not None:
            rate = report.positions / max(time.monotonic() - start, 1e-9)
            on_step(report.steps, report.losses[-1], report.top1[-1], rate)
    report.seconds = time.monotonic() - start
