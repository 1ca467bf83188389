"""The synthesis engine: one object owns the networks and the device; each request is a session.

Shape (docs/architecture.md, "Engine"):

    caller ──synthesize()──▶ Session(tokens, output queue, cancel) ◀── chunks ── Token2WavWorker
                                │ tokens                                 (owns each session's T2WState:
                                ▲                                         chunk policy, flow/vocoder state)
                          LLMScheduler (one thread: schedule → LLMRunner.execute → update)

No thread per session and none per call: the scheduler runs every session's LLM job, the worker every chunk,
and opening a session only queues it (sessions beyond the scheduler's rows wait there for a row; the service
is the only admission). Cancelling — the caller's :class:`CancelToken`, closing the iterator, leaving an
``async for`` — sets the session's token, which the scheduler reads between steps (the LLM stops within one
step) and the worker before each chunk. A session's randomness is its own seeded stream and its chunk policy
its own, so concurrent requests never influence each other — the reference shares its growing hop length
across requests (docs/differences.md). The reference's one-thread-per-request strategy lives in
``benchmarks/reference_engine.py``, the benchmark's baseline.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator

import torch

from cosyvoice.config import CosyVoice3Config
from cosyvoice.engine.graphs import CompiledDiT
from cosyvoice.engine.memory import FlowCacheLedger, default_flow_cache_mb, free_memory_bytes
from cosyvoice.engine.plan import Ticket
from cosyvoice.engine.scheduler import LLMScheduler
from cosyvoice.engine.session import AudioChunk, CancelToken, ChunkSchedule, Session
from cosyvoice.engine.t2w import Token2Wav, Token2WavWorker, as_cosyvoice_error
from cosyvoice.errors import CosyVoiceError, ResourceLimitError
from cosyvoice.flow import CausalMaskedDiffWithDiT
from cosyvoice.flow.prompt_cache import PromptCache
from cosyvoice.frontend.frontend import ModelInput
from cosyvoice.hifigan import CausalHiFTGenerator
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.llm.job import Job, TokenStream
from cosyvoice.settings import FLOW_STEPS_RANGE, SPEED_RANGE, Limits


def llm_job(llm: CosyVoice3LM, inp: ModelInput, limits: Limits, text_stream: TokenStream | None,
            fixed_tokens: int | None) -> tuple[Job, int]:
    """(the request's LLM job, KV positions it may need). ``fixed_tokens``: decode exactly that many tokens."""
    if text_stream is not None:
        from cosyvoice.llm.bistream import bistream_job  # the text-stream algorithm (issue 7)

        # strict=False: a stop id other than eos ends the utterance instead of failing it (docs/differences.md)
        job = bistream_job(llm, inp.prompt_text, inp.llm_prompt_speech_token, text_stream,
                           max_len=limits.max_llm_positions, strict=False)
        return job, limits.max_llm_positions  # its length is unknown: bounded by the row
    lm_input, min_len, max_len = llm.prepare(inp.text, inp.prompt_text, inp.llm_prompt_speech_token)
    if fixed_tokens is not None:
        min_len = max_len = fixed_tokens
    # max_len (20 x text tokens) is a bound that speech rarely nears (~7 x), so a request is refused here only
    # when its prompt cannot fit; one that really runs out of its row ends with a clear error at that step
    if lm_input.shape[0] >= limits.max_llm_positions:
        raise ResourceLimitError(
            f"this request's prompt alone needs {lm_input.shape[0]} LLM positions; the engine holds "
            f"{limits.max_llm_positions} per session (COSYVOICE_MAX_LLM_POSITIONS): shorten the text")
    return llm.generate_job(lm_input, min_len, max_len, ban_stop=fixed_tokens is not None), \
        lm_input.shape[0] + max(max_len - 1, 0)


def stage_threads(cores: int) -> tuple[int, int]:
    """(LLM, token-to-wave) torch intra-op threads for ``cores`` CPU threads while both stages run: together they
    must not ask for more threads than there are cores (OpenMP teams that oversubscribe spin against each other);
    measured on two cores in docs/perf.md, "Threads". The worker's team takes every core for a chunk that starts
    while the LLM has no step to run (:class:`~cosyvoice.engine.t2w.Token2WavWorker`), and onnxruntime's
    token-to-wave sessions, whose pools never spin, always have every core
    (:func:`~cosyvoice.backends.ort.cpu_stage_threads`)."""
    if cores <= 1:
        return 1, 1
    llm = cores // 2
    return llm, cores - llm


class Engine:
    """Owns the three networks on one device and runs sessions on them.

    ``fixed_tokens`` (also per request): decode exactly that many speech tokens (min = max length, stop
    ids masked) so benchmark runs of different engines and seeds do the same work; never for real use.
    ``incremental_flow`` / ``incremental_vocoder`` False: the reference's recompute per chunk (benchmarks).
    ``cuda_graphs``: capture the batched decode step per batch bucket (CUDA only; unverified, docs/perf.md).
    ``t2w_batch``: most sessions' streaming chunks whose DiT steps run packed in one call (1: one at a time).
    Packing moves a session's mel by float rounding (<= 1e-5) depending on what runs beside it, so by default
    it is on (8) only on CUDA, where one launch-bound call for many sessions is the point; on the CPU (compute
    bound, little to gain) a session's audio stays bit-identical whatever else runs.
    ``trim_leading_silence_ms``: streamed requests (their first segment) send their leading silence only from this
    many milliseconds before the first audible sample (:mod:`cosyvoice.engine.silence`); None: off.
    ``compile_dit``: every incremental flow step runs the DiT compiled per shape bucket (:mod:`.graphs`; CUDA:
    in CUDA graphs); a string names the ``torch.compile`` backend (default inductor).
    ``threads``: (LLM scheduler, token-to-wave worker) intra-op threads on a CPU, each set in its own thread
    (torch's thread count is per calling thread); None: :func:`stage_threads` of torch's count at construction.
    The worker's is its team while the LLM steps: a chunk begun while the LLM has no step runs on torch's count.
    ``prompt_cache``: streams start from their voice's flow prefix, computed once per voice and step count
    (:mod:`cosyvoice.flow.prompt_cache`; True: in memory within ``limits.prompt_cache_mb``; a
    :class:`PromptCache` may also persist them). The same mel up to float rounding (<= 1e-5); off by default here
    (the parity tool compares the engine's streamed mel with the reference's), on in :meth:`Model.load`.
    ``first_chunk_priority`` (None: ``limits.first_chunk_priority``, which unset means on a CPU, off on a GPU;
    switchable between requests): a session's LLM is held back while its first streaming chunk is computed, so
    that chunk has the cores to itself: the worker's team and onnxruntime's DiT then run on every core. Tokens are
    the same either way, and so is the audio (bit-equal in the tests; a torch kernel that split its sums by the
    team's size would move it by float rounding). Measured on two CPU cores (docs/perf.md, 2026-12-06, 12:20):
    first audio 6.4 -> 4.9 s quiet, at the same RTF (before the DiT took both cores, a quiet machine's first audio
    did not move and the RTF was 5 % worse: the section of 06:20).
    ``steps`` (per request; None: the yaml's ``n_timesteps``): the flow's Euler steps. ``schedule`` (per request;
    None: the reference's): the first hop and the last flow call (:class:`~cosyvoice.engine.session.ChunkSchedule`).
    """

    def __init__(self, config: CosyVoice3Config, llm: CosyVoice3LM, flow: CausalMaskedDiffWithDiT,
                 hift: CausalHiFTGenerator, device: torch.device, limits: Limits | None = None,
                 incremental_flow: bool = True,
                 incremental_vocoder: bool = True, fixed_tokens: int | None = None, cuda_graphs: bool = False,
                 t2w_batch: int | None = None, trim_leading_silence_ms: float | None = None,
                 compile_dit: bool | str = False, threads: tuple[int, int] | None = None,
                 prompt_cache: PromptCache | bool = False, first_chunk_priority: bool | None = None) -> None:
        self.config = config
        self.llm, self.flow, self.hift = llm.eval(), flow.eval(), hift.eval()
        self.device = device
        if device.type == "cuda":
            # TF32 convolutions move the vocoder's audio by ~1e-2 (golden README §12); docs/differences.md
            torch.backends.cudnn.allow_tf32 = False
        self.limits = limits or Limits.from_env()
        # all flow caches' budget in MiB, fixed at the start (a share of the device's free memory unless set)
        self.flow_cache_mb = self.limits.flow_cache_mb if self.limits.flow_cache_mb is not None \
            else default_flow_cache_mb(free_memory_bytes(device))
        self.sample_rate = config.sample_rate
        self.fixed_tokens = None if fixed_tokens is None else CosyVoice3LM.check_fixed_tokens(fixed_tokens)
        self._ids = itertools.count()
        compiled = CompiledDiT(device, compile_dit if isinstance(compile_dit, str) else "inductor") \
            if compile_dit else None
        if prompt_cache is True:
            prompt_cache = PromptCache(int(self.limits.prompt_cache_mb * 2**20))
        self.prompt_cache = prompt_cache or None
        self.t2w = Token2Wav(config, self.flow, self.hift, device, incremental_flow, incremental_vocoder,
                             FlowCacheLedger(self.flow_cache_mb * 2**20, self.flow_cache_share),
                             trim_leading_silence_ms, compiled, self.prompt_cache)
        self.threads = (threads or stage_threads(torch.get_num_threads())) if device.type == "cpu" else (None, None)
        self.scheduler = LLMScheduler(llm, self.limits.max_sessions, self.limits.max_llm_positions,
                                      cuda_graphs=cuda_graphs, threads=self.threads[0])
        self._open_sessions = _Registry(self.scheduler)  # the worker's callbacks must not hold the engine
        self._sessions = self._open_sessions.sessions
        self.worker = Token2WavWorker(self.t2w, on_release=self._open_sessions.release,
                                      on_failure=self._open_sessions.stop_llm,
                                      batch=t2w_batch or (8 if device.type == "cuda" else 1),
                                      threads=self.threads[1], llm_stepping=self.scheduler.stepping,
                                      wide_threads=torch.get_num_threads() if device.type == "cpu" else None)
        if first_chunk_priority is None:
            first_chunk_priority = self.limits.first_chunk_priority
        self.first_chunk_priority = device.type == "cpu" if first_chunk_priority is None else first_chunk_priority
        # an engine dropped without close() must not leave its two threads (and the KV pool) behind
        self._finalizer = weakref.finalize(self, _stop_threads, self.scheduler, self.worker)

    # ------------------------------------------------------------------ public API

    def synthesize(self, inp: ModelInput, stream: bool = False, speed: float = 1.0, seed: int | None = 0,
                   sample_offset: int = 0, first_index: int = 0, *, text_stream: TokenStream | None = None,
                   fixed_tokens: int | None = None, cancel: CancelToken | None = None,
                   steps: int | None = None, schedule: ChunkSchedule | None = None) -> Iterator[AudioChunk]:
        """Speak one text segment. Streaming yields chunks as the policy allows; otherwise one chunk.

        ``text_stream``: the text arrives over time (bi-streaming); ``inp.text`` is then unused. Inputs arrive
        validated (the service's job). Nothing runs before the first ``next()``. Closing the iterator cancels
        the request and returns once the engine has freed it; ``cancel.cancel()`` from any thread ends the
        iterator at once, without a final chunk (the LLM stops within one step; the worker frees the session when
        the chunk it may be computing ends: a whole utterance's, delivered unstreamed, takes seconds).
        """
        job = self._job(inp, text_stream, fixed_tokens)
        return self._iterate(lambda: self._open(inp, stream, speed, seed, sample_offset, first_index, cancel,
                                                job, text_stream, steps=steps, schedule=schedule), cancel)

    async def asynthesize(self, inp: ModelInput, stream: bool = False, speed: float = 1.0, seed: int | None = 0,
                          sample_offset: int = 0, first_index: int = 0, *, text_stream: TokenStream | None = None,
                          fixed_tokens: int | None = None, cancel: CancelToken | None = None,
                          steps: int | None = None, schedule: ChunkSchedule | None = None) -> AsyncIterator[AudioChunk]:
        """:meth:`synthesize` for asyncio: ``async for chunk in engine.asynthesize(...)``, no thread involved;
        leaving the loop (or cancelling the task) cancels the request, as does ``cancel``."""
        if cancel is not None and cancel.cancelled:
            return
        job = self._job(inp, text_stream, fixed_tokens)
        session = self._open(inp, stream, speed, seed, sample_offset, first_index, cancel, job, text_stream,
                             steps=steps, schedule=schedule)
        try:
            while (item := await session.aget()) is not None:
                chunk = _unwrap(item)
                yield chunk
                if chunk.final:
                    return
        finally:
            self._close(session, wait=False)  # released by the worker within one step

    def vocode(self, tokens: list[int] | torch.Tensor, inp: ModelInput, stream: bool = False, speed: float = 1.0,
               *, cancel: CancelToken | None = None, steps: int | None = None) -> Iterator[AudioChunk]:
        """Speech tokens given by the caller (voice conversion, replay) through the same chunking as
        :meth:`synthesize`; ``inp`` supplies the flow prompt and speaker embedding (its text is unused)."""
        ids = torch.as_tensor(tokens).reshape(-1).tolist()
        assert all(0 <= t < self.config.flow.vocab_size for t in ids), "speech token ids out of range"
        return self._iterate(lambda: self._open(inp, stream, speed, 0, 0, 0, cancel, None, None, tokens=ids,
                                                steps=steps), cancel)

    @property
    def default_steps(self) -> int:
        """The flow's Euler steps when a request names none (the yaml's ``n_timesteps``)."""
        return self.config.flow.cfm.n_timesteps

    @property
    def first_chunk_priority(self) -> bool:
        """Whether a session's LLM is held back while its first chunk is computed (see the class docstring)."""
        return self.worker.hold_llm is not None

    @first_chunk_priority.setter
    def first_chunk_priority(self, on: bool) -> None:
        self.worker.hold_llm = self._open_sessions.hold_llm if on else None

    @property
    def active_sessions(self) -> int:
        return self._open_sessions.count

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the engine holds no session: a cancelled one is released when the chunk it was computing
        ends. False if some still is after ``timeout`` seconds."""
        return self._open_sessions.wait_empty(timeout)

    @property
    def flow_cache_bytes(self) -> int:
        """Bytes all sessions' incremental flow caches hold now (the budget is :attr:`flow_cache_mb`)."""
        return self.worker.flow_cache_bytes

    @property
    def flow_cache_fallbacks(self) -> int:
        """Streams switched from their flow cache to recomputing by the memory budget, since the start."""
        return self.t2w.flow_cache.fallbacks

    @property
    def flow_cache_share(self) -> float:
        """Bytes one stream's incremental flow cache is sure of: ``flow_cache_mb / max_sessions``, so every
        session can have its share at once; a stream borrows beyond it what the others leave of
        :attr:`flow_cache_mb` (:class:`~cosyvoice.engine.memory.FlowCacheLedger`)."""
        return self.flow_cache_mb * 2**20 / self.limits.max_sessions

    def close(self) -> None:
        """Stop the scheduler and worker threads and free the KV-cache pool (running requests fail)."""
        self._finalizer.detach()
        self.scheduler.close()
        self.worker.close()
        if self.prompt_cache is not None:
            self.prompt_cache.close()

    # ------------------------------------------------------------------ sessions

    def _job(self, inp: ModelInput, text_stream: TokenStream | None, fixed_tokens: int | None) -> Job:
        fixed = self.fixed_tokens if fixed_tokens is None else CosyVoice3LM.check_fixed_tokens(fixed_tokens)
        return llm_job(self.llm, inp, self.limits, text_stream, fixed)[0]

    def _open(self, inp: ModelInput, stream: bool, speed: float, seed: int | None, sample_offset: int,
              first_index: int, cancel: CancelToken | None, job: Job | None, text_stream: TokenStream | None,
              tokens: list[int] | None = None, steps: int | None = None,
              schedule: ChunkSchedule | None = None) -> Session:
        """Register a session and hand it to the scheduler (its LLM job) and the worker; returns at once."""
        lo, hi = SPEED_RANGE
        assert lo <= speed <= hi and (seed is None or 0 <= seed < 2**63), "options are validated by the service"
        steps = self.default_steps if steps is None else steps
        assert FLOW_STEPS_RANGE[0] <= steps <= FLOW_STEPS_RANGE[1], "options are validated by the service"
        session = Session(id=next(self._ids), seed=secrets.randbits(63) if seed is None else int(seed), inp=inp,
                          stream=stream, speed=float(speed), steps=int(steps), sample_offset=sample_offset,
                          first_index=first_index, schedule=schedule or ChunkSchedule())
        cleanups = self._open_sessions.add(session)
        if job is None:  # vocode(): the caller is the "LLM"; its tokens are all there
            session.add_tokens(tuple(tokens or ()))
            session.llm_finished(None)
        else:
            ticket = Ticket(job, session.seed, lambda ts: self._on_tokens(session, ts),
                            lambda error: self._on_llm_done(session, error))
            with self._open_sessions.lock:
                self._open_sessions.tickets[session.id] = ticket
            if text_stream is not None:  # before submit: a release can only follow
                cleanups.append(text_stream.subscribe(lambda: self.scheduler.wake(ticket)))
            try:
                self.scheduler.submit(ticket)
            except BaseException:
                self._open_sessions.release(session)
                raise
        session.cancel.subscribe(lambda: self._on_cancel(session))
        if cancel is not None:
            cleanups.append(cancel.subscribe(session.cancel.cancel))
        self.worker.add(session)
        return session

    def _on_tokens(self, session: Session, tokens: tuple[int, ...]) -> None:
        session.add_tokens(tokens)
        self.worker.notify(session)

    def _on_llm_done(self, session: Session, error: BaseException | None) -> None:
        session.llm_finished(error)
        self.worker.notify(session)

    def _on_cancel(self, session: Session) -> None:
        """The session's token was cancelled (any thread): stop its LLM, tell the worker, wake its reader."""
        self._open_sessions.stop_llm(session)
        self.worker.notify(session)
        session.wake_reader()

    def _close(self, session: Session, wait: bool) -> None:
        """Cancel what still runs for the session (nothing, if it finished); with ``wait``, until it is freed."""
        session.cancel.cancel()
        if wait:
            session.released.wait()

    def _iterate(self, open_session: Callable[[], Session], cancel: CancelToken | None) -> Iterator[AudioChunk]:
        if cancel is not None and cancel.cancelled:
            return
        session = open_session()  # on the first next(): an iterator never started starts nothing
        woken = False
        try:
            while (item := session.get()) is not None:
                chunk = _unwrap(item)
                yield chunk
                if chunk.final:
                    return
            woken = True  # None: cancelled from another thread
        finally:
            # whoever ends the iteration (close, an error, the last chunk) holds nothing once it returns; a reader
            # woken by a cancel from elsewhere answers at once (a server draining answers within its grace)
            self._close(session, wait=not woken)


class _Registry:
    """The open sessions, their LLM tickets and what each one's release undoes (caller adds, worker releases)."""

    def __init__(self, scheduler: LLMScheduler) -> None:
        self.scheduler = scheduler
        self.lock = threading.Condition()  # notified when a session is released
        self.sessions: dict[int, Session] = {}
        self.tickets: dict[int, Ticket] = {}  # set by the caller before its ticket is submitted
        self.cleanups: dict[int, list[Callable[[], None]]] = {}

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.sessions)

    def add(self, session: Session) -> list[Callable[[], None]]:
        cleanups: list[Callable[[], None]] = []
        with self.lock:
            self.sessions[session.id] = session
            self.cleanups[session.id] = cleanups
        return cleanups

    def stop_llm(self, session: Session) -> None:
        with self.lock:
            ticket = self.tickets.get(session.id)
        if ticket is not None:
            self.scheduler.cancel(ticket)

    def hold_llm(self, session: Session, held: bool) -> None:
        """Hold the session's LLM back (or release it) while the worker computes its first chunk."""
        with self.lock:
            ticket = self.tickets.get(session.id)
        if ticket is not None:
            self.scheduler.hold(ticket, held)

    def wait_empty(self, timeout: float) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: not self.sessions, timeout)

    def release(self, session: Session) -> None:
        """The worker let the session go: forget it and undo its subscriptions."""
        with self.lock:
            self.sessions.pop(session.id, None)
            self.tickets.pop(session.id, None)
            cleanups = self.cleanups.pop(session.id, [])
            self.lock.notify_all()
        for undo in cleanups:
            undo()


def _unwrap(item: AudioChunk | BaseException) -> AudioChunk:
    if isinstance(item, CosyVoiceError):
        raise item
    if isinstance(item, BaseException):
        raise as_cosyvoice_error(item, "speech token generation") from item
    return item


def _stop_threads(scheduler: LLMScheduler, worker: Token2WavWorker) -> None:
    """Stop AND join: run at interpreter exit, a thread merely told to stop would wake during finalisation, where
    Python ends it inside torch's C++ frames and the process aborts ("terminate called without an active
    exception")."""
    scheduler.close()
    worker.close()
