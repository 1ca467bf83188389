"""A session: what the caller, the LLM scheduler and the token-to-wave worker share about one text segment.

Each field has one writer (docs/architecture.md, "Engine"):

- the caller (the thread or task that opened it): the request (read-only after opening) and ``cancel``;
- the LLM scheduler: ``tokens``, ``llm_done``, ``llm_error`` (:meth:`Session.add_tokens`, :meth:`Session.llm_finished`);
- the token-to-wave worker: the output queue (:meth:`Session.put`) and ``released``.

The caller reads the output (:meth:`Session.get` blocking, :meth:`Session.aget` in asyncio). Everything the
worker needs to turn tokens into audio (chunk policy, flow and vocoder stream state, offsets) lives in the
worker's :class:`~cosyvoice.engine.t2w.T2WState`, not here.
"""

from __future__ import annotations

import asyncio
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from cosyvoice.errors import InvalidInputError
from cosyvoice.frontend.frontend import ModelInput
from cosyvoice.settings import FINAL_CALLS, FIRST_HOP_RANGE


@dataclass(frozen=True)
class AudioChunk:
    """One piece of streamed audio with the bookkeeping a client needs to place and time it."""

    pcm: torch.Tensor  # float32 [N] on CPU, in [-audio_limit, audio_limit]
    sample_rate: int
    index: int  # 0, 1, ... within the request
    sample_offset: int  # index of pcm[0] in the request's whole waveform
    token_start: int  # speech tokens [token_start, token_end) this chunk finalises
    token_end: int
    final: bool  # last chunk of its text segment
    seconds_to_produce: float  # wall time from the request start (chunk 0) or the previous chunk
    tokens: tuple[int, ...] = ()  # the speech tokens [token_start, token_end) themselves (take checks read them)

    def int16(self) -> np.ndarray:
        """PCM16 little-endian samples, as streamed by the servers."""
        return (self.pcm.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16).numpy()


@dataclass(frozen=True)
class ChunkSchedule:
    """A request's choices about how its speech is cut into flow calls (validated by the service).

    ``first_hop``: speech tokens of the first chunk (None: the reference's first hop, padded so that prompt + hop
    fill whole flow chunks); a smaller one is a partial first chunk, and the next chunk ends where the reference's
    first one does, so the boundaries after it are the reference's. ``final``: the last flow call, ``"full"``
    (full attention over the whole utterance, the reference) or ``"chunked"`` (the chunk-causal mask over the new
    frames only). A schedule other than the reference's is computed chunk by chunk even for a request that is
    delivered whole, so its takes differ from a stream's only where the options say.
    """

    first_hop: int | None = None
    final: str = "full"

    @property
    def reference(self) -> bool:
        return self.first_hop is None and self.final == "full"

    @classmethod
    def checked(cls, final: object = None, first_hop: object = None) -> ChunkSchedule:
        """The schedule a request names (None: the reference's choice), or :class:`InvalidInputError` naming the
        field: ``final`` one of :data:`~cosyvoice.settings.FINAL_CALLS`, ``first_hop`` whole speech tokens in
        :data:`~cosyvoice.settings.FIRST_HOP_RANGE`."""
        if final is not None and final not in FINAL_CALLS:
            raise InvalidInputError(f"final must be one of {', '.join(map(repr, FINAL_CALLS))}, got {final!r}",
                                    "final")
        if isinstance(first_hop, numbers.Integral) and not isinstance(first_hop, bool):
            first_hop = int(first_hop)  # numpy integers from adapters
        lo, hi = FIRST_HOP_RANGE
        if first_hop is not None and (not isinstance(first_hop, int) or isinstance(first_hop, bool)
                                      or not lo <= first_hop <= hi):
            raise InvalidInputError(f"first_hop must be a whole number of speech tokens from {lo} to {hi}, got "
                                    f"{first_hop!r}", "first_hop")
        return cls(first_hop, final or "full")


@dataclass
class ChunkPolicy:
    """CosyVoice3 streaming boundaries, owned by one session.

    The first hop is padded so that prompt tokens + first hop fill whole flow chunks
    (the DiT's chunk mask is aligned to frame 0 of the prompt); afterwards the hop grows
    by ``scale`` up to ``max_hop``. A chunk needs ``hop + lookahead`` tokens beyond the offset.
    ``first_hop`` splits that first hop: a first chunk of ``first_hop`` tokens, then the rest of it.
    """

    prompt_len: int
    hop: int = 25  # fixed in the reference (CosyVoice3Model), whatever the yaml's chunk_size says
    max_hop: int = 100
    scale: int = 2
    lookahead: int = 3
    offset: int = 0
    first_hop: int | None = None

    def __post_init__(self) -> None:
        self.first_end = self.hop + -self.prompt_len % self.hop  # the reference's first hop, padded to whole hops

    def current_hop(self) -> int:
        if self.offset == 0 and self.first_hop is not None:
            return min(self.first_hop, self.first_end)
        if self.offset < self.first_end:
            return self.first_end - self.offset
        return self.hop

    def ready(self, n_tokens: int) -> bool:
        return n_tokens - self.offset >= self.current_hop() + self.lookahead

    def advance(self) -> tuple[int, int]:
        """Consume one hop; returns the (start, end) token range it finalised."""
        start, end = self.offset, self.offset + self.current_hop()
        self.offset = end
        if end >= self.first_end:  # a partial first chunk leaves the hop as it is until the first hop is done
            self.hop = min(self.max_hop, self.hop * self.scale)
        return start, end


