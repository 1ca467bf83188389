"""A request's audio as adapters read it: :class:`SynthesisSession` (threads) and :class:`AsyncSynthesisSession`
(asyncio, no thread of its own), over one :class:`Ending` that frees the request's slot and reports its
:class:`Outcome` once, however the request ends; and the pump that feeds a text stream from a caller's iterable.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from cosyvoice import pipeline
from cosyvoice.engine import AudioChunk, CancelToken
from cosyvoice.errors import CancelledByShutdown, CosyVoiceError, InvalidInputError, NotFoundError, ResourceLimitError
from cosyvoice.pipeline import TextFeed
from cosyvoice.request import PreparedRequest


@dataclass(frozen=True)
class Outcome:
    """How one request ended, for metrics: ``reason`` is None on success."""

    mode: str
    reason: str | None  # invalid_input | not_found | busy | cancelled | model_error | internal
    seconds: float  # wall time from the call to the end
    audio_seconds: float = 0.0
    first_chunk_seconds: float | None = None  # from the call to the first chunk with samples


def failure_reason(exc: BaseException) -> str:
    """The metrics label of an error."""
    if isinstance(exc, NotFoundError):
        return "not_found"
    if isinstance(exc, InvalidInputError):
        return "invalid_input"
    if isinstance(exc, ResourceLimitError):
        return "busy"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    if isinstance(exc, CosyVoiceError):
        return "model_error"
    return "internal"


class Ending:
    """What a session does once, however it ends: hand its :class:`Outcome` to ``on_end`` (the service frees the
    slot and reports it); and the bookkeeping of the chunks its reader gets, the same for the sync and asyncio
    sessions."""

    def __init__(self, prepared: PreparedRequest, started: float, token: CancelToken, sample_rate: int,
                 on_end: Callable[[Ending, Outcome], None]) -> None:
        self.prepared, self.started, self.token, self.sample_rate = prepared, started, token, sample_rate
        self._on_end = on_end
        self.feed: TextFeed | None = None  # a text stream's input, set before its session is made
        self.first: float | None = None
        self.samples = 0
        self.finals = 0  # segments whose last chunk the reader got
        self.done = False
        self.shut_down = False  # cancelled by the service's shutdown, not by its reader
        self._lock = threading.Lock()

    @property
    def engine_options(self) -> dict[str, object]:
        """How the engine runs the request: its streaming, speed, token, flow steps and chunk schedule."""
        p = self.prepared
        return {"stream": p.stream, "speed": p.speed, "cancel": self.token, "steps": p.steps, "schedule": p.schedule}

    def passed(self, chunk: AudioChunk) -> AudioChunk:
        """Count a chunk handed to the reader (the audio's length; when the first one with samples came)."""
        if chunk.pcm.numel() and self.first is None:
            self.first = time.perf_counter() - self.started
        self.samples += chunk.pcm.numel()
        self.finals += chunk.final
        return chunk

    @property
    def complete(self) -> bool:
        """The reader got every segment's last chunk: the audio is whole, whatever cancel comes after it. A text
        stream's segments are not known in advance: never complete by this count."""
        segments = self.prepared.segments
        return bool(segments) and self.finals >= len(segments)

    def reason(self, exc: BaseException | None) -> str | None:
        """The outcome of chunks that stopped: with ``exc``, the error they raised (marked as reported: adapters
        that report errors they catch skip it); without, their end (cancelled if the token was)."""
        if exc is None:
            return "cancelled" if self.token.cancelled and not self.complete else None
        with contextlib.suppress(AttributeError):
            exc._outcome_reported = True
        return failure_reason(exc)

    def cancel(self, shutdown: bool = False) -> None:
        """Stop the request; ``shutdown``: the service stops it as it shuts down (its reader is told so)."""
        self.shut_down = self.shut_down or shutdown
        self.token.cancel()
        if self.feed is not None:
            self.feed.close()

    def raise_if_shut_down(self) -> None:
        """Chunks that stopped because the service shut down are no whole answer: their reader gets
        :class:`CancelledByShutdown` (a 503 where it can still be said) instead of an end that looks complete; a
        request whose last chunk was already read is whole, and ends as such."""
        if self.shut_down and not self.complete:
            error = CancelledByShutdown()
            error._outcome_reported = True  # reported as cancelled when the chunks ended
            raise error

    def finish(self, reason: str | None) -> bool:
        """End the request once (True the first time): the slot goes back, the outcome is reported."""
        with self._lock:
            if self.done:
                return False
            self.done = True
        if self.feed is not None:
            self.feed.close()
        self._on_end(self, Outcome(self.prepared.mode, reason, time.perf_counter() - self.started,
                                   self.samples / self.sample_rate, self.first))
        return True


class _Session:
    """What a sync and an asyncio session share: the admitted request, its chunks, and what adapters read."""

    def __init__(self, ending: Ending, chunks: Iterator[AudioChunk] | AsyncIterator[AudioChunk]) -> None:
        self._ending, self._chunks = ending, chunks
        self.prepared = ending.prepared
        self.sample_rate = ending.sample_rate
        self.writer = ending.feed

    @property
    def seed(self) -> int:
        return self.prepared.seed

    @property
    def audio_seconds(self) -> float:
        return self._ending.samples / self.sample_rate

    def cancel(self) -> None:
        """Thread-safe: the engine stops within one LLM step; a reader waiting for the next chunk returns."""
        self._ending.cancel()


class SynthesisSession(_Session, Iterator[AudioChunk]):
    """One admitted request's audio. Iterate for :class:`AudioChunk`; ``close()`` (or leaving a ``with``
    block, or dropping it) ends the request, cancels the engine session and frees the slot. ``cancel()``
    may be called from any thread: the engine stops within one LLM step and the reader's iteration ends (with
    :class:`~cosyvoice.errors.CancelledByShutdown` when the service's shutdown cancelled it).
    A text-stream session takes its text through ``writer``."""

    _chunks: Iterator[AudioChunk]

    def __next__(self) -> AudioChunk:
        if self._ending.done:
            raise StopIteration
        try:
            chunk = next(self._chunks)
        except StopIteration:
            self._finish(self._ending.reason(None))
            self._ending.raise_if_shut_down()
            raise
        except BaseException as exc:
            self._finish(self._ending.reason(exc))
            raise
        return self._ending.passed(chunk)

    def close(self) -> None:
        self._finish("cancelled")

    def __enter__(self) -> SynthesisSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self._finish("cancelled")

    def _finish(self, reason: str | None) -> None:
        if self._ending.done:
            return
        try:
            self._ending.cancel() if reason == "cancelled" else None
            self._chunks.close()  # the engine releases its session (at most one LLM step)
        finally:
            self._ending.finish(reason)


class AsyncSynthesisSession(_Session, AsyncIterator[AudioChunk]):
    """One admitted request's audio on the event loop, with no thread of its own: the engine hands chunks to
    the loop directly. ``cancel()`` works from any thread; ``aclose()`` ends the request. As the sync session,
    its iteration raises :class:`~cosyvoice.errors.CancelledByShutdown` when the service's shutdown cancelled it."""

    _chunks: AsyncIterator[AudioChunk]
    _reading = False  # a reader is waiting in ``__anext__``

    async def __anext__(self) -> AudioChunk:
        ending = self._ending
        if ending.done:
            raise StopAsyncIteration
        self._reading = True
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            ending.finish(ending.reason(None))
            ending.raise_if_shut_down()
            raise
        except BaseException as exc:
            ending.cancel()
            ending.finish(ending.reason(exc))
            raise
        finally:
            self._reading = False
        return ending.passed(chunk)

    async def aclose(self) -> None:
        """Cancel (if still running): the engine stops within one LLM step and the slot goes back."""
        self._ending.cancel()
        if not self._reading:  # a reader in another task ends by itself once the token is cancelled
            with contextlib.suppress(Exception):
                await self._chunks.aclose()
            self._ending.finish("cancelled")

    async def wait_closed(self) -> None:
        """Until the request has ended (its slot is free)."""
        while not self._ending.done:
            await asyncio.sleep(0.01)

    def __del__(self) -> None:
        if not self._ending.done:
            self._ending.cancel()
            self._ending.finish("cancelled")


_S = TypeVar("_S", SynthesisSession, AsyncSynthesisSession)


def pumped(session: _S, pieces: Iterable[str] | None) -> _S:
    """``session``, its text fed from ``pieces`` (when given) by :func:`_pump`."""
    if pieces is not None:
        assert session.writer is not None, "pieces are the text of a text stream"
        _pump(pieces, session.writer)
    return session


def _pump(pieces: Iterable[str], feed: TextFeed) -> None:
    """Feed an iterable of text pieces (a caller's generator: it may block) into ``feed`` from a thread of its
    own; its exception, if any, fails the synthesis; a closed feed (the listener went away) stops the pull."""

    def run() -> None:
        try:
            for piece in pieces:
                feed.write(piece)
        except pipeline.TextStreamClosedError:
            return
        except BaseException as exc:
            feed.close(exc)
            return
        feed.close()

    threading.Thread(target=run, daemon=True, name="cosyvoice-text-pump").start()
