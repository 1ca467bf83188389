"""The service layer: one request type, validated once, turned into model input; shared by every adapter.

The REST, gRPC and Ray Serve servers and the web UI are thin adapters over :class:`TTSService`. They map
their wire fields onto :class:`SynthesisRequest` and :class:`~cosyvoice.errors.CosyVoiceError` onto their
status codes; everything else happens here, once:

* validation, with :class:`~cosyvoice.errors.InvalidInputError` naming the request field at fault (``field``);
* admission: at most ``Limits.max_sessions`` requests synthesise, ``Limits.max_queued_requests`` more wait up
  to ``Limits.queue_timeout_seconds``; beyond that a request is refused at once with
  :class:`~cosyvoice.errors.ResourceLimitError` ("busy"), so servers answer 503 instead of piling up;
* mode -> model input with CosyVoice3's prompt conventions (users send plain transcripts and instructions;
  ``cosyvoice.frontend.prompts`` adds the system prefix where it is missing);
* voices: a saved voice is looked up by id or name in THE voice library at call time (voices saved after
  start-up work at once); an uploaded prompt goes through the same library, so its features are cached;
* outcomes (success, or failure with a reason) reported to listeners, e.g. a server's Prometheus metrics.

The service never runs a network itself: it calls the public ``CosyVoice3.synthesize`` API, so the engine
behind it (threads today, a batched scheduler tomorrow) can change without touching any adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import numbers
import queue
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from cosyvoice.cli.cosyvoice import CosyVoice3
from cosyvoice.encoding import AudioFormat, audio_format
from cosyvoice.engine import AudioChunk, CancelToken, Engine
from cosyvoice.errors import (
    CosyVoiceError,
    InvalidInputError,
    NotFoundError,
    ResourceLimitError,
    StorageError,
)
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import Voice
from cosyvoice.frontend.prompts import cross_lingual_text, instruct_text, user_text, zero_shot_prompt_text
from cosyvoice.settings import Limits
from cosyvoice.voices import VoiceInfo, VoiceLibrary, check_name

logger = logging.getLogger(__name__)

ServiceMode = Literal["zero_shot", "cross_lingual", "instruct", "sft"]
MODES: tuple[str, ...] = ("zero_shot", "cross_lingual", "instruct", "sft")
MODE_ALIASES = {"instruct2": "instruct"}  # the official API's name for CosyVoice3's instruct mode
_ENGINE_MODES = {"zero_shot": "zero_shot", "cross_lingual": "cross_lingual", "instruct": "instruct2"}
STREAM_QUEUE_CHUNKS = 4  # chunks an async session may hold ready before its worker waits for the reader


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthesis request, as every adapter states it (plain user text: no CosyVoice3 markers needed).

    ``mode``: ``zero_shot`` (clone the voice; needs its transcript), ``cross_lingual`` (any language, no
    transcript), ``instruct`` (follow ``instruction``; ``instruct2`` is accepted as an alias) or ``sft``
    (a saved voice alone: zero-shot when the voice has a transcript, else cross-lingual).
    The voice is ``voice`` (a saved voice's id or name) or ``prompt_audio`` (an uploaded recording: file
    bytes, a file-like object, an ``(array, sample_rate)`` pair, or a path the adapter has vetted).
    ``stream`` asks the engine for chunks as they are ready; ``format`` is the output ``AudioFormat`` name
    for adapters that encode (``cosyvoice.encoding.FORMATS``).
    """

    text: str
    mode: str = "zero_shot"
    voice: str | None = None
    prompt_audio: AudioSource | None = None
    transcript: str = ""
    instruction: str = ""
    speed: float = 1.0
    seed: int | None = None
    stream: bool = True
    format: str = "pcm"


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request with its voice resolved: what the engine call needs, nothing left to check."""

    mode: str  # the service mode asked for
    engine_mode: str  # CosyVoice3.synthesize's mode
    text: str  # in the model's form (cross-lingual text carries the system prefix)
    voice_id: str
    voice: Voice
    instruct_text: str  # wrapped instruction ('' outside instruct mode)
    stream: bool
    speed: float
    seed: int | None
    format: AudioFormat


@dataclass(frozen=True)
class _Checked:
    mode: str
    stream: bool
    speed: float
    seed: int | None
    format: AudioFormat
    instruction: str  # wrapped


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


def failure_reason(exc: BaseException) -> str:
    """The metrics label of an error."""
    if isinstance(exc, NotFoundError):
        return "not_found"
    if isinstance(exc, InvalidInputError):
        return "invalid_input"
    if isinstance(exc, ResourceLimitError):
        return "busy"
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


# a sentence ends at .!?;… (then closing quotes/brackets) followed by white space, or at CJK end marks or a
# new line; a trailing "." waits for the next piece, since "3." may continue as "3.14"
_SENTENCE_END = re.compile(r"[.!?;…]+[\"'”’)\]]*\s+|[。！？；]+[”’」』）]*|\n+")


def complete_sentences(pieces: Iterable[str]) -> Iterator[str]:
    """Sentences of text arriving in ``pieces``, each yielded as soon as it is complete (the rest at the end)."""
    buffer = ""
    for piece in pieces:
        if not isinstance(piece, str):
            raise InvalidInputError(f"text pieces must be strings, got {type(piece).__name__}", "text")
        buffer += piece
        while (end := _SENTENCE_END.search(buffer)) is not None:
            sentence, buffer = buffer[:end.end()].strip(), buffer[end.end():]
            if sentence:
                yield sentence
    if buffer.strip():
        yield buffer.strip()


class TextPieces(Iterator[str]):
    """Text pieces handed from one thread (a server's event loop) to the synthesis thread that reads them:
    ``put`` each piece, then ``end()``; ``abort()`` (a cancelled session) ends the reader at once."""

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


class _Admission:
    """At most ``max_active`` holders; ``max_waiting`` more may wait up to ``timeout`` s; the rest are busy."""

    def __init__(self, max_active: int, max_waiting: int, timeout: float) -> None:
        self.max_active, self.max_waiting, self.timeout = max_active, max_waiting, timeout
        self.active = self.waiting = 0
        self._cond = threading.Condition()

    def acquire(self) -> None:
        with self._cond:
            if self.active < self.max_active:
                self.active += 1
                return
            if self.waiting >= self.max_waiting:
                raise ResourceLimitError(f"busy: {self.active} requests are synthesising and {self.waiting} are "
                                         "waiting; retry later")
            self.waiting += 1
            try:
                admitted = self._cond.wait_for(lambda: self.active < self.max_active, self.timeout)
            finally:
                self.waiting -= 1
            if not admitted:
                raise ResourceLimitError(f"busy: no synthesis slot became free within {self.timeout:g} s; "
                                         "retry later")
            self.active += 1

    def release(self) -> None:
        with self._cond:
            self.active -= 1
            self._cond.notify()


class SynthesisSession(Iterator[AudioChunk]):
    """One admitted request's audio. Iterate for :class:`AudioChunk`; ``close()`` (or leaving a ``with``
    block, or dropping it) ends the request, cancels the engine session and frees the slot. ``cancel()``
    may be called from any thread: the engine stops within one LLM step and the reader's iteration ends."""

    def __init__(self, service: TTSService, prepared: PreparedRequest, chunks: Iterator[AudioChunk],
                 started: float, token: CancelToken, on_end: Callable[[], None] | None = None) -> None:
        self.service, self.prepared = service, prepared
        self._token = token  # given to the engine: cancels from any thread
        self._on_end = on_end  # e.g. stop the reader of a text stream
        self.sample_rate = service.sample_rate
        self._chunks = chunks
        self._started = started
        self._first: float | None = None
        self._samples = 0
        self._cancelled = threading.Event()
        self._done = False
        self._lock = threading.Lock()

    @property
    def audio_seconds(self) -> float:
        return self._samples / self.sample_rate

    def __next__(self) -> AudioChunk:
        if self._done:
            raise StopIteration
        if self._cancelled.is_set():
            self._finish("cancelled")
            raise StopIteration
        try:
            chunk = next(self._chunks)
        except StopIteration:
            self._finish("cancelled" if self._cancelled.is_set() else None)
            raise
        except BaseException as exc:
            self._finish(failure_reason(exc))
            with contextlib.suppress(AttributeError):
                exc._outcome_reported = True  # adapters that report errors they catch skip this one
            raise
        if chunk.pcm.numel() and self._first is None:
            self._first = time.perf_counter() - self._started
        self._samples += chunk.pcm.numel()
        return chunk

    def cancel(self) -> None:
        """Thread-safe: the engine stops within one LLM step; a reader blocked in ``next()`` returns."""
        self._cancelled.set()
        self._token.cancel()
        if self._on_end is not None:
            self._on_end()

    def close(self) -> None:
        self._finish("cancelled")

    def __enter__(self) -> SynthesisSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self._finish("cancelled")

    def _finish(self, reason: str | None) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        try:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()  # the engine cancels its session within one decode step
            if self._on_end is not None:
                self._on_end()
        finally:
            self.service._admission.release()
            self.service._report(Outcome(self.prepared.mode, reason, time.perf_counter() - self._started,
                                         self.audio_seconds, self._first))


