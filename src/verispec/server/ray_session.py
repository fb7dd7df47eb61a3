"""The Ray session of ``verispec serve --replicas``: where a local cluster keeps its files (under
``$VERISPEC_HOME/ray``, or ``--ray-temp-dir``, instead of Ray's ``/tmp/ray``) and how serving stops:
SIGTERM and SIGINT both shut Ray Serve down, then Ray, before the process exits (0 after SIGTERM,
130 after SIGINT, as the single-process server). Ray's own driver handler turned SIGTERM into
``sys.exit`` while its actors were being killed, and the process ended with status 134.
Knows nothing about the replicas themselves (:mod:`verispec.server.replicas`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

from verispec.errors import InvalidParameterError

log = logging.getLogger("verispec.server")

# Ray puts sockets under <temp>/session_<date>_<time>_<us>_<pid>/sockets/ (64 characters after the
# temp folder), and a Unix socket's path holds at most 107 bytes
MAX_TEMP_DIR_CHARS = 40
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):  # not an error: how a signal ends the serving loop
    """Raised in the main thread by a stop signal; ``signum``: which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def ray_temp_dir(explicit: str | None = None) -> tuple[str | None, str | None]:
    """The folder a local Ray cluster keeps its session files in, and a notice to print (or None).

    ``explicit`` (``--ray-temp-dir``) as given, made absolute; else ``$VERISPEC_HOME/ray``, or Ray's
    own default (None) with a notice when that path is too long for Ray's socket paths.

    Raises:
        InvalidParameterError: ``explicit`` longer than :data:`MAX_TEMP_DIR_CHARS` characters, or a file.
    """
    if explicit is not None:
        path = Path(explicit).expanduser().resolve()
        if len(str(path)) > MAX_TEMP_DIR_CHARS:
            raise InvalidParameterError(
                f"--ray-temp-dir {path} is {len(str(path))} characters: Ray's socket paths under it would pass the "
                f"107-byte limit of a Unix socket; give a folder of at most {MAX_TEMP_DIR_CHARS} characters"
            )
        if path.exists() and not path.is_dir():
            raise InvalidParameterError(f"--ray-temp-dir {path} is a file: give a folder")
        return str(path), None
    from verispec.models.store import verispec_home

    path = (verispec_home() / "ray").resolve()
    if len(str(path)) > MAX_TEMP_DIR_CHARS:
        return None, (
            f"{path} is too long for Ray's socket paths: Ray keeps its files in its own default folder "
            "(--ray-temp-dir DIR to choose one)"
        )
    return str(path), None


class StopSignals:
    """While entered (in the main thread), the first SIGTERM or SIGINT raises :class:`Stopped` there
    and later ones are ignored (the shutdown they interrupt goes on); the previous handlers (Ray's
    driver installs one for SIGTERM) come back on exit. Elsewhere than in the main thread it does
    nothing: signals are only delivered there."""

    def __enter__(self) -> StopSignals:
        self._previous = {}
        self._stopping = False
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._stop)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _stop(self, signum, frame) -> None:
        if self._stopping:  # a second signal while shutting down: the shutdown goes on
            return
        self._stopping = True
        raise Stopped(signum)


def serve_until_stopped(ray, serve, started_ray: bool) -> int:
    """Wait for SIGTERM or SIGINT, then shut Ray Serve down (and Ray where this process started
    it, ``started_ray``); returns the signal's number."""
    with StopSignals():
        try:
            while True:
                time.sleep(3600)
        except Stopped as stop:
            log.info("%s: shutting the replicas down", signal.Signals(stop.signum).name)
            signum = stop.signum
        finally:
            serve.shutdown()
            if started_ray:
                ray.shutdown()
    return signum
