"""The token-to-wave worker: one thread that runs flow + vocoder for every session's chunks.

Chunk jobs wait in a priority queue: first chunks first (they decide the time to first audio), in
arrival order; then the others by their session's playback deadline (the time at which the client
will have played everything it was sent), earliest first. On CUDA the worker runs on a CUDA stream
of its own, so its kernels overlap the LLM scheduler's (which stay on the default stream).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from contextlib import nullcontext

import torch

logger = logging.getLogger(__name__)

class Token2WavWorker:
    """A priority queue of callables run by one thread; ``submit(priority, fn)`` with a smaller tuple first."""

    def __init__(self, device: torch.device, name: str = "cosyvoice-t2w") -> None:
        self.device = device
        self.name = name
        self._heap: list[tuple[tuple[float, ...], int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False

    def submit(self, priority: tuple[float, ...], run: Callable[[], None]) -> None:
        with self._cond:
            if self._stop:
                raise RuntimeError("the token-to-wave worker was stopped (Engine.close())")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (priority, next(self._seq), run))
            self._cond.notify()

    def stop(self) -> None:
        """Ask the thread to end once the queue is empty."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    def close(self) -> None:
        """Run what is queued, then stop the thread and wait for it."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        # unverified on GPU (no device this session): a side stream so flow/vocoder overlap the LLM's kernels
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._heap or self._stop)
                    if not self._heap:
                        return
                    _, _, run = heapq.heappop(self._heap)
                try:
                    run()  # the engine routes a chunk's failures to its session; this only guards the thread
                except Exception:
                    logger.exception("token-to-wave job failed outside its session's error handling")
                del run  # hold nothing of a finished chunk while asleep
