"""The service layer: it owns every request, from the adapter's call to the engine's sessions.

Every adapter — the official Python API (:mod:`cosyvoice.cli.cosyvoice`), REST, gRPC, Ray Serve and the web
UI — maps its wire fields onto one :class:`SynthesisRequest` and :class:`~cosyvoice.errors.CosyVoiceError`
back onto its status codes; everything else happens here, once, in one direction (docs/architecture.md):

* validation, at the edge and only here, with :class:`~cosyvoice.errors.InvalidInputError` naming the request
  field at fault (``field``); code below the service asserts its invariants instead of checking again;
* admission (:class:`Admission`, the only one): at most ``Limits.max_sessions`` requests synthesise and
  ``Limits.max_queued_requests`` more wait, first come first served, up to ``Limits.queue_timeout_seconds``;
  beyond that "busy" at once, so servers answer 503 instead of piling up. Decoding an upload happens inside it;
* the seed: a request without one draws it (:func:`draw_seed`, below ``SEED_DRAWS``: 2**53, so JavaScript and
  spreadsheets keep it exactly) from torch's global generator (so ``torch.manual_seed`` repeats an unseeded
  call, as the official API promises) and every session reports the seed it used (``session.seed``): adapters
  draw none of their own;
* voices: a saved voice is looked up by id or name in THE voice library at call time; an uploaded prompt goes
  through the same library, so its features are cached;
* one :class:`~cosyvoice.engine.CancelToken` per request, from the adapter to the LLM scheduler: Stop, a gone
  client, a gRPC cancel or a shutdown (:meth:`TTSService.drain`) ends the LLM within one step;
* outcomes (success, or failure with a reason) reported to listeners, e.g. a server's Prometheus metrics.

Turning a validated request into model input and engine sessions is :mod:`cosyvoice.pipeline`'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import numbers
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import torch

from cosyvoice import pipeline
from cosyvoice.backends.precision import PrecisionPlan
from cosyvoice.encoding import FORMATS, AudioFormat
from cosyvoice.engine import AudioChunk, CancelToken, ChunkSchedule
from cosyvoice.errors import (
    CosyVoiceError,
    InvalidInputError,
    NotFoundError,
    ResourceLimitError,
)
from cosyvoice.flow.prompt_cache import FOLDER as PROMPT_CACHE_FOLDER
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import Voice
from cosyvoice.pipeline import Conditioning, Model, Plan, TextFeed
from cosyvoice.settings import FLOW_STEPS_RANGE, SPEED_RANGE, Limits, VoicePolicy
from cosyvoice.voices import VoiceInfo, VoiceLibrary, check_name

logger = logging.getLogger(__name__)

ServiceMode = Literal["zero_shot", "cross_lingual", "instruct", "sft"]
MODES: tuple[str, ...] = ("zero_shot", "cross_lingual", "instruct", "sft")
MODE_ALIASES = {"instruct2": "instruct"}  # the official API's name for CosyVoice3's instruct mode
#: sample rate of a bare float array given as a prompt without one (what the official servers pass)
TENSOR_PROMPT_RATE = 16000
#: drawn seeds lie below this: the largest range a JavaScript number or a spreadsheet cell holds exactly
SEED_DRAWS = 2**53


def draw_seed() -> int:
    """A seed for a request that has none (the one draw of every adapter): from torch's global generator, so
    ``torch.manual_seed`` repeats it."""
    return int(torch.randint(0, SEED_DRAWS, (), dtype=torch.int64))


def check_text(text: object, limits: Limits, what: str = "text") -> str:
    """Plain text a user typed (text to speak, a transcript, an instruction): a non-empty string within
    ``Limits.max_text_chars``. The one text check: nothing below the service checks it again."""
    if not isinstance(text, str):
        raise InvalidInputError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise InvalidInputError(f"{what} is empty; type something to say")
    if len(text) > limits.max_text_chars:
        raise InvalidInputError(
            f"{what} has {len(text)} characters; at most {limits.max_text_chars} are allowed per request "
            "(COSYVOICE_MAX_TEXT_CHARS); split it into several requests")
    return text


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthesis request, as every adapter states it (plain user text: no CosyVoice3 markers needed).

    ``mode``: ``zero_shot`` (clone the voice; needs its transcript), ``cross_lingual`` (any language, no
    transcript), ``instruct`` (follow ``instruction``; ``instruct2`` is accepted as an alias) or ``sft``
    (a saved voice alone: zero-shot when the voice has a transcript, else cross-lingual).
    The voice is ``voice`` (a saved voice's id or name) or ``prompt_audio`` (an uploaded recording: file
    bytes, a file-like object, an ``(array, sample_rate)`` pair, a float tensor/array at 16 kHz, or a path the
    adapter has vetted). ``stream`` asks the engine for chunks as they are ready; ``format`` is the output
    ``AudioFormat`` name for adapters that encode (``cosyvoice.encoding.FORMATS``). ``steps``: the flow's Euler
    steps (``settings.FLOW_STEPS_RANGE``; None: the model's): fewer are faster and coarser. ``final`` (``"full"``,
    the reference's last flow call with full attention, or ``"chunked"``) and ``first_hop`` (speech tokens of the
    first chunk) shape the chunk schedule (:class:`~cosyvoice.engine.ChunkSchedule`); a request naming a schedule
    other than the reference's is computed chunk by chunk even when it is delivered whole.
    For the official API's semantics: ``text_frontend`` (normalise the text), ``split_prefixed`` (text carrying
    ``<|endofprompt|>`` is normalised and split like plain text; False keeps it one unnormalised piece, as the
    reference does) and ``prompt_conventions`` (False: transcript, instruction and cross-lingual text come in
    the model's form already and must carry ``<|endofprompt|>``).
    """

    text: str
    mode: str = "zero_shot"
    voice: str | None = None
    prompt_audio: AudioSource | None = None
    transcript: str = ""
    instruction: str = ""
    speed: float = 1.0
    seed: int | None = None
    steps: int | None = None  # the flow's Euler steps (None: the model's, 10 for CosyVoice3)
    final: str | None = None  # the last flow call: "full" (None: the reference's) or "chunked"
    first_hop: int | None = None  # speech tokens of the first chunk (None: the reference's 25, padded)
    stream: bool = True
    format: str = "pcm"
    text_frontend: bool = True
    split_prefixed: bool = True
    prompt_conventions: bool = True


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request with its voice resolved and its pipeline plan made: nothing left to check."""

    mode: str  # the service mode asked for
    plan: Plan
    stream: bool
    speed: float
    format: AudioFormat
    steps: int  # the model's default when the request named none
    schedule: ChunkSchedule  # first hop and last flow call

    @property
    def engine_mode(self) -> pipeline.EngineMode:
        return self.plan.cond.mode

    @property
    def voice_id(self) -> str:
        return self.plan.voice_id

    @property
    def cond(self) -> Conditioning:
        return self.plan.cond

    @property
    def segments(self) -> tuple[str, ...]:
        """The normalised text pieces as the user wrote them, without prompt heads (empty for a text stream)."""
        return self.plan.segments

    @property
    def seed(self) -> int:
        """The request's seed, drawn at validation when it had none."""
        return self.plan.seed


