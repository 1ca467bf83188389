"""glibc malloc's two knobs the process uses (elsewhere than glibc: no-ops).

glibc returns an arena's freed pages to the system only from its top, so memory freed in the middle of the heap
(a request's buffers, the fp32 weights a lower precision replaced at load) stays resident until
``malloc_trim``; and it gives each thread that allocates concurrently an arena of its own. Used at load
(:mod:`cosyvoice.backends.precision`) and by the servers (:mod:`cosyvoice.server.memory`).
"""

from __future__ import annotations

from cosyvoice.system.libc import function

M_ARENA_MAX = -8  # glibc's mallopt parameter


_MALLOPT, _MALLOC_TRIM = function("mallopt"), function("malloc_trim")


def limit_arenas(count: int) -> bool:
    """At most ``count`` malloc arenas from now on (threads already running keep theirs)."""
    return bool(_MALLOPT is not None and _MALLOPT(M_ARENA_MAX, count))


def trim() -> bool:
    """Return the free pages of every malloc arena to the system."""
    return bool(_MALLOC_TRIM is not None and _MALLOC_TRIM(0))
