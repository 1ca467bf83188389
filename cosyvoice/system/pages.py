"""Memory in mappings of its own: a file's pages handed back (Linux ``madvise``; elsewhere a no-op), and
zeroed buffers outside malloc's heap, resident only where written (:func:`mapped_zeros`).

A private file mapping's pages count in the process's resident set once read, for as long as the mapping lives,
whether or not anything still reads them: a checkpoint mapped whole stays mapped while any of its tensors is in use,
so the pages of the weights a lower precision replaced would stay resident beside their replacements. Dropping them
(``MADV_DONTNEED``) is safe for a private mapping of a file that nobody wrote through it: a later read faults the
file's bytes in again.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from cosyvoice.system.libc import function

MADV_DONTNEED = 4  # Linux
PAGE = mmap.PAGESIZE


def _madvise() -> ctypes._CFuncPtr | None:
    fn = function("madvise") if sys.platform.startswith("linux") else None
    if fn is not None:
        fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


_MADVISE = _madvise()


def file_mappings(paths: set[str]) -> list[tuple[int, int]]:
    """The address ranges where this process maps any of ``paths`` (resolved file names), from /proc/self/maps."""
    maps = Path("/proc/self/maps")
    if not paths or not maps.exists():
        return []
    ranges = []
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in paths:
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def drop_pages(spans: Iterable[tuple[int, int]], mappings: list[tuple[int, int]]) -> int:
    """Drop the whole pages of each ``(address, length)`` span that lie inside one of ``mappings`` (a page the span
    shares with its neighbours stays); returns the bytes dropped. Spans outside every mapping are left alone: their
    memory is not a file's, and dropping it would lose it."""
    if _MADVISE is None:
        return 0
    dropped = 0
    for address, length in spans:
        lo = -(-address // PAGE) * PAGE
        hi = (address + length) // PAGE * PAGE
        if hi > lo and any(start <= lo and hi <= end for start, end in mappings) and _MADVISE(lo, hi - lo,
                                                                                               MADV_DONTNEED) == 0:
            dropped += hi - lo
    return dropped


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping of its own, unmapped when its last view goes; only the pages
    written become resident (the kernel fills a private anonymous mapping with zeros as it is touched).

    For a buffer sized for the most it may hold, which most uses never fill (the LLM's key/value slots of every
    session, a stream's DiT cache with room to grow): zeros from malloc would be resident whole, and a long-lived
    buffer in malloc's heap pins the heap between the short-lived allocations around it, which then cannot shrink
    back (glibc returns pages from a heap's top only)."""
    count = 1
    for size in shape:
        count *= size
    nbytes = max(count * dtype.itemsize, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer's note that the tensor shares the buffer: the point here
        return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype, count=count).view(shape)
