"""Keeping a server's resident memory bounded under load (glibc malloc).

Where it goes: not live objects or tensors (a load test's counts of both return to their baseline) but freed
memory the allocator keeps. glibc gives each thread that allocates concurrently an arena of its own (up to 8
per core) and returns an arena's freed pages to the system only from its top, so the short-lived buffers of
requests (decoded uploads, features, PCM, encoders) freed in the middle of many arenas stay resident as
high-water marks; the more threads touch requests, the more arenas (a thread per request, as the service had
before its sessions moved onto the event loop, grew a REST server from 338 to 1,255 MB over 120 requests).
Two remedies, both here: few arenas (``M_ARENA_MAX``, as ``MALLOC_ARENA_MAX`` would set it at start-up) and
``malloc_trim(0)`` once the server is idle, which hands the free pages of every arena back. tests/test_load.py
states the bound and the measured figures (docs/servers.md, "Memory"). Elsewhere than glibc: no-ops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from cosyvoice.system.malloc import limit_arenas, trim

if TYPE_CHECKING:
    from cosyvoice.service import TTSService

logger = logging.getLogger(__name__)

DEFAULT_ARENAS = 2  # the load test ran no slower with 2 (2 cores); its settled RSS was ~70 MiB lower
TRIM_EVERY_SECONDS = 2.0


class MemoryKeeper:
    """While the ``with`` block runs: few arenas, and a trim whenever requests ran and the server is idle again
    (checked every ``TRIM_EVERY_SECONDS`` by one thread; a busy server is never trimmed, so trimming costs
    no request time)."""

    def __init__(self, service: Callable[[], TTSService | None], arenas: int = DEFAULT_ARENAS) -> None:
        self.service, self.arenas = service, arenas  # ``service()``: the server's service, None while loading
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
            service = self.service()
            if service is None:
                continue
            if service is not watched:
                service.add_listener(lambda _outcome: ended.set())
                watched = service
            if ended.is_set() and not service.active_sessions and not service.queued_requests:
                ended.clear()
                trim()
