"""Lines on stderr for steps that take long, so no first run goes silent.

Owns :func:`announce_slow`: a step still running after ~2 s is named (what, why), repeated with
the seconds so far every :data:`HEARTBEAT_S`, and closed with how long it took; and
:func:`steps`, the "i of n" display of a command made of many steps (a ``rich`` bar when stderr
is a terminal, else a line at most every :data:`LINE_EVERY_S`). Knows nothing about models,
kernels or decoding.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

NOTICE_AFTER_S = 2.0  # a step still running after this long is announced on stderr
HEARTBEAT_S = 8.0  # then a line at least this often while it runs
LINE_EVERY_S = (
    5.0  # steps() without a terminal: a line at most (and, while a step runs, at least) this often; 0: every step
)


@contextmanager
def announce_slow(
    what: str, why: str, *, after_s: float = NOTICE_AFTER_S, every_s: float = HEARTBEAT_S, enabled: bool = True
) -> Iterator[threading.Event]:
    """Say ``verispec: <what> (<why>) ...`` on stderr once the block has run ``after_s`` seconds,
    ``verispec: still <what> (N s)`` every ``every_s`` seconds after that, and ``verispec: <what>:
    done in N.N s`` (or ``stopped after``, when it raised) at the end; a faster block says nothing.
    Yields an event that is set once the first line is out. ``enabled=False``: says nothing."""
    announced = threading.Event()
    if not enabled:
        yield announced
        return
    finished = threading.Event()
    lock = threading.Lock()
    start = time.perf_counter()

    def speak() -> None:
        if finished.wait(after_s):
            return
        with lock:
            if finished.is_set():
                return
            print(f"verispec: {what} ({why}) ...", file=sys.stderr, flush=True)
            announced.set()
        while not finished.wait(every_s):
            with lock:
                if not finished.is_set():
                    print(f"verispec: still {what} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

    thread = threading.Thread(target=speak, daemon=True)
    thread.start()
    outcome = "stopped after"
    try:
        yield announced
        outcome = "done in"
    finally:
        with lock:
            finished.set()
        thread.join()
        if announced.is_set():
            print(f"verispec: {what}: {outcome} {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


class Steps:
    """How far a command of ``total`` steps got, said on stderr: :meth:`running` names the step
    that starts, :meth:`finished` the one that ended (with a figure so far, ``note``). Made by
    :func:`steps`; this base class says nothing (``--quiet``)."""

    def __init__(self, title: str, total: int) -> None:
        self.title, self.total, self.done = title, total, 0
        self.after: str | None = None  # what runs once every step is done (shown until the block ends)
        self.start = time.perf_counter()

    def running(self, what: str) -> None:
        """``what`` starts (not counted: a warm-up, say, or the next step)."""

    def finished(self, what: str, note: str = "") -> None:
        """A step ended; ``note``: a figure so far (e.g. tokens/s)."""
        self.done += 1

    def close(self) -> None:
        """The block is over."""


class _Lines(Steps):
    """No terminal (a log file, a pipe): ``verispec: <title> i/n · <what> · <note> (N s)`` at most
    every ``every_s`` seconds (the first and last step always); while one step runs longer, the
    line again with ``running``. ``every_s`` 0: a line for every start and end."""

    def __init__(self, title: str, total: int, every_s: float) -> None:
        super().__init__(title, total)
        self.every_s, self.current, self.note = every_s, "", ""
        self.last = -float("inf")
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._heartbeat, daemon=True) if every_s > 0 else None
        if self.thread is not None:
            self.thread.start()

    def _say(self, text: str) -> None:  # under the lock
        self.last = time.perf_counter()
        print(
            f"verispec: {self.title} {self.done}/{self.total} · {text} ({self.last - self.start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    def running(self, what: str) -> None:
        with self.lock:
            self.current = what
            if self.last == -float("inf") or self.every_s <= 0:  # the first line at once: the command is under way
                self._say(f"running {what}")

    def finished(self, what: str, note: str = "") -> None:
        with self.lock:
            self.done += 1
            self.note, self.current = note, ""
            if self.done >= self.total or time.perf_counter() - self.last >= self.every_s:
                self._say(" · ".join(p for p in (what, note) if p))
            if self.done >= self.total and self.after:
                self.current = self.after
                self._say(f"then {self.after}")

    def _heartbeat(self) -> None:
        while not self.stop.wait(self.every_s):
            with self.lock:
                if self.current and time.perf_counter() - self.last >= self.every_s:
                    self._say(" · ".join(p for p in (f"running {self.current}", self.note) if p))

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


class _Bar(Steps):
    """A terminal: a transient ``rich`` bar (what runs now, bar, i/n, elapsed, the latest note)."""

    def __init__(self, title: str, total: int, console: Console) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        super().__init__(title, total)
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[note]}"),
        )
        self.bar = Progress(*columns, console=console, transient=True)
        self.task = self.bar.add_task(title, total=total, note="")
        self.bar.start()

    def running(self, what: str) -> None:
        self.bar.update(self.task, description=what[:60])

    def finished(self, what: str, note: str = "") -> None:
        self.done += 1
        self.bar.update(self.task, advance=1, note=note[:60])
        if self.done >= self.total and self.after:
            self.bar.update(self.task, description=self.after[:60])

    def close(self) -> None:
        self.bar.stop()


@contextmanager
def steps(
    title: str, total: int, *, enabled: bool = True, console: Console | None = None, every_s: float | None = None
) -> Iterator[Steps]:
    """A :class:`Steps` for a block of ``total`` steps: a ``rich`` bar when ``console`` (default:
    stderr) is a terminal, else plain lines on stderr at most every ``every_s`` seconds (default
    :data:`LINE_EVERY_S`, read at the call; 0: a line per step); nothing when not ``enabled``."""
    if not enabled:
        shown: Steps = Steps(title, total)
    elif console.is_terminal if console is not None else sys.stderr.isatty():
        from rich.console import Console

        shown = _Bar(title, total, console or Console(stderr=True))
    else:
        shown = _Lines(title, total, LINE_EVERY_S if every_s is None else every_s)
    try:
        yield shown
    finally:
        shown.close()


@contextmanager
def working(what: str, why: str, console: Console) -> Iterator[None]:
    """One step that may take long: a ``rich`` spinner naming ``what`` when ``console`` is a
    terminal, else :func:`announce_slow`'s lines (a log shows it too)."""
    if console.is_terminal:
        with console.status(what):
            yield
    else:
        with announce_slow(what, why):
            yield


