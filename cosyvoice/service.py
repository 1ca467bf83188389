"""The service layer: it owns every request, from the adapter's call to the engine's sessions.

Every adapter — the official Python API (:mod:`cosyvoice.cli.cosyvoice`), REST, gRPC, Ray Serve and the web
UI — maps its wire fields onto one :class:`SynthesisRequest` and :class:`~cosyvoice.errors.CosyVoiceError`
back onto its status codes; everything else happens here, once, in one direction (docs/architecture.md):

* validation, at the edge and only here (:mod:`cosyvoice.checks`), with :class:`~cosyvoice.errors.InvalidInputError`
  naming the request field at fault (``field``); code below the service asserts its invariants instead;
* admission (:class:`~cosyvoice.admission.Admission`, the only one): at most ``Limits.max_sessions`` requests
  synthesise and ``Limits.max_queued_requests`` more wait, first come first served, up to
  ``Limits.queue_timeout_seconds``; beyond that "busy" at once, so servers answer 503 instead of piling up.
  Decoding an upload happens inside it;
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
import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from cosyvoice import pipeline
from cosyvoice.admission import Admission
from cosyvoice.checks import allowed_path, check, check_text, field_named
from cosyvoice.engine import CancelToken
from cosyvoice.flow.prompt_cache import FOLDER as PROMPT_CACHE_FOLDER
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.pipeline import Model, TextFeed
from cosyvoice.request import (
    SEED_DRAWS,
    TENSOR_PROMPT_RATE,
    CheckedRequest,
    PreparedRequest,
    SynthesisRequest,
    draw_seed,
    mode_label,
)
from cosyvoice.service_model import ServiceModel
from cosyvoice.service_voices import ServiceVoices
from cosyvoice.sessions import AsyncSynthesisSession, Ending, Outcome, SynthesisSession, failure_reason, pumped
from cosyvoice.settings import Limits, VoicePolicy
from cosyvoice.voices import VoiceLibrary

# the request types and session faces adapters use, importable from the service they call
__all__ = ["SEED_DRAWS", "TENSOR_PROMPT_RATE", "AsyncSynthesisSession", "Outcome", "PreparedRequest", "ServiceStatus",
           "SynthesisRequest", "SynthesisSession", "TTSService", "allowed_path", "check_text", "draw_seed",
           "failure_reason", "mode_label"]

logger = logging.getLogger(__name__)
#: how long a drain waits, after cancelling, for the engine to finish the chunks it was computing for cancelled
#: requests (one Euler step of an utterance's flow, or the vocoder call under way)
SETTLE_SECONDS = 10.0


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


class TTSService(ServiceModel, ServiceVoices):
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
        self._sessions: weakref.WeakSet[Ending] = weakref.WeakSet()  # running requests, for cancel_all
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
        return self._resolve(request, check(request, self.limits, self.default_steps))

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
        return pumped(SynthesisSession(ending, pipeline.run_inputs(self.model, inputs, text_stream=feed.text_ids,
                                                                    **ending.engine_options)), pieces)

    async def asynthesize_text_stream(self, request: SynthesisRequest, pieces: Iterable[str] | None = None, *,
                                      cancel: CancelToken | None = None,
                                      owner: str | None = None) -> AsyncSynthesisSession:
        """:meth:`synthesize_text_stream` for asyncio: write pieces to ``session.writer`` from the event loop."""
        ending = await self._aadmit(request, lambda checked: self._resolve(request, checked, owner, text=False),
                                    cancel, has_text=False)
        feed, p = self._feed(ending), ending.prepared
        inputs = pipeline.astream_inputs(self.model.frontend, p.cond, feed, p.seed, ending.token)
        return pumped(AsyncSynthesisSession(ending, pipeline.arun_inputs(
            self.model, inputs, text_stream=feed.text_ids, **ending.engine_options)), pieces)

    def convert_voice(self, source_audio: AudioSource, prompt_audio: AudioSource, *, stream: bool = False,
                      speed: float = 1.0, cancel: CancelToken | None = None) -> SynthesisSession:
        """Voice conversion: the speech of ``source_audio`` (its speech tokens) in the voice of ``prompt_audio``."""
        request = SynthesisRequest("", "cross_lingual", prompt_audio=prompt_audio, speed=speed, stream=stream,
                                   seed=0)
        source: list[tuple[torch.Tensor, int]] = []

        def resolve(checked: CheckedRequest) -> PreparedRequest:
            with field_named("source_audio"):
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
        ``grace_seconds``, then cancel the rest (each engine session stops within one LLM step); returns once
        :meth:`settle` does."""
        self._admission.close()
        deadline = time.monotonic() + grace_seconds
        while self._admission.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._admission.active:
            logger.warning("shutdown: cancelling %d requests still running after %g s", self._admission.active,
                           grace_seconds)
            self.cancel_all()
        await asyncio.to_thread(self.settle)

    def settle(self, timeout: float = SETTLE_SECONDS) -> None:
        """Wait until the engine computes for nobody (at most ``timeout``; past it, said in the log): a cancelled
        request answers at once, but the engine lets go of it after the chunk it is computing, and a process that
        exits meanwhile can crash in its native libraries' teardown (the Rust bridge server exited with SIGSEGV so)."""
        if not self.model.engine.wait_idle(timeout):
            logger.warning("shutdown: the engine still computes for %d cancelled requests after %g s",
                           self.model.engine.active_sessions, timeout)

    def cancel_all(self) -> None:
        """Cancel every running request, as the service shuts down (thread-safe): their readers' iterations raise
        :class:`~cosyvoice.errors.CancelledByShutdown`: cut-short audio is no answer."""
        for ending in list(self._sessions):
            ending.cancel(shutdown=True)

    # ------------------------------------------------------------------ admission (a sync and an asyncio face)

    def _admit(self, request: SynthesisRequest, resolve: Callable[[CheckedRequest], PreparedRequest],
               cancel: CancelToken | None, has_text: bool = True, job: CancelToken | None = None) -> Ending:
        """Check, take a slot (blocking), resolve: the request's :class:`~cosyvoice.sessions.Ending`, holding its
        slot."""
        started, checked = self._checked(request, has_text)
        with self._failing(checked.mode, started):
            self._admission.acquire(job)
        with self._failing(checked.mode, started, holding=True):
            prepared = resolve(checked)
        return self._ending(prepared, started, cancel)

    async def _aadmit(self, request: SynthesisRequest, resolve: Callable[[CheckedRequest], PreparedRequest],
                      cancel: CancelToken | None, has_text: bool = True) -> Ending:
        """:meth:`_admit` without blocking the event loop: the slot is awaited, and resolving (decoding and
        featurising an upload is CPU work) runs on a worker thread."""
        started, checked = self._checked(request, has_text)
        with self._failing(checked.mode, started):
            await self._admission.aacquire()
        with self._failing(checked.mode, started, holding=True):
            prepared = await asyncio.to_thread(resolve, checked)
        return self._ending(prepared, started, cancel)

    def _checked(self, request: SynthesisRequest, has_text: bool) -> tuple[float, CheckedRequest]:
        """(when the call began, the checked request): every check before taking a slot, so a bad request never
        waits."""
        started = time.perf_counter()
        with self._failing(mode_label(request.mode), started):
            return started, check(request, self.limits, self.default_steps, has_text=has_text)

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

    def _ending(self, prepared: PreparedRequest, started: float, cancel: CancelToken | None) -> Ending:
        """A running request's ending, holding its slot until it ends (:meth:`_ended`)."""
        ending = Ending(prepared, started, cancel or CancelToken(), self.sample_rate, self._ended)
        self._sessions.add(ending)  # running, for cancel_all
        return ending

    def _ended(self, ending: Ending, outcome: Outcome) -> None:
        """A request ended (once): its slot goes back, its outcome is reported."""
        self._sessions.discard(ending)
        self._admission.release()
        self._report(outcome)

    def _feed(self, ending: Ending) -> TextFeed:
        """A text stream's input (closed when the request ends): token by token where the engine has
        bi-streaming, else sentence by sentence."""
        kind = "sentences" if ending.prepared.engine_mode == "cross_lingual" else "tokens"
        ending.feed = TextFeed(self.model.frontend, self.limits.max_text_chars, kind)
        return ending.feed

    def _resolve(self, request: SynthesisRequest, checked: CheckedRequest, owner: str | None = None,
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
