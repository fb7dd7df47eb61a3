"""The run of ``verispec train-head`` (:mod:`verispec.cli.train_head`): how the target reads the
data for the head (its runner or float32 transformers, behind the teacher cache) and the training
loop under a progress display, with checkpoints and Ctrl-C handled."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from verispec.cli.common import err


def reader(head, model, runner, kind: str, target: str, cache_option: str | None, out: Path):
    """How the target reads one sequence (``runner``'s passes, or float32 transformers where it
    is None), behind the teacher cache unless ``cache_option`` is ``none``; returns ``(read, cache
    or None)``."""
    from functools import partial

    from verispec.training.cache import TeacherCache, reader_identity
    from verispec.training.loop import runner_teacher, teacher

    layers = head.shape.feature_layers
    if runner is not None:
        read = partial(runner_teacher, runner, feature_layers=layers)
    else:
        read = lambda ids: teacher(model.model, ids, layers)  # noqa: E731
    if cache_option is not None and cache_option.lower() == "none":
        return read, None
    path = getattr(getattr(runner, "weights", None), "path", None)
    if path is None and Path(target).exists():
        path = Path(target)
    folder = Path(cache_option) if cache_option else out.with_name(out.name + ".teacher")
    cache = TeacherCache(folder, reader_identity(kind, f"{target}#{head.shape.target_norm_sha256}", path))
    return cache.reading(read, layers), cache


class _Checkpoints:
    """The head and its optimiser's state written beside ``out`` (every ``minutes`` while training)."""

    def __init__(self, head, out: Path, optimizer, optimizer_path: Path, weights: str, minutes: float) -> None:
        self.head, self.out, self.optimizer, self.optimizer_path = head, out, optimizer, optimizer_path
        self.weights, self.every_s, self.last = weights, 60 * minutes, time.monotonic()

    def save(self) -> None:
        from verispec.training.files import save_checkpoint

        save_checkpoint(self.head, self.out, self.optimizer, self.optimizer_path, self.weights)
        self.last = time.monotonic()

    def due(self) -> None:
        """Save if the last save is older than the interval."""
        if time.monotonic() - self.last > self.every_s:
            self.save()


class _Progress:
    """The target reading the data, then the training steps: a rich bar on a terminal, else a
    line on stderr every :data:`verispec.progress.LINE_EVERY_S` seconds (a log shows it too)."""

    def __init__(self, total: int | None, checkpoints: _Checkpoints) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.total, self.checkpoints = total, checkpoints
        self.start = self.train_start = self.last_line = time.monotonic()
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed}"),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
        )
        self.bar = Progress(*columns, console=err) if err.is_terminal else None
        self.reading = self.task = None

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.__enter__()
            self.reading = self.bar.add_task("the target reading the data", total=None, stats="")
            self.task = self.bar.add_task("training the head", total=self.total, stats="")
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def _line(self, text: str) -> None:
        print(f"verispec: {text}", file=sys.stderr, flush=True)
        self.last_line = time.monotonic()

    def on_step(self, step: int, loss: float, top1: float, rate: float) -> None:
        now = time.monotonic()
        stats = f"loss {loss:.3f}  top-1 {top1:.3f}  ~{rate:.0f} positions/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, stats=stats)
        elif step == 1 or now - self.last_line >= _line_every_s() or step == self.total:
            of = "" if self.total is None else f"/{self.total}"
            self._line(f"training the head · step {step}{of} · {stats} ({now - self.train_start:.0f} s)")
        self.checkpoints.due()

    def on_teacher(self, done: int, total: int) -> None:  # before training: one pass per sequence
        now = self.train_start = time.monotonic()
        if self.bar is not None:
            self.bar.update(self.reading, completed=done, total=total)
        elif done in (1, total) or now - self.last_line >= _line_every_s():
            text = f"the target reading the data (its features and distributions) {done}/{total}"
            self._line(f"{text} ({now - self.start:.0f} s)")


def _line_every_s() -> float:
    from verispec import progress

    return progress.LINE_EVERY_S


def train(
    head,
    model,
    data,
    options,
    out: Path,
    checkpoint_minutes: float,
    optimizer,
    optimizer_path: Path,
    read=None,
    weights: str = "f32",
):
    """:func:`verispec.training.loop.train_head` under :class:`_Progress`; the head and its
    optimiser's state written beside ``out`` every ``checkpoint_minutes`` and on Ctrl-C (then
    exit 130)."""
    from verispec.training.loop import train_head as run

    checkpoints = _Checkpoints(head, out, optimizer, optimizer_path, weights, checkpoint_minutes)
    total = options.steps if options.minutes is None else None
    with _Progress(total, checkpoints) as shown:
        try:
            return run(
                head,
                model,
                data.sequences,
                options,
                on_step=shown.on_step,
                on_teacher=shown.on_teacher,
                optimizer=optimizer,
                read=read,
            )
        except KeyboardInterrupt:
            checkpoints.save()
            err.print(f"interrupted: the head so far is in {out}; continue with --resume")
            raise typer.Exit(130) from None
