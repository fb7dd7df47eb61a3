"""Our C++ CPU kernels: built once on first use, cached under ``$VERISPEC_HOME/kernels``.

Owns compiling and loading the kernel sources (``core.h`` lists them) with
``torch.utils.cpp_extension`` and ninja; the build is keyed by the sources, torch and Python
versions and the compile command line (compiler, include and library folders), so a change
rebuilds and a cache shared across them never mixes. Also checking the build before loading it
(:func:`check_build`) and turning a missing compiler into a clear error. The kernels choose
between their ISA paths at run time, so one build works on any CPU of the architecture. Knows
nothing about models.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from verispec.errors import CacheFileError, InvalidParameterError
from verispec.models.cache_files import read_checked, report_damaged, write_checked
from verispec.progress import NOTICE_AFTER_S, announce_slow

try:
    import fcntl
except ImportError:  # Windows: concurrent builds are not serialized, stale torch locks not cleared
    fcntl = None

DIRECTORY = Path(__file__).parent
# The torch-free core (one file per concern and per ISA, see core.h) and the torch bindings.
CORE_SOURCES = (
    "formats.cpp",
    "portable.cpp",
    "dispatch.cpp",
    "attention.cpp",
    "row_ops.cpp",
    "requantize.cpp",
    "x86_avx512.cpp",
    "x86_avx2.cpp",
    "arm_neon.cpp",
    "arm_neon_float.cpp",
)
SOURCES = tuple(DIRECTORY / name for name in CORE_SOURCES + ("bindings.cpp",))
HEADERS = (DIRECTORY / "core.h",)
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fopenmp"]
RECORD = "verispec-build.json"  # the built library's name, size and sha256 (a checked file)
RECORD_KIND = "verispec-kernels/1"
_LOCK = threading.Lock()
_MODULE = None


def kernel_build_dir() -> Path:
    """Where the compiled extension lives: ``$VERISPEC_HOME/kernels/<key>``."""
    from verispec.models.store import verispec_home

    return verispec_home() / "kernels" / build_key()


def build_key() -> str:
    """Hash of what the binary and its ``build.ninja`` depend on: the sources, the flags, torch and
    Python, and the rest of the compile and link command lines (:func:`command_line_facts`)."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    for fact in command_line_facts():
        digest.update(b"\0" + fact.encode())
    return digest.hexdigest()[:16]


def command_line_facts() -> list[str]:
    """What ``torch.utils.cpp_extension`` writes into ``build.ninja`` besides the sources and
    :data:`CFLAGS`: the compiler (``$CXX``, and the file it resolves to), torch's include and library
    folders and Python's include folder, each install's own paths. ninja rebuilds every object
    when a command line changes, so two installs that shared one folder (two virtual environments
    of the same torch) rebuilt it in turn, ~36 s each time; keyed on these, each has its own."""
    import sysconfig

    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    return [
        compiler,
        shutil.which(compiler) or "",
        *cpp_extension.include_paths(),
        sysconfig.get_paths()["include"],
        *cpp_extension.library_paths(),
    ]


def gguf_kernels():
    """The compiled kernel module (``repack``, ``linear``, ``attention``, ``supported_isas``, ...).

    Raises:
        InvalidParameterError: no C++ compiler, or the build failed (with the compiler's reason).
    """
    global _MODULE
    with _LOCK:
        if _MODULE is None:
            _MODULE = _build()
        return _MODULE


def _build():
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise InvalidParameterError(
            f"the gguf runner compiles its kernels once, and no C++ compiler ({compiler!r}) was found: "
            "install g++ (Debian: apt install g++), or use --runner int8"
        )
    if shutil.which("ninja") is None:  # the pip package's binary, when the venv is not activated
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise InvalidParameterError("the gguf runner builds its kernels with ninja: pip install ninja") from None
    directory = kernel_build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        check_build(directory)
        built_before = any(directory.iterdir())
        try:
            module = _load(directory)
        except Exception as exc:  # cpp_extension raises RuntimeError, OSError, ImportError, CalledProcessError
            if not built_before:
                raise InvalidParameterError(
                    f"building the gguf kernels failed ({type(exc).__name__}: {exc}); use --runner int8"
                ) from exc
            # a damaged object file or build log fails the link or the load: once more from nothing
            report_damaged(
                directory, f"could not be built or loaded ({type(exc).__name__})", "built again from scratch"
            )
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True, exist_ok=True)
            try:
                module = _load(directory)
            except Exception as again:
                raise InvalidParameterError(
                    f"building the gguf kernels failed ({type(again).__name__}: {again}); use --runner int8"
                ) from again
        _record_build(directory, Path(module.__file__))
    return module