@dataclass(frozen=True)
class _Checked:
    mode: str
    stream: bool
    speed: float
    seed: int
    format: AudioFormat
    instruction: str
    steps: int
    schedule: ChunkSchedule


@dataclass(frozen=True)
class Outcome:
    """How one request ended, for metrics: ``reason`` is None on success."""

    mode: str
    reason: str | None  # invalid_input | not_found | busy | cancelled | model_error | internal
    seconds: float  # wall time from the call to the end
    audio_seconds: float = 0.0
    first_chunk_seconds: float | None = None  # from the call to the first chunk with samples


@dataclass(frozen=True)
class ServiceStatus:
    """Readiness and load, for health endpoints and metrics."""

    model_dir: str
    sample_rate: int
    active_sessions: int
    queued_requests: int
    max_sessions: int
    max_queued_requests: int
    saved_voices: int
    precision: dict[str, object]  # what each stage computes in (PrecisionPlan.describe())


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


def mode_label(mode: object) -> str:
    """The mode as metrics label it: a service mode (aliases resolved) or ``unknown``."""
    mode = MODE_ALIASES.get(mode, mode) if isinstance(mode, str) else mode
    return mode if mode in MODES else "unknown"


def allowed_path(path: str, root: str | Path | None, field: str = "prompt_audio") -> Path:
    """``path`` if it names a file under ``root`` (symlinks resolved), for adapters that accept server paths;
    with no ``root`` configured, paths are refused."""
    if root is None:
        raise InvalidInputError("this server accepts no file paths; send the audio itself (base64 or upload), "
                                "or start it with an allowed folder (COSYVOICE_ALLOWED_AUDIO_DIR)", field)
    base = Path(root).resolve()
    target = (base / path).resolve()
    if not target.is_relative_to(base):
        raise InvalidInputError(f"the path {path!r} lies outside the allowed audio folder", field)
    if not target.is_file():
        raise InvalidInputError(f"no audio file {path!r} in the allowed audio folder", field)
    return target