class AsyncSynthesisSession(AsyncIterator[AudioChunk]):
    """A :class:`SynthesisSession` read from asyncio: a worker thread runs it and hands chunks over through a
    queue of at most ``STREAM_QUEUE_CHUNKS``; ``aclose()`` cancels it (the worker closes the engine session)."""

    def __init__(self, session: SynthesisSession) -> None:
        self.session = session
        self.prepared = session.prepared
        self.sample_rate = session.sample_rate
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._permits = threading.Semaphore(STREAM_QUEUE_CHUNKS)
        self._stopped = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._work, daemon=True, name="cosyvoice-service-stream")
        self._thread.start()

    def _put(self, item: tuple[str, Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is reading any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _work(self) -> None:
        try:
            for chunk in self.session:
                self._permits.acquire()
                if self._stopped.is_set():
                    break
                self._put(("chunk", chunk))
        except BaseException as exc:  # handed to the reader, raised in its task
            self._put(("error", exc))
        finally:
            self.session.close()
            self._put(("end", None))

    async def __anext__(self) -> AudioChunk:
        if self._ended:
            raise StopAsyncIteration
        kind, value = await self._queue.get()
        if kind == "chunk":
            self._permits.release()
            return value
        self._ended = True
        if kind == "error":
            raise value
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel (if still running) without waiting for the worker: the engine stops within one LLM step."""
        if self._stopped.is_set():
            return
        self._ended = True
        self._stopped.set()
        self.session.cancel()
        self._permits.release()  # wakes a worker waiting for room in the queue

    async def wait_closed(self) -> None:
        """Until the worker has closed the engine session (tests, graceful shutdown)."""
        await asyncio.to_thread(self._thread.join)


class TTSService:
    """Owns a :class:`CosyVoice3` and THE :class:`VoiceLibrary`; every adapter calls this."""

    def __init__(self, tts: CosyVoice3, voices: VoiceLibrary | None = None, limits: Limits | None = None) -> None:
        self.tts = tts
        self.voices = voices if voices is not None else tts.voices  # THE library: the official API's saved voices
        self.limits = limits or tts.limits
        self.sample_rate = tts.sample_rate
        self._admission = _Admission(self.limits.max_sessions, self.limits.max_queued_requests,
                                     self.limits.queue_timeout_seconds)
        self._listeners: list[Callable[[Outcome], None]] = []

    @classmethod
    def load(cls, model_dir: str | Path, voice_dir: str | Path, *, device: str | None = None,
             limits: Limits | None = None) -> TTSService:
        """A model folder (or ModelScope id) and a voice folder -> a ready service."""
        limits = limits or Limits.from_env()
        return cls(CosyVoice3(model_dir, device=device, limits=limits, voice_dir=voice_dir), limits=limits)

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

    def status(self) -> ServiceStatus:
        return ServiceStatus(self.tts.model_dir, self.sample_rate, self._admission.active, self._admission.waiting,
                             self._admission.max_active, self._admission.max_waiting, len(self.list_voices()))

    # ------------------------------------------------------------------ synthesis

    def prepare(self, request: SynthesisRequest) -> PreparedRequest:
        """Validate ``request`` and resolve its voice (featurising an uploaded prompt, cached by the library).

        Raises :class:`InvalidInputError` with ``field`` set. Cheap checks come first, so a bad field fails
        before any audio work.
        """
        return self._resolve(request, self._check(request))

    def synthesize(self, request: SynthesisRequest) -> SynthesisSession:
        """Validate, wait for a slot (or raise "busy"), and start: errors in the request raise here, before any
        audio. Iterate the returned session for chunks; close it to cancel."""
        started = time.perf_counter()
        mode = mode_label(request.mode)
        try:
            checked = self._check(request)  # before taking a slot: a bad request never waits
            self._admission.acquire()
        except BaseException as exc:
            self.report_failure(mode, exc, started)
            raise
        token = CancelToken()
        try:
            prepared = self._resolve(request, checked)
            chunks = self.tts.synthesize(prepared.engine_mode, prepared.text, voice=prepared.voice,
                                         instruct_text=prepared.instruct_text, stream=prepared.stream,
                                         speed=prepared.speed, seed=prepared.seed, split_prefixed=True, cancel=token)
        except BaseException as exc:
            self._admission.release()
            self.report_failure(mode, exc, started)
            raise
        return SynthesisSession(self, prepared, chunks, started, token)

    def report_failure(self, mode: str, exc: BaseException, started: float | None = None) -> None:
        """Count a synthesis request that failed before it had a session (adapters call this for errors of
        their own, e.g. an unparsable body); an error the service counted already is not counted again."""
        if getattr(exc, "_outcome_reported", False):
            return
        with contextlib.suppress(AttributeError):  # an exception type that takes no attributes
            exc._outcome_reported = True
        self._report(Outcome(mode, failure_reason(exc), 0.0 if started is None else time.perf_counter() - started))

    async def asynthesize(self, request: SynthesisRequest) -> AsyncSynthesisSession:
        """:meth:`synthesize` for asyncio servers: validation, admission and the first model work run in a
        thread, so the event loop never blocks; errors in the request raise here, before any audio."""
        return AsyncSynthesisSession(await _in_thread(self.synthesize, request))

    def synthesize_text_stream(self, request: SynthesisRequest, pieces: Iterable[str]) -> SynthesisSession:
        """Speak text that arrives in ``pieces`` (e.g. a chat LLM's output, or a :class:`TextPieces` fed by a
        server); ``request.text`` is ignored. Audio starts before the last piece arrives: zero-shot and instruct
        voices use the engine's text-stream input (the reference's bi-streaming: speech tokens follow the text
        tokens as they come); cross-lingual has no such input, so each sentence is synthesised as soon as it is
        complete (chunk indices and sample offsets run across sentences).

        The whole stream holds one slot; its total text is bounded by ``Limits.max_text_chars``. Voice and
        options are validated here, before any audio; a bad piece ends the stream with
        :class:`InvalidInputError` (field ``text``).
        """
        started = time.perf_counter()
        mode = mode_label(request.mode)
        try:
            checked = self._check(request, has_text=False)
            self._admission.acquire()
        except BaseException as exc:
            self.report_failure(mode, exc, started)
            raise
        try:
            prepared = self._resolve(replace(request, text=""), checked)
        except BaseException as exc:
            self._admission.release()
            self.report_failure(mode, exc, started)
            raise
        token = CancelToken()
        try:
            if prepared.engine_mode == "cross_lingual":
                chunks = self._sentence_chunks(prepared, pieces, token)
            else:  # the engine's text-stream input: audio follows the text token by token
                chunks = self.tts.synthesize(prepared.engine_mode, pieces, voice=prepared.voice,
                                             instruct_text=prepared.instruct_text, stream=True, speed=prepared.speed,
                                             seed=prepared.seed, cancel=token)
        except BaseException as exc:
            self._admission.release()
            self.report_failure(mode, exc, started)
            raise
        return SynthesisSession(self, prepared, chunks, started, token, on_end=getattr(pieces, "abort", None))

    async def asynthesize_text_stream(self, request: SynthesisRequest, pieces: TextPieces) -> AsyncSynthesisSession:
        """:meth:`synthesize_text_stream` for asyncio servers; feed ``pieces`` from the event loop."""
        return AsyncSynthesisSession(await _in_thread(self.synthesize_text_stream, request, pieces))

    def _sentence_chunks(self, prepared: PreparedRequest, pieces: Iterable[str],
                         token: CancelToken) -> Iterator[AudioChunk]:
        index = offset = total = 0
        for i, sentence in enumerate(complete_sentences(pieces)):
            total += len(sentence)
            if total > self.limits.max_text_chars:
                raise InvalidInputError(f"the text stream passed {self.limits.max_text_chars} characters "
                                        "(COSYVOICE_MAX_TEXT_CHARS); start a new stream", "text")
            if getattr(pieces, "aborted", False) or token.cancelled:
                return  # cancelled: the text left over is not spoken
            if not any(ch.isalnum() for ch in sentence):
                continue  # punctuation or symbols alone: nothing to speak, and no reason to end the stream
            text = cross_lingual_text(sentence) if prepared.engine_mode == "cross_lingual" else sentence
            seed = None if prepared.seed is None else (prepared.seed + i) % 2**63
            chunks = self.tts.synthesize(prepared.engine_mode, text, voice=prepared.voice,
                                         instruct_text=prepared.instruct_text, stream=prepared.stream,
                                         speed=prepared.speed, seed=seed, split_prefixed=True, cancel=token)
            with contextlib.closing(chunks):
                for chunk in chunks:
                    yield replace(chunk, index=index, sample_offset=offset)
                    index, offset = index + 1, offset + chunk.pcm.numel()

    # ------------------------------------------------------------------ voices
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
        prompt_text = ""
        if isinstance(transcript, str) and user_text(transcript):
            with _field("transcript"):
                self.tts.frontend.check_text(transcript, "transcript")
            prompt_text = zero_shot_prompt_text(transcript)
        try:
            with _field("audio"):  # the library names "name" in its errors about the name
                return self.voices.create(name, audio, prompt_text, owner=owner)
        except ResourceLimitError as exc:
            if isinstance(exc, StorageError):  # the server's disk: not the user's to fix
                raise
            raise InvalidInputError(str(exc), "name") from exc  # a full library is the user's to fix

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
        try:
            with _field("file"):
                return self.voices.import_voice(data, name, owner=owner)
        except ResourceLimitError as exc:
            if isinstance(exc, StorageError):
                raise
            raise InvalidInputError(str(exc), "name") from exc

    def voice_recording(self, key: str, *, owner: str | None = None) -> tuple[int, np.ndarray]:
        """(sample rate, int16 samples) of a voice's prompt recording, for previews."""
        with _field("voice"):
            return self.voices.recording(key, owner=owner)

    # ------------------------------------------------------------------ validation

    def _check(self, request: SynthesisRequest, has_text: bool = True) -> _Checked:
        """Every check that needs no audio work (``has_text=False``: the text arrives later, as a stream)."""
        mode = self._mode(request.mode)
        with _field("text"):
            if has_text:
                self.tts.frontend.check_text(request.text)
        stream, speed, seed = self._options(request)
        with _field("format"):
            fmt = audio_format(request.format)
        return _Checked(mode, stream, speed, seed, fmt, self._instruction(mode, request.instruction))

    def _resolve(self, request: SynthesisRequest, checked: _Checked) -> PreparedRequest:
        """The voice, and with it the engine mode and the text in the model's form."""
        voice_id, voice = self._voice(checked.mode, request)
        if checked.mode == "sft":
            engine_mode = _ENGINE_MODES["zero_shot" if voice.prompt_text.numel() else "cross_lingual"]
        else:
            engine_mode = _ENGINE_MODES[checked.mode]
        text = cross_lingual_text(request.text) if engine_mode == "cross_lingual" else request.text
        return PreparedRequest(checked.mode, engine_mode, text, voice_id, voice, checked.instruction,
                               checked.stream, checked.speed, checked.seed, checked.format)

    @staticmethod
    def _mode(mode: object) -> str:
        label = mode_label(mode)
        if label == "unknown":
            raise InvalidInputError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}", "mode")
        return label

    @staticmethod
    def _options(request: SynthesisRequest) -> tuple[bool, float, int | None]:
        """(stream, speed, seed), checked against the engine's ranges (``Engine.check_options`` is their home)."""
        if not isinstance(request.stream, bool):
            raise InvalidInputError(f"stream must be true or false, got {request.stream!r}", "stream")
        seed = request.seed
        if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
            seed = int(seed)  # numpy integers from adapters
        with _field("seed"):
            Engine.check_options(False, 1.0, seed)
        with _field("speed"):
            speed = Engine.check_options(request.stream, request.speed)
        return request.stream, speed, seed

    def _instruction(self, mode: str, instruction: object) -> str:
        if mode != "instruct":
            return ""
        with _field("instruction"):
            if not isinstance(instruction, str) or not user_text(instruction):
                raise InvalidInputError("instruct mode needs an instruction, e.g. 'Speak slowly and calmly.'")
            self.tts.frontend.check_text(instruction, "instruction")
            return instruct_text(instruction)

    def _voice(self, mode: str, request: SynthesisRequest, owner: str | None = None) -> tuple[str, Voice]:
        """(voice id, voice): a saved voice (looked up now), else the uploaded recording (through the library,
        cached for ``owner``; a full disk only skips the caching)."""
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
        prompt_text = ""
        if mode == "zero_shot":
            with _field("transcript"):
                if not isinstance(request.transcript, str) or not user_text(request.transcript):
                    raise InvalidInputError("zero-shot cloning needs the transcript of the prompt recording; or "
                                            "use cross_lingual mode, which needs none")
                self.tts.frontend.check_text(request.transcript, "transcript")
            prompt_text = zero_shot_prompt_text(request.transcript)
        with _field("prompt_audio"):
            return self.voices.get_or_create(audio, prompt_text, owner=owner)


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a thread of its own (not the loop's small default pool, which requests waiting for a
    slot would exhaust). If the awaiting task is cancelled meanwhile, a session it returns is closed."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if future.cancelled():
            if ok and hasattr(value, "close"):
                value.close()
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            result: tuple[bool, Any] = (True, fn(*args))
        except BaseException as exc:
            result = (False, exc)
        try:
            loop.call_soon_threadsafe(deliver, *result)
        except RuntimeError:  # the loop is closed
            if result[0] and hasattr(result[1], "close"):
                result[1].close()

    threading.Thread(target=run, daemon=True, name="cosyvoice-service-call").start()
    return await future