def _load(directory: Path):
    """Build (ninja: only what changed) and import the extension in ``directory``, from the copy of
    the sources :func:`build_sources` keeps there."""
    from torch.utils import cpp_extension

    sources = build_sources(directory)
    compiling = not list(directory.glob("*.so"))
    with announce_slow(
        "compiling the gguf runner's kernels",
        f"once, ~40 s on 2 cores, into {directory}",
        after_s=0.0 if compiling else NOTICE_AFTER_S,
    ):
        return cpp_extension.load(
            name=f"verispec_gguf_{build_key()}",
            sources=[str(path) for path in sources],
            extra_cflags=CFLAGS,
            build_directory=str(directory),
            verbose=False,
        )


def build_sources(directory: Path) -> list[Path]:
    """The kernel sources (and ``core.h``) copied into ``directory/src``, written only where a copy
    is missing or differs; the paths of the ``.cpp`` files, in build order.

    ninja's ``build.ninja`` names each source by its absolute path, and rebuilds everything when
    the path changes. The build folder is keyed by the sources' contents and the command line
    (:func:`build_key`), so two checkouts of one verispec over one torch share it; built from
    their own paths they would rebuild it in turn, ~40 s each time. Built from this copy, every
    install names the same paths, and unchanged copies keep the times ninja compares.
    """
    folder = directory / "src"
    folder.mkdir(exist_ok=True)
    for path in SOURCES + HEADERS:
        copy, data = folder / path.name, path.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return [folder / path.name for path in SOURCES]


def check_build(directory: Path) -> None:
    """Leave in the build folder ``directory`` only a library that passes its check.

    The record :data:`RECORD` (a checked file: header with size and sha256) names the library a
    finished build produced and its size and sha256. A library without a record (a build cut
    short, or an older verispec's), with a damaged record, or whose size or sha256 differs from it
    is said once on stderr and deleted with its record, so ninja links it again from the object
    files. A torch build lock left by a killed build (``lock``: torch would wait on it forever)
    is removed; the caller holds the folder's lock, so no live build owns it. Never raises for a
    damaged folder.
    """
    if fcntl is not None and (directory / "lock").exists():
        report_damaged(directory, "holds a build lock of a build that was killed", "the lock is removed")
        (directory / "lock").unlink(missing_ok=True)
    libraries = sorted(directory.glob("*.so"))
    if not libraries:
        return
    problem = None
    try:
        record = json.loads(read_checked(directory / RECORD, RECORD_KIND))
        library = directory / record["library"]
        if library not in libraries or library.stat().st_size != record["size"]:
            problem = f"has a library whose size is not the recorded {record['size']} bytes (truncated)"
        elif _sha256(library) != record["sha256"]:
            problem = "has a library that fails its sha256 check (corrupt)"
    except FileNotFoundError:
        problem = "has a library without a build record (a build cut short, or an older verispec's)"
    except (CacheFileError, ValueError, KeyError, TypeError) as exc:
        problem = f"has a damaged build record ({exc})"
    if problem is not None:
        report_damaged(directory, problem, "the library is linked again")
        for library in libraries:
            library.unlink(missing_ok=True)
        (directory / RECORD).unlink(missing_ok=True)