class TextPieces(Iterator[str]):
    """Text pieces handed from one thread to a reader that iterates them: ``put`` each piece, then ``end()``;
    ``abort()`` ends the reader at once. (Servers on asyncio write to ``session.writer`` instead.)"""

    _END = object()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = False
        self.aborted = False

    def put(self, piece: str) -> None:
        self._queue.put(piece)

    def end(self) -> None:
        self._queue.put(self._END)

    def abort(self) -> None:
        """Stop the reader now; pieces not yet read are dropped."""
        self.aborted = True
        self._queue.put(self._END)

    def __next__(self) -> str:
        if self._done or self.aborted:
            raise StopIteration
        piece = self._queue.get()
        if piece is self._END:
            self._done = True
            raise StopIteration
        return piece


@contextlib.contextmanager
def _field(name: str) -> Iterator[None]:
    """Name ``name`` as the field of an :class:`InvalidInputError` raised inside, unless it names one."""
    try:
        yield
    except InvalidInputError as exc:
        if exc.field is None:
            exc.field = name
        raise


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


class _Ending:
    """What a session does once, however it ends: free the admission slot and report the outcome; and the
    bookkeeping of the chunks its reader gets, the same for the sync and asyncio sessions."""

    def __init__(self, service: TTSService, prepared: PreparedRequest, started: float, token: CancelToken) -> None:
        self.service, self.prepared, self.started, self.token = service, prepared, started, token
        self.feed: TextFeed | None = None  # a text stream's input, set before its session is made
        self.first: float | None = None
        self.samples = 0
        self.done = False
        self._lock = threading.Lock()
        service._sessions.add(self)  # running, for cancel_all

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
        return chunk

    def reason(self, exc: BaseException | None) -> str | None:
        """The outcome of chunks that stopped: with ``exc``, the error they raised (marked as reported: adapters
        that report errors they catch skip it); without, their end (cancelled if the token was)."""
        if exc is None:
            return "cancelled" if self.token.cancelled else None
        with contextlib.suppress(AttributeError):
            exc._outcome_reported = True
        return failure_reason(exc)

    def cancel(self) -> None:
        self.token.cancel()
        if self.feed is not None:
            self.feed.close()

    def finish(self, reason: str | None) -> bool:
        """End the request once (True the first time): the slot goes back, the outcome is reported."""
        with self._lock:
            if self.done:
                return False
            self.done = True
        if self.feed is not None:
            self.feed.close()
        self.service._sessions.discard(self)
        self.service._admission.release()
        self.service._report(Outcome(self.prepared.mode, reason, time.perf_counter() - self.started,
                                     self.samples / self.service.sample_rate, self.first))
        return True


class _Session:
    """What a sync and an asyncio session share: the admitted request, its chunks, and what adapters read."""

    def __init__(self, ending: _Ending, chunks: Iterator[AudioChunk] | AsyncIterator[AudioChunk]) -> None:
        self._ending, self._chunks = ending, chunks
        self.prepared = ending.prepared
        self.sample_rate = ending.service.sample_rate
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
    may be called from any thread: the engine stops within one LLM step and the reader's iteration ends.
    A text-stream session takes its text through ``writer``."""

    _chunks: Iterator[AudioChunk]

    def __next__(self) -> AudioChunk:
        if self._ending.done:
            raise StopIteration
        try:
            chunk = next(self._chunks)
        except BaseException as exc:
            self._finish(self._ending.reason(None if isinstance(exc, StopIteration) else exc))
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
    the loop directly. ``cancel()`` works from any thread; ``aclose()`` ends the request."""

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