class ProgressLines:
    """The calls of a rich ``Progress`` a byte count makes (``add_task``, ``update``, ``advance``; the model
    store's downloads), as lines on stderr: one when a task's
    description changes and, while bytes flow, at most every :data:`verispec.progress.LINE_EVERY_S`
    (bytes so far, of the total, MB/s)."""

    def __init__(self) -> None:
        self._tasks: dict[int, dict] = {}

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc) -> None:
        for task in self._tasks.values():
            if task["shown_done"] != task["done"]:
                self._say(task)

    def add_task(self, description: str, total: float | None = None) -> int:
        task_id = len(self._tasks)
        now = time.monotonic()
        self._tasks[task_id] = {
            "description": description,
            "total": total,
            "done": 0,
            "start": now,
            "said": now,
            "shown_done": -1,
        }
        self._say(self._tasks[task_id])
        return task_id

    def update(self, task_id: int, *, description: str | None = None, **_) -> None:
        task = self._tasks[task_id]
        if description is not None and description != task["description"]:
            task["description"] = description
            self._say(task)

    def advance(self, task_id: int, amount: float) -> None:
        task = self._tasks[task_id]
        task["done"] += amount
        if time.monotonic() - task["said"] >= LINE_EVERY_S:
            self._say(task)

    @staticmethod
    def _say(task: dict) -> None:
        now = time.monotonic()
        done, total = task["done"] / 2**20, task["total"]
        rate = task["done"] / 1e6 / max(now - task["start"], 1e-9)
        amount = f"{done:.0f}" + (f"/{total / 2**20:.0f}" if total else "") + f" MiB, {rate:.1f} MB/s"
        print(f"verispec: {task['description']} ({amount})", file=sys.stderr, flush=True)
        task["said"], task["shown_done"] = now, task["done"]
