"""Handing the CPU's OpenMP threads from one Python thread to another.

OpenMP runtimes keep one thread pool per thread that opened a parallel region. When the model is
loaded on the main thread and then driven from another one (the server's engine worker), the
main thread's idle pool still counts against the cores: GNU libgomp then sees more threads than
CPUs and stops spinning between regions, and every verify pass pays the wake-ups (measured on 2
cores, gguf runner, plain decoding: 33.8 tokens/s on the main thread, 27.2 on a second thread,
34.6 after :func:`release_thread_pool`). Knows nothing about models.
"""

from __future__ import annotations

import ctypes
import glob
import logging
from pathlib import Path

import torch

log = logging.getLogger("verispec")
OMP_PAUSE_HARD = 2  # omp_pause_resource_t (OpenMP 5.0, section 3.2.43)


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP pool (``omp_pause_resource_all(omp_pause_hard)``); the
    next parallel region on any thread builds what it needs. Call it on the thread that loaded the
    model before another thread takes over. Returns False where the runtime has no such call
    (nothing changes then: only speed is at stake, never results)."""
    for library in _openmp_libraries():
        pause = getattr(library, "omp_pause_resource_all", None)
        if pause is not None:
            pause.restype = ctypes.c_int
            return pause(OMP_PAUSE_HARD) == 0
    log.debug("no OpenMP runtime with omp_pause_resource_all found")
    return False


def _openmp_libraries():
    torch_lib = Path(torch.__file__).parent / "lib"
    for pattern in ("libgomp*.so*", "libiomp5*", "libomp*"):
        for path in sorted(glob.glob(str(torch_lib / pattern))):
            try:
                yield ctypes.CDLL(path)
            except OSError:
                continue
    yield ctypes.CDLL(None)  # whatever the process already loaded
