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

DIRECTORY = Path(__file__).parent
# The torch-free core (one file per concern and per ISA, see core.h) and the torch bindings.
CORE_SOURCES = ("formats.cpp", "portable.cpp", "dispatch.cpp", "attention.cpp", "requantize.cpp", "x86_avx512.cpp",
                "x86_avx2.cpp", "arm_neon.cpp")
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
    """The compiled kernel module (``repack``, ``linear``, ``attention``, ``has_avx512_vnni``).

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
    if not list(directory.glob("*.so")):
        print(f"verispec: compiling the gguf runner's kernels into {directory} (once, ~20 s)", file=sys.stderr, flush=True)
    try:
        return cpp_extension.load(
            name=f"verispec_gguf_{build_key()}",
            sources=[str(path) for path in SOURCES],
            extra_cflags=CFLAGS,
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # cpp_extension raises RuntimeError, OSError, ImportError, CalledProcessError
        raise InvalidParameterError(f"building the gguf kernels failed ({type(exc).__name__}: {exc}); use --runner int8") from exc