class TTSService:
    """Owns the requests on one loaded :class:`~cosyvoice.pipeline.Model` and THE :class:`VoiceLibrary`."""

    def __init__(self, model: Model, voices: VoiceLibrary, limits: Limits | None = None, *,
                 prompt_cache_dir: Path | None = None) -> None:
        """``prompt_cache_dir``: where the engine's prompt cache keeps the voices' flow prefixes on disk (``load``:
        the voice library's ``prompt-cache`` folder; None: in memory only)."""
        self.model = model
        self.voices = voices
        self.limits = limits or model.limits
        self.sample_rate = model.sample_rate
        self._admission = Admission(self.limits.max_sessions, self.limits.max_queued_requests,
                                    self.limits.queue_timeout_seconds)
        self._sessions: weakref.WeakSet[_Ending] = weakref.WeakSet()  # running requests, for cancel_all
        self._listeners: list[Callable[[Outcome], None]] = []
        if model.engine.prompt_cache is not None and prompt_cache_dir is not None:
            model.engine.prompt_cache.persist(prompt_cache_dir, int(self.limits.prompt_cache_disk_mb * 2**20))

    @classmethod
    def load(cls, model_dir: str | Path, voice_dir: str | Path, *, device: str | torch.device | None = None,
             dtype: str = "fp32", limits: Limits | None = None, download_root: str | Path = "pretrained_models",
             backend: str | None = None, precision: str | None = None, policy: VoicePolicy | None = None,
             builtin_dir: str | Path | None = None) -> TTSService:
        """A model folder (or ModelScope id) and a voice folder -> a ready service (``backend``, ``precision``:
        see :meth:`Model.load`; ``policy``: who may edit saved voices, default the environment's; ``builtin_dir``:
        built-in voices, ``<name>.wav`` + ``<name>.txt``). The voices' flow prefixes are kept with the voices."""
        limits = limits or Limits.from_env()
        model = Model.load(model_dir, device=device, dtype=dtype, limits=limits, download_root=download_root,
                           backend=backend, precision=precision)
        voices = VoiceLibrary(voice_dir, model.frontend, model_dir=model.model_dir,
                              max_entries=limits.max_cached_voices, max_bytes=limits.max_cached_voice_bytes,
                              max_named=limits.max_named_voices, builtin_dir=builtin_dir, policy=policy)
        return cls(model, voices, limits, prompt_cache_dir=voices.dir / PROMPT_CACHE_FOLDER)

    @property
    def model_dir(self) -> str:
        return self.model.model_dir

    # ------------------------------------------------------------------ what features ask of the model and voices

    @property
    def precision(self) -> PrecisionPlan:
        """What the LLM and the DiT compute in (its ``label`` is what takes record and pages show)."""
        return self.model.plan

    @property
    def default_steps(self) -> int:
        """The flow's Euler steps of a request that names none (the model's ``n_timesteps``)."""
        return self.model.engine.default_steps

    @property
    def voices_read_only(self) -> str | None:
        """Why no voice can be saved (the voice folder's setting named), or None."""
        return self.voices.read_only

    def split_text(self, text: str) -> list[str]:
        """``text`` normalised and split into the pieces the model reads, one request each (the frontend's split)."""
        return self.model.frontend.text.split(text)

    def count_text_tokens(self, text: str) -> int:
        """How many LLM text tokens ``text`` is (as the LLM counts it for its length bounds)."""
        return len(self.model.frontend.encode(text))

    def close(self) -> None:
        """Stop the engine's threads and free the model (the service takes no requests after)."""
        self.model.close()

    # ------------------------------------------------------------------ observation

    def add_listener(self, listener: Callable[[Outcome], None]) -> None:
        """Call ``listener`` with the :class:`Outcome` of every request (from the thread that ended it)."""
        self._listeners.append(listener)

    def _report(self, outcome: Outcome) -> None:
        for listener in self._listeners:
            try:
                listener(outcome)
            except Exception:  # metrics must never fail a request
                logger.exception("service listener failed")

    @property
    def active_sessions(self) -> int:
        """Requests synthesising now (cheap: for gauges and health checks; :meth:`status` also counts voices)."""
        return self._admission.active

    @property
    def queued_requests(self) -> int:
        return self._admission.waiting

    @property
    def shutting_down(self) -> bool:
        """Whether :meth:`drain` has begun: new requests are refused (a long job stops resumable)."""
        return self._admission.closed

    def status(self) -> ServiceStatus:
        return ServiceStatus(self.model_dir, self.sample_rate, self._admission.active, self._admission.waiting,
                             self._admission.max_active, self._admission.max_waiting, len(self.list_voices()),
                             self.model.plan.describe())

    # ------------------------------------------------------------------ synthesis

    def prepare(self, request: SynthesisRequest) -> PreparedRequest:
        """Validate ``request`` and resolve its voice (featurising an uploaded prompt, cached by the library),
        without taking a slot. Raises :class:`InvalidInputError` with ``field`` set; cheap checks come first."""
        return self._resolve(request, self._check(request))

    def synthesize(self, request: SynthesisRequest, *, cancel: CancelToken | None = None,
                   owner: str | None = None, wait: bool = False) -> SynthesisSession:
        """Validate, wait for a slot (or raise "busy"), resolve the voice and start: errors in the request raise
        here, before any audio. Iterate the returned session for chunks; close it (or ``cancel``) to stop.
        ``wait`` (long jobs, with ``cancel``): wait for the slot in order until granted or cancelled."""
        assert not wait or cancel is not None, "a waiting request needs a token that can end its wait"
        ending = self._admit(request, lambda checked: self._resolve(request, checked, owner), cancel,
                             job=cancel if wait else None)
        plan = ending.prepared.plan
        return SynthesisSession(ending, pipeline.run_inputs(self.model, plan.inputs(self.model.frontend),
                                                            **ending.engine_options))

    async def asynthesize(self, request: SynthesisRequest, *, cancel: CancelToken | None = None,
                          owner: str | None = None) -> AsyncSynthesisSession:
        """:meth:`synthesize` for asyncio: waiting for a slot never blocks the loop; decoding and featurising an
        upload runs on a worker thread; the audio then comes from the engine with no thread per request."""
        ending = await self._aadmit(request, lambda checked: self._resolve(request, checked, owner), cancel)
        plan = ending.prepared.plan
        return AsyncSynthesisSession(ending, pipeline.arun_inputs(
            self.model, pipeline.as_async(plan.inputs(self.model.frontend)), **ending.engine_options))

    def synthesize_text_stream(self, request: SynthesisRequest, pieces: Iterable[str] | None = None, *,
                               cancel: CancelToken | None = None, owner: str | None = None) -> SynthesisSession:
        """Speak text that arrives over time (e.g. a chat LLM's output); ``request.text`` is ignored.

        Write the text to ``session.writer`` (``write(piece)`` from any thread, then ``close()``), or give an
        iterable of ``pieces``, which a thread of its own feeds in. Audio starts before the text is complete:
        zero-shot and instruct voices use the engine's bi-streaming input (speech tokens follow the text tokens
        as they come); cross-lingual has no such input, so each sentence is spoken as soon as it is complete.
        The whole stream holds one slot; its text is bounded by ``Limits.max_text_chars``.
        """
        ending = self._admit(request, lambda checked: self._resolve(request, checked, owner, text=False), cancel,
                             has_text=False)
        feed, p = self._feed(ending), ending.prepared
        inputs = pipeline.stream_inputs(self.model.frontend, p.cond, feed, p.seed, ending.token)
        return _pumped(SynthesisSession(ending, pipeline.run_inputs(self.model, inputs, text_stream=feed.text_ids,
                                                                    **ending.engine_options)), pieces)

    async def asynthesize_text_stream(self, request: SynthesisRequest, pieces: Iterable[str] | None = None, *,
                                      cancel: CancelToken | None = None,
                                      owner: str | None = None) -> AsyncSynthesisSession:
        """:meth:`synthesize_text_stream` for asyncio: write pieces to ``session.writer`` from the event loop."""
        ending = await self._aadmit(request, lambda checked: self._resolve(request, checked, owner, text=False),
                                    cancel, has_text=False)
        feed, p = self._feed(ending), ending.prepared
        inputs = pipeline.astream_inputs(self.model.frontend, p.cond, feed, p.seed, ending.token)
        return _pumped(AsyncSynthesisSession(ending, pipeline.arun_inputs(
            self.model, inputs, text_stream=feed.text_ids, **ending.engine_options)), pieces)

    def convert_voice(self, source_audio: AudioSource, prompt_audio: AudioSource, *, stream: bool = False,
                      speed: float = 1.0, cancel: CancelToken | None = None) -> SynthesisSession:
        """Voice conversion: the speech of ``source_audio`` (its speech tokens) in the voice of ``prompt_audio``."""
        request = SynthesisRequest("", "cross_lingual", prompt_audio=prompt_audio, speed=speed, stream=stream,
                                   seed=0)
        source: list[tuple[torch.Tensor, int]] = []

        def resolve(checked: _Checked) -> PreparedRequest:
            with _field("source_audio"):
                source.append(self.model.frontend.load_prompt(source_audio))
            return self._resolve(request, checked, text=False)

        ending = self._admit(request, resolve, cancel, has_text=False)
        tokens, inp = pipeline.conversion_input(self.model, source[0], ending.prepared.cond.voice)
        return SynthesisSession(ending, self.model.engine.vocode(tokens, inp, stream=stream,
                                                                 speed=ending.prepared.speed, cancel=ending.token))

    def report_failure(self, mode: str, exc: BaseException, started: float | None = None) -> None:
        """Count a synthesis request that failed before it had a session (adapters call this for errors of
        their own, e.g. an unparsable body); an error the service counted already is not counted again."""
        if getattr(exc, "_outcome_reported", False):
            return
        with contextlib.suppress(AttributeError):  # an exception type that takes no attributes
            exc._outcome_reported = True
        self._report(Outcome(mode, failure_reason(exc), 0.0 if started is None else time.perf_counter() - started))

    # ------------------------------------------------------------------ shutdown

    async def drain(self, grace_seconds: float) -> None:
        """Graceful shutdown: refuse new requests ("shutting down"), let running ones finish for up to
        ``grace_seconds``, then cancel the rest (each engine session stops within one LLM step)."""
        self._admission.close()
        deadline = time.monotonic() + grace_seconds
        while self._admission.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._admission.active:
            logger.warning("shutdown: cancelling %d requests still running after %g s", self._admission.active,
                           grace_seconds)
            self.cancel_all()

    def cancel_all(self) -> None:
        """Cancel every running request (thread-safe)."""
        for ending in list(self._sessions):
            ending.cancel()

    # ------------------------------------------------------------------ admission (a sync and an asyncio face)

    def _admit(self, request: SynthesisRequest, resolve: Callable[[_Checked], PreparedRequest],
               cancel: CancelToken | None, has_text: bool = True, job: CancelToken | None = None) -> _Ending:
        """Check, take a slot (blocking), resolve: the request's :class:`_Ending`, holding its slot."""
        started, checked = self._checked(request, has_text)
        with self._failing(checked.mode, started):
            self._admission.acquire(job)
        with self._failing(checked.mode, started, holding=True):
            prepared = resolve(checked)
        return _Ending(self, prepared, started, cancel or CancelToken())

    async def _aadmit(self, request: SynthesisRequest, resolve: Callable[[_Checked], PreparedRequest],
                      cancel: CancelToken | None, has_text: bool = True) -> _Ending:
        """:meth:`_admit` without blocking the event loop: the slot is awaited, and resolving (decoding and
        featurising an upload is CPU work) runs on a worker thread."""
        started, checked = self._checked(request, has_text)
        with self._failing(checked.mode, started):
            await self._admission.aacquire()
        with self._failing(checked.mode, started, holding=True):
            prepared = await asyncio.to_thread(resolve, checked)
        return _Ending(self, prepared, started, cancel or CancelToken())

    def _checked(self, request: SynthesisRequest, has_text: bool) -> tuple[float, _Checked]:
        """(when the call began, the checked request): every check before taking a slot, so a bad request never
        waits."""
        started = time.perf_counter()
        with self._failing(mode_label(request.mode), started):
            return started, self._check(request, has_text=has_text)

    @contextlib.contextmanager
    def _failing(self, mode: str, started: float, holding: bool = False) -> Iterator[None]:
        """Report a request that fails inside before it has a session, giving back its slot when ``holding`` one."""
        try:
            yield
        except BaseException as exc:
            if holding:
                self._admission.release()
            self.report_failure(mode, exc, started)
            raise

    def _feed(self, ending: _Ending) -> TextFeed:
        """A text stream's input (closed when the request ends): token by token where the engine has
        bi-streaming, else sentence by sentence."""
        kind = "sentences" if ending.prepared.engine_mode == "cross_lingual" else "tokens"
        ending.feed = TextFeed(self.model.frontend, self.limits.max_text_chars, kind)
        return ending.feed

    # ------------------------------------------------------------------ voices

    @contextlib.contextmanager
    def _slot(self) -> Iterator[None]:
        """Decoding and featurising an upload is model work: it holds an admission slot as a synthesis does, so
        uploads cannot exhaust memory beside the requests the service admitted."""
        self._admission.acquire()
        try:
            yield
        finally:
            self._admission.release()
    # ``owner`` (HELPERS "owner"): who asks; None is a local, unrestricted caller. Unsaved uploads are their
    # owner's alone; saved voices are everyone's to use, and the library's policy says who may edit them
    # (PermissionDeniedError otherwise). Entries an owner may not see are reported as not found.

    def create_voice(self, name: str, audio: AudioSource, transcript: str = "", *,
                     owner: str | None = None) -> VoiceInfo:
        """Save a recording (and its transcript: optional, zero-shot cloning needs it) under ``name``.

        A taken name, or a recording + transcript already saved under another name, is refused
        (:class:`AlreadyExistsError`): creating never renames or replaces what a user saved.
        """
        with _field("name"):
            if not isinstance(name, str) or not name.strip():
                raise InvalidInputError("a voice needs a name")
            name = check_name(name)
        plain = ""
        if isinstance(transcript, str) and transcript.strip():
            with _field("transcript"):
                check_text(transcript, self.limits, "transcript")
            plain = pipeline.plain_transcript(transcript)
        with self._slot(), _field("audio"):  # the library names "name" in its errors about the name
            return self.voices.create(name, audio, plain, owner=owner)

    def list_voices(self, *, owner: str | None = None, include_uploads: bool = False) -> list[VoiceInfo]:
        """Built-in voices, then saved voices by name; with ``include_uploads`` also ``owner``'s own unsaved
        uploads, most recent first."""
        return [i for i in self.voices.list(owner=owner) if include_uploads or i.name]

    def get_voice(self, key: str, *, owner: str | None = None) -> VoiceInfo:
        """A voice by id or name; :class:`NotFoundError` (field ``voice``) if there is none ``owner`` may see."""
        with _field("voice"):
            return self.voices.info(key, owner=owner)

    def rename_voice(self, key: str, new_name: str, *, owner: str | None = None) -> VoiceInfo:
        """Give a saved voice another name (unique; never one that looks like an id)."""
        with _field("voice"):
            return self.voices.rename(key, new_name, owner=owner)

    def delete_voice(self, key: str, *, owner: str | None = None) -> VoiceInfo:
        """:class:`NotFoundError` if there is none; a built-in voice cannot be deleted (:class:`InvalidInputError`)."""
        with _field("voice"):
            return self.voices.delete(key, owner=owner)

    def export_voice(self, key: str, *, owner: str | None = None) -> tuple[str, bytes]:
        """(file name, bytes) of one portable voice file: features, transcript and recording."""
        with _field("voice"):
            return self.voices.export(key, owner=owner)

    def import_voice(self, data: bytes, name: str | None = None, *, owner: str | None = None) -> VoiceInfo:
        """Save an exported voice file under ``name`` (default: the name inside it)."""
        with self._slot(), _field("file"):
            return self.voices.import_voice(data, name, owner=owner)

    def voice_recording(self, key: str, *, owner: str | None = None) -> tuple[int, np.ndarray]:
        """(sample rate, int16 samples) of a voice's prompt recording, for previews."""
        with _field("voice"):
            return self.voices.recording(key, owner=owner)

    def check_prompt(self, audio: AudioSource) -> float:
        """Decode and check a prompt recording as synthesis will (the web UI checks uploads as they arrive):
        its length in seconds, or :class:`InvalidInputError` (field ``prompt_audio``) saying why it is unusable."""
        with self._slot(), _field("prompt_audio"):
            wav, sample_rate = self.model.frontend.load_prompt(audio)
        return wav.shape[-1] / sample_rate

    # ------------------------------------------------------------------ validation (the edge: the only checks)

    def _check(self, request: SynthesisRequest, has_text: bool = True) -> _Checked:
        """Every check that needs no audio work (``has_text=False``: the text arrives later, as a stream)."""
        mode = self._mode(request.mode)
        with _field("text"):
            if has_text:
                check_text(request.text, self.limits)
        stream, speed, seed = self._options(request)
        fmt = self._format(request.format)
        return _Checked(mode, stream, speed, seed, fmt, self._instruction(mode, request.instruction),
                        self._steps(request.steps), ChunkSchedule.checked(request.final, request.first_hop))

    def _resolve(self, request: SynthesisRequest, checked: _Checked, owner: str | None = None,
                 text: bool = True) -> PreparedRequest:
        """The pipeline's plan of the checked request, with the voice looked up (or an upload featurised) when
        the pipeline asks for it."""
        uploaded = request.transcript if request.prompt_audio is not None and isinstance(request.transcript, str) \
            else ""
        plan = pipeline.plan(self.model.frontend, checked.mode, request.text if text else None,
                             lambda transcript: self._voice(checked.mode, request, transcript, owner),
                             seed=checked.seed, transcript=uploaded, instruction=checked.instruction,
                             text_frontend=request.text_frontend, split_prefixed=request.split_prefixed,
                             model_form=not request.prompt_conventions)
        return PreparedRequest(checked.mode, plan, checked.stream, checked.speed, checked.format, checked.steps,
                               checked.schedule)

    @staticmethod
    def _mode(mode: object) -> str:
        label = mode_label(mode)
        if label == "unknown":
            raise InvalidInputError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}", "mode")
        return label

    @staticmethod
    def _options(request: SynthesisRequest) -> tuple[bool, float, int]:
        """(stream, speed, seed); a missing seed is drawn from torch's global generator (``torch.manual_seed``
        makes an unseeded request repeatable, as the official API promises)."""
        if not isinstance(request.stream, bool):
            raise InvalidInputError(f"stream must be true or false, got {request.stream!r}", "stream")
        seed = request.seed
        if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
            seed = int(seed)  # numpy integers from adapters
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                                 or not 0 <= seed < pipeline.SEED_SPACE):  # any seed the engine takes
            raise InvalidInputError(f"seed must be an integer in [0, 2**63), got {request.seed!r}", "seed")
        lo, hi = SPEED_RANGE
        speed = request.speed
        # any real scalar is a speed: int, float, numpy, or a one-element array or tensor
        if (isinstance(speed, torch.Tensor) and speed.numel() == 1 and not speed.is_complex()) or (
                isinstance(speed, np.ndarray) and speed.size == 1):
            speed = speed.item()
        if not isinstance(speed, numbers.Real) or isinstance(speed, bool) or not lo <= float(speed) <= hi:
            raise InvalidInputError(f"speed must be between {lo:g} and {hi:g}, got {request.speed!r}", "speed")
        return request.stream, float(speed), draw_seed() if seed is None else seed

    @staticmethod
    def _format(name: object) -> AudioFormat:
        """The output format called ``name`` (case-insensitive), one of the encoder's :data:`FORMATS`."""
        fmt = FORMATS.get(name.lower()) if isinstance(name, str) else None
        if fmt is None:
            raise InvalidInputError(f"unknown audio format {name!r}; use one of {', '.join(FORMATS)}", "format")
        return fmt

    def _steps(self, steps: object) -> int:
        """The flow's Euler steps: an integer in ``FLOW_STEPS_RANGE``, or the model's default for None."""
        if steps is None:
            return self.model.engine.default_steps
        lo, hi = FLOW_STEPS_RANGE
        if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
            steps = int(steps)  # numpy integers from adapters
        if not isinstance(steps, int) or isinstance(steps, bool) or not lo <= steps <= hi:
            raise InvalidInputError(f"steps must be an integer from {lo} to {hi}, got {steps!r}", "steps")
        return steps

    def _instruction(self, mode: str, instruction: object) -> str:
        """The instruction as the user wrote it (the pipeline wraps it where its token ids are made)."""
        if mode != "instruct":
            return ""
        with _field("instruction"):
            if not isinstance(instruction, str) or not instruction.strip():
                raise InvalidInputError("instruct mode needs an instruction, e.g. 'Speak slowly and calmly.'")
            return check_text(instruction, self.limits, "instruction")

    def _voice(self, mode: str, request: SynthesisRequest, transcript: str,
               owner: str | None = None) -> tuple[str, Voice]:
        """(voice id, voice): a saved voice (looked up now), else the uploaded recording with its plain
        ``transcript`` (the pipeline's, without the system prompt; through the library, cached for ``owner``; a
        full disk only skips the caching)."""
        saved, audio = request.voice, request.prompt_audio
        if saved is not None and audio is not None:
            raise InvalidInputError("give a saved voice or a prompt recording, not both", "voice")
        if saved is not None:
            if not isinstance(saved, str) or not saved.strip():
                raise InvalidInputError("voice must be a saved voice's id or name", "voice")
            with _field("voice"):
                info, voice = self.voices.get(saved, owner=owner)
            if mode == "zero_shot" and not voice.prompt_text.numel():
                raise InvalidInputError(f"voice {saved!r} has no transcript, which zero-shot cloning needs; use "
                                        "cross_lingual or instruct mode with it, or save it again with its "
                                        "transcript", "voice")
            return info.id, voice
        if mode == "sft":
            raise InvalidInputError("sft mode speaks with a saved voice: give its id or name", "voice")
        if audio is None:
            raise InvalidInputError(f"{mode} needs a voice: a saved voice's id or name, or a prompt recording",
                                    "voice")
        if mode == "zero_shot":
            with _field("transcript"):
                if not isinstance(request.transcript, str) or not request.transcript.strip():
                    raise InvalidInputError("zero-shot cloning needs the transcript of the prompt recording; or "
                                            "use cross_lingual mode, which needs none")
                check_text(request.transcript, self.limits, "transcript")
                if not transcript:
                    raise InvalidInputError("the transcript has only the system prompt; give the words of the "
                                            "prompt recording after it")
        with _field("prompt_audio"):
            return self.voices.get_or_create(audio, transcript if mode == "zero_shot" else "", owner=owner)


_S = TypeVar("_S", SynthesisSession, AsyncSynthesisSession)


def _pumped(session: _S, pieces: Iterable[str] | None) -> _S:
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
