"""Our C++ CPU kernels: built once on first use, cached under ``$VERISPEC_HOME/kernels``.

Owns compiling and loading the kernel sources (``core.h`` lists them) (``torch.utils.cpp_extension`` with ninja; the
build is keyed by the source, torch and Python versions, so a change rebuilds and a cache shared
across them never mixes) and turning a missing compiler into a clear error. The kernels choose
between their AVX-512 VNNI and portable paths at run time, so one build works on any x86-64 CPU.
Knows nothing about models.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from verispec.errors import InvalidParameterError
from verispec.progress import NOTICE_AFTER_S, announce_slow

DIRECTORY = Path(__file__).parent
# The torch-free core (one file per concern and per ISA, see core.h) and the torch bindings.
CORE_SOURCES = ("formats.cpp", "portable.cpp", "dispatch.cpp", "attention.cpp", "requantize.cpp", "x86_avx512.cpp",
                "x86_avx2.cpp", "arm_neon.cpp", "arm_neon_float.cpp")
SOURCES = tuple(DIRECTORY / name for name in CORE_SOURCES + ("bindings.cpp",))
HEADERS = (DIRECTORY / "core.h",)
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fopenmp"]
_LOCK = threading.Lock()
_MODULE = None


def kernel_build_dir() -> Path:
    """Where the compiled extension lives: ``$VERISPEC_HOME/kernels/<key>``."""
    from verispec.models.store import verispec_home

    return verispec_home() / "kernels" / build_key()


def build_key() -> str:
    """Hash of what the binary depends on: the source, the flags, torch and Python."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


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
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the pip package's binary, when the venv is not activated
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise InvalidParameterError("the gguf runner builds its kernels with ninja: pip install ninja") from None
    directory = kernel_build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    compiling = not list(directory.glob("*.so"))
    try:
        with announce_slow("compiling the gguf runner's kernels", f"once, ~40 s on 2 cores, into {directory}",
                           after_s=0.0 if compiling else NOTICE_AFTER_S):
            module = cpp_extension.load(
                name=f"verispec_gguf_{build_key()}",
                sources=[str(path) for path in SOURCES],
                extra_cflags=CFLAGS,
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as exc:  # cpp_extension raises RuntimeError, OSError, ImportError, CalledProcessError
        raise InvalidParameterError(f"building the gguf kernels failed ({type(exc).__name__}: {exc}); use --runner int8") from exc
    return module



# ---------------------------------------------------------------------------------------------
# Which instruction set the kernels run (dispatch.cpp): the best one for the CPU unless forced.

ISA_ENV = "VERISPEC_KERNEL_ISA"
# The kernels' ISA numbers (the ``impl`` argument of ``linear``, ``attention``, ``requantize_4bit``).
ISA_NUMBERS = {"auto": 0, "portable": 1, "avx512": 2, "avx2": 3, "avxvnni": 4, "neon": 5}
_FORCED: list[str | None] = [None]
_RESOLVED: dict[tuple[str | None, str], str] = {}


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
    """:func:`kernel_isa` as the kernels' ``impl`` number."""
    return ISA_NUMBERS[kernel_isa()]


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
