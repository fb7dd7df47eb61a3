"""Giving a tensor's memory pages back to the operating system while the tensor lives on.

A sequence's KV cache is allocated once at its full capacity and left untouched, so only the
pages its tokens were written to are resident; a pooled sequence would keep the pages of the
longest request it ever held. :func:`release_pages` drops them (``madvise(MADV_DONTNEED)``: the
range stays mapped and reads as zeros until written again), :func:`resident_bytes` counts what is
resident (``mincore``). Linux only; elsewhere they do nothing and say so (0 and None). Knows
nothing about models.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

from torch import Tensor

PAGE_BYTES = mmap.PAGESIZE
_LIBC: list = []


def _libc():
    if not _LIBC:
        library = None
        if sys.platform.startswith("linux"):
            try:
                library = ctypes.CDLL(None, use_errno=True)
                library.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                library.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
            except (OSError, AttributeError):
                library = None
        _LIBC.append(library)
    return _LIBC[0]


def _whole_pages(tensor: Tensor) -> tuple[int, int]:
    """``(first page address, bytes)`` of the whole pages inside ``tensor``'s storage: the
    partial pages at either end may hold another allocation's bytes and are left alone."""
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first = -(-start // PAGE_BYTES) * PAGE_BYTES
    last = end // PAGE_BYTES * PAGE_BYTES
    return first, max(0, last - first)


def release_pages(tensor: Tensor) -> int:
    """Hand the whole pages of ``tensor``'s storage back to the OS; afterwards they read as zeros
    (so only for storage written before it is read, like a KV cache past its length, and never for
    a file mapping). Returns the bytes of the range released (0 on a platform without
    ``madvise`` or for a storage smaller than a page). Raises OSError if the kernel refuses."""
    libc = _libc()
    first, length = _whole_pages(tensor)
    if libc is None or length == 0 or tensor.device.type != "cpu":
        return 0
    if libc.madvise(first, length, mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on a tensor's pages")
    return length


def resident_bytes(tensor: Tensor) -> int | None:
    """Bytes of ``tensor``'s whole storage pages that are resident in memory now (``mincore``);
    None on a platform without it."""
    libc = _libc()
    first, length = _whole_pages(tensor)
    if libc is None:
        return None
    pages = length // PAGE_BYTES
    if pages == 0:
        return 0
    flags = (ctypes.c_ubyte * pages)()
    if libc.mincore(first, length, flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed on a tensor's pages")
    return sum(flag & 1 for flag in flags) * PAGE_BYTES
