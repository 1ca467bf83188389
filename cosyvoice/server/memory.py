"""Keeping a server's resident memory bounded under load (glibc malloc).

Where it went, measured with tests/test_load.py (120 requests, 16 at a time, a third abandoned): not live
objects or tensors (their counts return to the baseline) but freed memory the allocator keeps. glibc gives
each thread that allocates concurrently an arena of its own (up to 8 per core) and returns an arena's freed
pages to the system only from its top; requests' short-lived buffers (decoded uploads, features, PCM,
encoders) freed in the middle of many arenas stay resident as high-water marks. Two remedies, both here:
fewer arenas (``M_ARENA_MAX``, as ``MALLOC_ARENA_MAX`` would set it before start-up) and ``malloc_trim(0)``
once the server is idle, which hands the free pages of every arena back. Elsewhere than glibc: no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cosyvoice.service import TTSService

logger = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter
DEFAULT_ARENAS = 2  # measured: 2 arenas cost no throughput on the load test and cut its growth most
TRIM_EVERY_SECONDS = 2.0


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _libc()


def limit_arenas(count: int = DEFAULT_ARENAS) -> bool:
    """At most ``count`` malloc arenas from now on (threads already running keep theirs)."""
    return bool(_LIBC is not None and _LIBC.mallopt(M_ARENA_MAX, count))


def trim() -> bool:
    """Return the free pages of every malloc arena to the system."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))


class _Loaded(Protocol):
    loaded: TTSService | None


class MemoryKeeper:
    """While the ``with`` block runs: few arenas, and a trim whenever requests ran and the server is idle again
    (checked every ``TRIM_EVERY_SECONDS`` by one thread; a busy server is never trimmed, so trimming costs
    no request time)."""

    def __init__(self, state: _Loaded, arenas: int = DEFAULT_ARENAS) -> None:
        self.state, self.arenas = state, arenas
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cosyvoice-memory")

    def __enter__(self) -> MemoryKeeper:
        limit_arenas(self.arenas)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(TRIM_EVERY_SECONDS + 1)

    def _run(self) -> None:
        ended = threading.Event()  # a request ended since the last trim
        watched = None
        while not self._stop.wait(TRIM_EVERY_SECONDS):
            service = self.state.loaded
            if service is None:
                continue
            if service is not watched:
                service.add_listener(lambda _outcome: ended.set())
                watched = service
            if ended.is_set() and not service.active_sessions and not service.queued_requests:
                ended.clear()
                trim()
