"""Lines on stderr for steps that take long, so no first run goes silent.

Owns :func:`announce_slow`: a step still running after ~2 s is named (what, why), repeated with
the seconds so far every :data:`HEARTBEAT_S`, and closed with how long it took. Knows nothing
about models, kernels or decoding.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

NOTICE_AFTER_S = 2.0  # a step still running after this long is announced on stderr
HEARTBEAT_S = 8.0  # then a line at least this often while it runs


@contextmanager
def announce_slow(what: str, why: str, *, after_s: float = NOTICE_AFTER_S,
                  every_s: float = HEARTBEAT_S) -> Iterator[threading.Event]:
    """Say ``verispec: <what> (<why>) ...`` on stderr once the block has run ``after_s`` seconds,
    ``verispec: still <what> (N s)`` every ``every_s`` seconds after that, and ``verispec: <what>:
    done in N.N s`` (or ``stopped after``, when it raised) at the end; a faster block says nothing.
    Yields an event that is set once the first line is out."""
    announced = threading.Event()
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
