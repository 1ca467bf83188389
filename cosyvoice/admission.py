"""The one admission of a service (:class:`Admission`): how many requests synthesise at once, how many wait, in
which order, and what "busy" and "shutting down" mean. Threads and asyncio tasks wait in one queue.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable

from cosyvoice.engine import CancelToken
from cosyvoice.errors import ResourceLimitError


class _Waiter:
    __slots__ = ("granted", "refused", "wake")

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake, self.granted, self.refused = wake, False, False


class Admission:
    """The one admission of a service: at most ``max_active`` holders; ``max_waiting`` more wait in arrival
    order (threads and asyncio tasks in one queue) up to ``timeout`` s; the rest are "busy" at once.

    A released slot passes straight to the longest waiter, so nobody overtakes. ``close()`` (shutting down)
    refuses the waiters and every later request.
    """

    def __init__(self, max_active: int, max_waiting: int, timeout: float) -> None:
        self.max_active, self.max_waiting, self.timeout = max_active, max_waiting, timeout
        self.active = 0
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def _enter(self, waiter: _Waiter, bounded: bool = True) -> bool:
        """Take a slot now (True) or queue ``waiter`` (False); raises when refused. Call with the lock held."""
        if self._closed:
            raise ResourceLimitError("shutting down: this server takes no new requests; retry on another")
        if self.active < self.max_active and not self._queue:
            self.active += 1
            return True
        if bounded and len(self._queue) >= self.max_waiting:
            raise ResourceLimitError(f"busy: {self.active} requests are synthesising and {len(self._queue)} are "
                                     "waiting; retry later")
        self._queue.append(waiter)
        return False

    def _settle(self, waiter: _Waiter) -> None:
        """After a wait: keep a granted slot, else leave the queue and say why."""
        with self._lock:
            if waiter.granted:
                return
            with contextlib.suppress(ValueError):
                self._queue.remove(waiter)
        if waiter.refused:
            raise ResourceLimitError("shutting down: this server takes no new requests; retry on another")
        raise ResourceLimitError(f"busy: no synthesis slot became free within {self.timeout:g} s; retry later")

    def acquire(self, job: CancelToken | None = None) -> None:
        """Wait for a slot (blocking). A long job's request (``job``: its token) waits in the same queue, in
        order, past the queue's bound and without timeout, until granted or cancelled: jobs are few (the job
        runner's workers) and should wait out other users rather than fail."""
        event = threading.Event()
        waiter = _Waiter(event.set)
        with self._lock:
            if self._enter(waiter, bounded=job is None):
                return
        if job is None:
            event.wait(self.timeout)
        else:
            unsubscribe = job.subscribe(event.set)
            event.wait()
            unsubscribe()
        self._settle(waiter)

    async def aacquire(self) -> None:
        """Wait for a slot without blocking the event loop; a cancelled wait leaves no slot behind."""
        loop = asyncio.get_running_loop()
        granted = loop.create_future()

        def wake() -> None:
            loop.call_soon_threadsafe(lambda: granted.done() or granted.set_result(None))

        waiter = _Waiter(wake)
        with self._lock:
            if self._enter(waiter):
                return
        try:
            await asyncio.wait_for(granted, self.timeout)
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            with self._lock:
                if not waiter.granted:
                    waiter.refused = True
                    with contextlib.suppress(ValueError):
                        self._queue.remove(waiter)
                    raise
            self.release()
            raise
        self._settle(waiter)

    def release(self) -> None:
        with self._lock:
            while self._queue:
                waiter = self._queue.popleft()
                waiter.granted = True
                try:
                    waiter.wake()
                    return  # the slot passes to it: ``active`` is unchanged
                except RuntimeError:  # its event loop is gone: nobody will take the slot
                    waiter.granted = False
            self.active -= 1

    def close(self) -> None:
        """Refuse every waiter and every later request (shutting down); holders keep their slots."""
        with self._lock:
            self._closed = True
            waiters, self._queue = list(self._queue), collections.deque()
        for waiter in waiters:
            waiter.refused = True
            with contextlib.suppress(RuntimeError):
                waiter.wake()
