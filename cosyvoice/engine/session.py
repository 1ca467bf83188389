"""A session: one text segment's state, its output queue and its cancel flag. No thread of its own.

The LLM scheduler appends tokens (:meth:`Session.add_tokens`, :meth:`Session.llm_finished`); the
token-to-wave worker takes chunk work (:meth:`Session.take_work`) when the chunk policy allows and
puts finished chunks in the output queue (:meth:`Session.put`); the caller reads them (:meth:`Session.get`
blocking, :meth:`Session.aget` in asyncio). ``cancel()`` sets a flag that the scheduler reads between
steps and the worker before each chunk; ``released`` is set once nothing touches the session any more.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from cosyvoice.engine.scheduler import Ticket
from cosyvoice.flow import FlowStream
from cosyvoice.frontend.frontend import ModelInput
from cosyvoice.hifigan import HiFTStream
from cosyvoice.hifigan.speed import MelTimeScale


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

    def int16(self) -> np.ndarray:
        """PCM16 little-endian samples, as streamed by the servers."""
        return (self.pcm.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16).numpy()


@dataclass
class ChunkPolicy:
    """CosyVoice3 streaming boundaries, owned by one session.

    The first hop is padded so that prompt tokens + first hop fill whole flow chunks
    (the DiT's chunk mask is aligned to frame 0 of the prompt); afterwards the hop grows
    by ``scale`` up to ``max_hop``. A chunk needs ``hop + lookahead`` tokens beyond the offset.
    """

    prompt_len: int
    hop: int = 25  # fixed in the reference (CosyVoice3Model), whatever the yaml's chunk_size says
    max_hop: int = 100
    scale: int = 2
    lookahead: int = 3
    offset: int = 0

    def current_hop(self) -> int:
        if self.offset == 0:
            pad = -self.prompt_len % self.hop  # ceil(prompt/hop)*hop - prompt
            return self.hop + pad
        return self.hop

    def ready(self, n_tokens: int) -> bool:
        return n_tokens - self.offset >= self.current_hop() + self.lookahead

    def advance(self) -> tuple[int, int]:
        """Consume one hop; returns the (start, end) token range it finalised."""
        start, end = self.offset, self.offset + self.current_hop()
        self.offset = end
        self.hop = min(self.max_hop, self.hop * self.scale)
        return start, end


@dataclass(frozen=True)
class ChunkWork:
    """One chunk to compute: tokens ``[0, end)`` are known; the chunk finalises ``[start, stop)``."""

    tokens: list[int]  # every token so far (the flow needs the look-ahead beyond ``stop``)
    start: int
    stop: int
    final: bool


@dataclass(eq=False)
class Session:
    """Per-request state; every field below ``cond`` is guarded by it."""

    id: int
    seed: int
    inp: ModelInput
    stream: bool
    speed: float
    policy: ChunkPolicy
    sample_offset: int = 0
    next_index: int = 0
    started: float = field(default_factory=time.perf_counter)
    cond: threading.Condition = field(default_factory=threading.Condition)
    tokens: list[int] = field(default_factory=list)
    llm_done: bool = False
    error: BaseException | None = None
    cancelled: bool = False
    busy: bool = False  # a chunk is being computed (at most one at a time: the streams are sequential)
    finished: bool = False  # the final chunk or an error is in the output queue
    releasing: bool = False  # the engine is freeing it (once)
    released: threading.Event = field(default_factory=threading.Event)
    audio_seconds: float = 0.0  # audio put in the queue so far (the playback deadline's clock)
    last_output: float = 0.0
    # token-to-wave state, touched only by whoever computes this session's chunks (one at a time)
    flow_stream: FlowStream | None = None
    hift_stream: HiFTStream | None = None
    time_scale: MelTimeScale | None = None  # streamed at speed != 1: the mel stretch carried across chunks
    mel_cache: torch.Tensor | None = None
    speech_offset: int = 0
    flow_fed: int = 0  # tokens given to flow_stream so far
    _out: deque = field(default_factory=deque)
    _waker: Callable[[], None] | None = None
    ticket: Ticket | None = None  # the LLM's handle, once started
    unsubscribe_text: Callable[[], None] | None = None  # a text stream's wake-up of the scheduler
    llm_thread: threading.Thread | None = None  # eager strategy only

    # ------------------------------------------------------------------ producers (scheduler, worker)

    def add_tokens(self, tokens: tuple[int, ...]) -> None:
        with self.cond:
            self.tokens.extend(tokens)
            self.cond.notify_all()

    def llm_finished(self, error: BaseException | None) -> None:
        with self.cond:
            self.llm_done = True
            if error is not None and self.error is None:
                self.error = error
            self.cond.notify_all()

    def work_ready(self) -> bool:
        """Whether a chunk (or the final one, or an error) can be produced now. Call with ``cond`` held."""
        if self.busy or self.finished or self.cancelled:
            return False
        if self.error is not None or self.llm_done:
            return True
        return self.stream and self.policy.ready(len(self.tokens))

    def take_work(self) -> ChunkWork | BaseException | None:
        """The next chunk to compute (marks the session busy), its error, or None. Call with ``cond`` held."""
        if not self.work_ready():
            return None
        if self.error is not None:
            self.finished = True
            return self.error
        n = len(self.tokens)
        self.busy = True
        if self.stream and self.policy.ready(n):
            hop = self.policy.current_hop()
            start, stop = self.policy.advance()
            return ChunkWork(self.tokens[:start + hop + self.policy.lookahead], start, stop, final=False)
        return ChunkWork(list(self.tokens), self.policy.offset, n, final=True)

    def put(self, item: AudioChunk | BaseException) -> None:
        """Queue a chunk (or the error that ends the session) for the caller."""
        with self.cond:
            if isinstance(item, AudioChunk):
                self.audio_seconds += item.pcm.numel() / item.sample_rate
                self.finished = self.finished or item.final
            else:
                self.finished = True
            self.busy = False
            self._out.append(item)
            self.cond.notify_all()
            waker = self._waker
        if waker is not None:
            waker()

    def deadline(self) -> float:
        """When the client will have played everything sent so far: the next chunk is due by then."""
        return self.started + self.audio_seconds

    # ------------------------------------------------------------------ the caller

    def cancel(self) -> None:
        """Ask everything working for this session to stop (the scheduler within one step)."""
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()
            waker = self._waker
        if waker is not None:
            waker()

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


class CancelToken:
    """Cancels one request from any thread: a Stop button, a client that hung up, a server shutting down.

    Closing a chunk iterator only works from the thread that iterates it; a token works from anywhere.
    The engine subscribes the running session; the API stops between text segments.
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
