"""The studio's take recorder: a take runs in a thread of its own, its PCM published on its live channel
(:mod:`app.live`) as it is made and handed to the page's Gradio handler, Stop honoured before and while it runs;
what was made is kept in the take store as every adapter keeps a take (:func:`cosyvoice.takes.provenance.keep_take`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from app.live import LiveHub
from cosyvoice.encoding import to_pcm16
from cosyvoice.engine import AudioChunk
from cosyvoice.service import PreparedRequest, SynthesisRequest, TTSService
from cosyvoice.takes.provenance import keep_take
from cosyvoice.takes.store import Take, TakeStore

logger = logging.getLogger("app.ui")  # the web UI logs under one name, which operators and tests filter on

KEEP_TAKE_TIMES = 1024  # server times of recent takes, for measurements

try:  # a Hugging Face ZeroGPU Space: the GPU is attached per call to the functions wrapped by spaces.GPU
    import spaces
except ImportError:
    spaces = None


class TakeSession(Protocol):
    """What a running take is read through: the service's session, or :class:`GpuSession` on ZeroGPU."""

    prepared: PreparedRequest

    def __iter__(self) -> Iterator[AudioChunk]: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class GpuSession:
    """A synthesis session on ZeroGPU: the chunks are made inside a ``spaces.GPU`` generator (a process that
    holds the GPU) and come back here, where they are published as usual. Same surface as the service's
    session: iterate, ``cancel()`` (the engine stops within one LLM step), ``close()``."""

    prepared: Any
    chunks: Iterator[AudioChunk]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __iter__(self) -> Iterator[AudioChunk]:
        for chunk in self.chunks:
            if self.cancelled.is_set():
                return
            yield chunk

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        self.chunks.close()


def _gpu_chunks(service: TTSService, request: SynthesisRequest, owner: str | None) -> Iterator[AudioChunk]:
    with contextlib.closing(service.synthesize(request, owner=owner)) as session:
        yield from session


if spaces is not None:
    _gpu_chunks = spaces.GPU(duration=120)(_gpu_chunks)


@dataclass
class TakeTimes:
    """Server-side wall-clock times of a take (epoch seconds), kept for measurements and the tests."""

    start: float
    first_chunk: float | None = None
    finished: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, samples) per chunk


class TakeRecorder:
    """Every take of the studio's page and named API: started (on ZeroGPU inside ``spaces.GPU``), run on a thread
    that publishes its chunks, stopped, timed, and kept with its provenance."""

    def __init__(self, service: TTSService, store: TakeStore, live: LiveHub) -> None:
        self.service, self.store, self.live = service, store, live
        self.times: dict[str, TakeTimes] = {}
        self.running: dict[str, tuple[TakeSession, queue.Queue]] = {}
        self.stopped_early: set[str] = set()  # Stop clicked while the take was still queued
        self._lock = threading.Lock()

    def start(self, synthesis: SynthesisRequest, owner: str | None) -> TakeSession:
        """The service's session for ``synthesis`` (errors raised before any GPU time on ZeroGPU, where the GPU
        process then finds the voice in the library's cache and uses the seed drawn here)."""
        if spaces is None:
            return self.service.synthesize(synthesis, owner=owner)
        prepared = self.service.prepare(synthesis)
        return GpuSession(prepared, _gpu_chunks(self.service, replace(synthesis, seed=prepared.seed), owner))

    def open(self, take_id: str) -> bool:
        """Time a new take; True when Stop came for it while it waited (it is then over: it will not start)."""
        with self._lock:
            self.times[take_id] = TakeTimes(start=time.time())
            while len(self.times) > KEEP_TAKE_TIMES:  # the oldest go first (dicts keep insertion order)
                del self.times[next(iter(self.times))]
            stopped = take_id in self.stopped_early
        if stopped:
            self.abandon(take_id)
        return stopped

    def abandon(self, take_id: str) -> None:
        """A take that will not run (stopped while it waited, or refused by the service): it is over."""
        with self._lock:
            self.stopped_early.discard(take_id)
        self.times[take_id].finished = time.time()
        self.live.finish(take_id)

    def run(self, take_id: str, session: TakeSession) -> Iterator[tuple[str, Any]]:
        """Events of one take: ("chunk", float samples) ..., then ("done" | "stopped" | "error", detail)."""
        events: queue.Queue = queue.Queue()
        with self._lock:
            stopped = take_id in self.stopped_early  # Stop came while the request was being prepared
            if not stopped:
                self.running[take_id] = (session, events)
        if stopped:
            session.close()
            self.abandon(take_id)
            yield "stopped", None
            return
        threading.Thread(target=self._pump, args=(session, take_id, events), daemon=True,
                         name=f"take-{take_id[:8]}").start()
        finished = False
        try:
            while True:
                kind, detail = events.get()
                finished = kind != "chunk"  # the caller stops reading after the last event
                yield kind, detail
                if finished:
                    return
        finally:
            if not finished:  # Gradio dropped the handler (a closed tab): stop the work too
                logger.info("take %s: the page went away; stopping it", take_id[:8])
                session.cancel()

    def _pump(self, session: TakeSession, take_id: str, events: queue.Queue) -> None:
        """Run one take in its own thread: chunks to the live channel and to the Gradio handler. A cancelled
        session's engine work stops within one LLM step (closing it frees the slot), whether or not Gradio
        still reads ``events``."""
        times = self.times[take_id]
        channel = self.live.channel(take_id)
        try:
            with contextlib.closing(session):
                for chunk in session:
                    now = time.time()
                    times.first_chunk = times.first_chunk or now
                    times.chunks.append((now, chunk.pcm.numel()))
                    channel.put(to_pcm16(chunk.pcm).tobytes())
                    events.put(("chunk", chunk.pcm.numpy()))
            events.put(("done", None))
        except BaseException as exc:  # handed to the handler, which reports it
            events.put(("error", exc))
        finally:
            times.finished = time.time()
            self.live.finish(take_id)
            with self._lock:
                self.running.pop(take_id, None)

    def stop(self, take_id: str) -> None:
        """Stop a take: its handler ends at once (keeping what was made) and the engine's work at its next
        chunk; a take still waiting in the queue will not start."""
        with self._lock:
            running = self.running.get(take_id)
            if running is None:
                times = self.times.get(take_id)
                if take_id and (times is None or times.finished is None):  # queued or being prepared
                    self.stopped_early.add(take_id)
                return
        session, events = running
        session.cancel()
        events.put(("stopped", None))

    def keep(self, samples: np.ndarray, synthesis: SynthesisRequest, prepared: PreparedRequest,
             timings: dict[str, float | None], fmt: str, owner: str | None, **form: Any) -> Take:
        """Keep a take in the store as a batch row's is kept, with its download format ``fmt`` and what the page's
        form said (``form``: its tab, the voice's label, whether it was stopped)."""
        return keep_take(self.store, self.service, synthesis, prepared, samples, timings, settings={"format": fmt},
                         form=form, owner=owner)