@dataclass(frozen=True)
class ChunkWork:
    """One chunk to compute: tokens ``[0, end)`` are known; the chunk finalises ``[start, stop)``."""

    tokens: list[int]  # every token so far (the flow needs the look-ahead beyond ``stop``)
    start: int
    stop: int
    final: bool


class CancelToken:
    """Cancels one request from any thread: a Stop button, a client that hung up, a server shutting down.

    Closing a chunk iterator only works from the thread that iterates it; a token works from anywhere.
    The engine links a session's own token to the caller's (so closing one segment's iterator never
    cancels the caller's request); the scheduler and the worker listen to the session's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._listeners: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` on cancel (at once if already cancelled); returns the unsubscribe function."""
        with self._lock:
            if not self._cancelled:
                self._listeners.append(listener)
                return lambda: self._discard(listener)
        listener()
        return lambda: None

    def _discard(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)


@dataclass(eq=False)
class Session:
    """One text segment in the engine; see the module docstring for who writes what (``cond`` guards it)."""

    # the request, set by the caller at opening and read-only afterwards
    id: int
    seed: int
    inp: ModelInput
    stream: bool
    speed: float
    sample_offset: int = 0  # of the first chunk in the request's waveform
    first_index: int = 0  # of the first chunk in the request
    steps: int | None = None  # the flow's Euler steps (None: the model's; the engine always names them)
    schedule: ChunkSchedule = field(default_factory=ChunkSchedule)  # first hop and last flow call
    started: float = field(default_factory=time.perf_counter)
    cancel: CancelToken = field(default_factory=CancelToken)  # the session's own; a caller's token cancels it
    cond: threading.Condition = field(default_factory=threading.Condition)
    # the LLM scheduler's
    tokens: list[int] = field(default_factory=list)
    llm_done: bool = False
    llm_error: BaseException | None = None
    # the token-to-wave worker's
    released: threading.Event = field(default_factory=threading.Event)  # nothing touches the session any more
    _out: deque = field(default_factory=deque)
    _waker: Callable[[], None] | None = None  # the caller's (aget), called by the worker

    @property
    def cancelled(self) -> bool:
        return self.cancel.cancelled

    @property
    def chunked(self) -> bool:
        """Whether the worker computes the speech chunk by chunk: a stream, or a schedule not the reference's."""
        return self.stream or not self.schedule.reference

    # ------------------------------------------------------------------ the LLM scheduler

    def add_tokens(self, tokens: tuple[int, ...]) -> None:
        with self.cond:
            self.tokens.extend(tokens)

    def llm_finished(self, error: BaseException | None) -> None:
        with self.cond:
            self.llm_done, self.llm_error = True, error

    def llm_snapshot(self) -> tuple[int, bool, BaseException | None]:
        """(tokens so far, whether the LLM is done, its error): a consistent view for the worker."""
        with self.cond:
            return len(self.tokens), self.llm_done, self.llm_error

    # ------------------------------------------------------------------ the token-to-wave worker

    def put(self, item: AudioChunk | BaseException) -> None:
        """Queue a chunk (or the error that ends the session) for the caller."""
        with self.cond:
            self._out.append(item)
            self.cond.notify_all()
            waker = self._waker
        if waker is not None:
            waker()

    def wake_reader(self) -> None:
        """Wake a reader blocked in :meth:`get` / :meth:`aget` (the session was cancelled)."""
        with self.cond:
            self.cond.notify_all()
            waker = self._waker
        if waker is not None:
            waker()

    # ------------------------------------------------------------------ the caller

    def get(self) -> AudioChunk | BaseException | None:
        """Next output (blocking); None once the session is cancelled and nothing is left to read."""
        with self.cond:
            self.cond.wait_for(lambda: self._out or self.cancelled)
            return self._out.popleft() if self._out else None

    async def aget(self) -> AudioChunk | BaseException | None:
        """Next output without blocking the event loop; None once cancelled with nothing left to read."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        with self.cond:
            if self._out or self.cancelled:
                return self._out.popleft() if self._out else None
            self._waker = lambda: loop.call_soon_threadsafe(ready.set)
        try:
            await ready.wait()
        finally:
            with self.cond:
                self._waker = None
        with self.cond:
            return self._out.popleft() if self._out else None