def _record_build(directory: Path, library: Path) -> None:
    """Write the record of ``library`` (name, size, sha256) unless it is there and matches."""
    record = {"library": library.name, "size": library.stat().st_size, "sha256": _sha256(library)}
    try:
        if json.loads(read_checked(directory / RECORD, RECORD_KIND)) == record:
            return
    except (OSError, ValueError, CacheFileError):
        pass
    with contextlib.suppress(OSError):  # unrecorded: the next start links it again
        write_checked(directory / RECORD, RECORD_KIND, json.dumps(record).encode())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        while chunk := data.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Hold an exclusive flock beside the build folder (released when the process dies), so one
    process builds at a time and a torch ``lock`` file seen under it is stale."""
    if fcntl is None:
        yield
        return
    with open(directory.with_name(f".{directory.name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------------------------------------
# Which instruction set the kernels run (dispatch.cpp): the best one for the CPU unless forced.

ISA_ENV = "VERISPEC_KERNEL_ISA"
# The kernels' ISA numbers (the ``impl`` argument of ``linear``, ``attention``, ``requantize_4bit``).
ISA_NUMBERS = {"auto": 0, "portable": 1, "avx512": 2, "avx2": 3, "avxvnni": 4, "neon": 5}
_FORCED: list[str | None] = [None]
_RESOLVED: dict[tuple[str | None, str], str] = {}
_PASS = threading.local()  # impl: the ISA number fixed for the pass running on this thread (one_isa)


def set_kernel_isa(name: str | None) -> None:
    """Force the kernels' instruction set for this process (None: back to ``$VERISPEC_KERNEL_ISA``
    or the best for the CPU). Every path gives the same bits; tests and benchmarks use this.

    Raises:
        InvalidParameterError: an unknown name, or one this CPU cannot run (naming its features).
    """
    if name is not None:
        _check_isa(name, source="set_kernel_isa")
    _FORCED[0] = name


def kernel_isa() -> str:
    """The instruction set the kernels run now: ``portable``, ``avx2`` (AVX2 + FMA + F16C),
    ``avxvnni`` (AVX2 with 256-bit VNNI), ``avx512`` (AVX-512 VNNI) or ``neon`` (ARMv8.2 dotprod).

    Chosen by :func:`set_kernel_isa`, else ``$VERISPEC_KERNEL_ISA``, else the fastest path the CPU
    has. Raises InvalidParameterError when the forced one is unknown or this CPU lacks it.
    """
    key = (_FORCED[0], os.environ.get(ISA_ENV, ""))
    resolved = _RESOLVED.get(key)
    if resolved is None:  # once per setting: every linear layer asks
        name = key[0]
        if name is None:
            name = key[1].strip().lower() or "auto"
            _check_isa(name, source=f"{ISA_ENV}={key[1]}")
        resolved = _RESOLVED[key] = gguf_kernels().best_isa() if name == "auto" else name
    return resolved


def kernel_isa_number() -> int:
    """:func:`kernel_isa` as the kernels' ``impl`` number (inside :func:`one_isa`: the one it fixed)."""
    impl = getattr(_PASS, "impl", None)
    return ISA_NUMBERS[kernel_isa()] if impl is None else impl


@contextlib.contextmanager
def one_isa():
    """Within: :func:`kernel_isa_number` on this thread returns the number resolved on entry, without
    reading ``$VERISPEC_KERNEL_ISA`` again: a decoder pass makes ~150 kernel calls, and the lookup
    each time cost 0.5 ms of a 0.5B draft's 11 ms pass (AMD Zen 4). Nested uses keep the outer one."""
    if getattr(_PASS, "impl", None) is not None:
        yield
        return
    _PASS.impl = ISA_NUMBERS[kernel_isa()]
    try:
        yield
    finally:
        _PASS.impl = None


def _check_isa(name: str, *, source: str) -> None:
    if name not in ISA_NUMBERS:
        raise InvalidParameterError(f"unknown kernel ISA {name!r} ({source}); choose one of {', '.join(ISA_NUMBERS)}")
    if name == "auto":
        return
    kernels = gguf_kernels()
    if name not in kernels.supported_isas():
        raise InvalidParameterError(
            f"this CPU cannot run the {name} kernels ({source}): it has {kernels.cpu_features()}; "
            f"paths it runs: {', '.join(kernels.supported_isas())}"
        )
