"""glibc malloc's two knobs the process uses (elsewhere than glibc: no-ops).

glibc returns an arena's freed pages to the system only from its top, so memory freed in the middle of the heap
(a request's buffers, the fp32 weights a lower precision replaced at load) stays resident until
``malloc_trim``; and it gives each thread that allocates concurrently an arena of its own. Used at load
(:mod:`cosyvoice.backends.precision`) and by the servers (:mod:`cosyvoice.server.memory`).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_ARENA_MAX = -8  # glibc's mallopt parameter


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _libc()


def limit_arenas(count: int) -> bool:
    """At most ``count`` malloc arenas from now on (threads already running keep theirs)."""
    return bool(_LIBC is not None and _LIBC.mallopt(M_ARENA_MAX, count))


def trim() -> bool:
    """Return the free pages of every malloc arena to the system."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))
