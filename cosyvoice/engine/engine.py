"""The synthesis engine: one object owns the networks and the device; each request is a session.

Shape (docs/architecture.md, "Engine"):

    caller ──synthesize()──▶ Session(state, output queue, cancel flag) ◀── chunks ── Token2WavWorker
                                │ tokens                                            (flow + vocoder,
                                ▲                                                    priority queue)
                          LLMScheduler (one thread, KV slot pool, one batched decode step for all)

No thread per session: the scheduler runs every session's LLM job, the worker every chunk. Closing
the caller's iterator (or leaving an ``async for``) cancels: a flag the scheduler reads between
steps, so the LLM stops within one step. Each session owns all of its state (tokens, chunk policy,
flow/vocoder stream state), and its randomness is its own seeded stream, so concurrent requests
never influence each other — the reference shares its growing hop length across requests
(docs/differences.md). ``strategy="eager"`` keeps the reference's shape (an LLM thread per session,
flow + vocoder in the caller's thread) as the benchmark baseline.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import numbers
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from cosyvoice.config import CosyVoice3Config
from cosyvoice.engine.scheduler import LLMScheduler, Ticket, run_ticket_eager
from cosyvoice.engine.session import AudioChunk, CancelToken, ChunkPolicy, ChunkWork, Session
from cosyvoice.engine.t2w import Token2WavWorker
from cosyvoice.errors import CosyVoiceError, InvalidInputError, ResourceLimitError
from cosyvoice.flow import CausalMaskedDiffWithDiT, FlowStream
from cosyvoice.frontend.frontend import ModelInput
from cosyvoice.hifigan import CausalHiFTGenerator, HiFTStream
from cosyvoice.hifigan.speed import MelTimeScale
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.llm.job import Job, TokenStream
from cosyvoice.llm.model import ENDOFPROMPT_ID
from cosyvoice.settings import SPEED_RANGE, Limits

Strategy = Literal["batched", "eager"]
TEXT_WAIT_SECONDS = 0.1  # an eager text-stream thread re-checks cancellation this often while it waits


class Engine:
    """Owns the three networks on one device and runs sessions on them.

    ``fixed_tokens`` (also per request): decode exactly that many speech tokens (min = max length, stop
    ids masked) so benchmark runs of different engines and seeds do the same work; never for real use.
    """

    def __init__(self, config: CosyVoice3Config, llm: CosyVoice3LM, flow: CausalMaskedDiffWithDiT,
                 hift: CausalHiFTGenerator, device: torch.device, limits: Limits | None = None,
                 endofprompt_id: int = ENDOFPROMPT_ID, incremental_flow: bool = True,
                 incremental_vocoder: bool = True, strategy: Strategy = "batched",
                 fixed_tokens: int | None = None, cuda_graphs: bool = False) -> None:
        if strategy not in ("batched", "eager"):
            raise InvalidInputError(f"strategy must be 'batched' or 'eager', got {strategy!r}")
        self.config = config
        self.llm, self.flow, self.hift = llm.eval(), flow.eval(), hift.eval()
        self.device = device
        if device.type == "cuda":
            # TF32 convolutions move the vocoder's audio by ~1e-2 (golden README §12); docs/differences.md
            torch.backends.cudnn.allow_tf32 = False
        self.limits = limits or Limits.from_env()
        self.sample_rate = config.sample_rate
        self.endofprompt_id = endofprompt_id  # the tokenizer's id of <|endofprompt|>, which the LLM requires
        # False: recompute the flow over the whole utterance per chunk, as the reference (benchmark baseline)
        self.incremental_flow = incremental_flow
        # False: re-run the vocoder over the whole mel cache per chunk, as the reference (benchmark baseline)
        self.incremental_vocoder = incremental_vocoder
        self.strategy = strategy
        self.fixed_tokens = None if fixed_tokens is None else CosyVoice3LM.check_fixed_tokens(fixed_tokens)
        self._slots = threading.BoundedSemaphore(self.limits.max_sessions)
        self._sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._flow_cache_bytes: dict[int, int] = {}  # session id -> bytes its FlowStream holds
        self.flow_cache_fallbacks = 0  # streams switched to recompute by the memory budget
        # cuda_graphs: capture the batched decode step per batch bucket (CUDA only; unverified, docs/perf.md)
        self.scheduler = LLMScheduler(llm, self.limits.max_sessions, self.limits.max_llm_positions,
                                      cuda_graphs=cuda_graphs)
        self.worker = Token2WavWorker(device)
        # an engine dropped without close() must not leave its two threads (and the KV pool) behind
        self._finalizer = weakref.finalize(self, _stop_threads, self.scheduler, self.worker)

    # ------------------------------------------------------------------ public API

    def synthesize(self, inp: ModelInput, stream: bool = False, speed: float = 1.0, seed: int | None = None,
                   sample_offset: int = 0, first_index: int = 0, *, text_stream: TokenStream | None = None,
                   fixed_tokens: int | None = None, cancel: CancelToken | None = None) -> Iterator[AudioChunk]:
        """Speak one text segment. Streaming yields chunks as the policy allows; otherwise one chunk.

        ``text_stream``: the text arrives over time (bi-streaming); ``inp.text`` is then unused.
        Closing the iterator cancels the request; so does ``cancel.cancel()`` from any thread (the LLM stops
        within one step and the iterator ends without a final chunk). Raises :class:`ResourceLimitError` ("busy") when
        ``max_sessions`` requests are running and none finishes within ``queue_timeout_seconds``.
        """
        speed = self.check_options(stream, speed, seed)
        job, needed = self._llm_job(inp, text_stream, fixed_tokens)
        return self._iterate(lambda: self._open_session(inp, stream, speed, seed, sample_offset, first_index),
                             job, needed, text_stream, cancel)

    async def asynthesize(self, inp: ModelInput, stream: bool = False, speed: float = 1.0, seed: int | None = None,
                          sample_offset: int = 0, first_index: int = 0, *, text_stream: TokenStream | None = None,
                          fixed_tokens: int | None = None,
                          cancel: CancelToken | None = None) -> AsyncIterator[AudioChunk]:
        """:meth:`synthesize` for asyncio: ``async for chunk in engine.asynthesize(...)``; leaving the loop (or
        cancelling the task) cancels the request. Waiting for a free session does not block the event loop.
        Options are validated on the first step (an async generator cannot raise earlier); adapters that want
        the error before starting a response call :meth:`check_options` first."""
        speed = self.check_options(stream, speed, seed)
        job, needed = self._llm_job(inp, text_stream, fixed_tokens)

        def open_session() -> Session:
            return self._open_session(inp, stream, speed, seed, sample_offset, first_index)

        if self.strategy == "eager":  # the baseline computes chunks in the consumer's thread
            it = self._iterate(open_session, job, needed, text_stream, None)
            try:
                while (chunk := await asyncio.to_thread(next, it, None)) is not None:
                    yield chunk
            finally:
                await asyncio.to_thread(it.close)
            return
        opening = asyncio.ensure_future(asyncio.to_thread(open_session))
        try:
            session = await asyncio.shield(opening)
        except asyncio.CancelledError:  # the slot may still be granted after we stopped waiting: give it back
            opening.add_done_callback(lambda f: f.cancelled() or f.exception() or self._close(f.result(), wait=False))
            raise
        unsubscribe = cancel.subscribe(lambda: self._cancel(session)) if cancel is not None else None
        try:
            self._start(session, job, needed, text_stream)
            while True:
                item = await session.aget()
                if item is None:
                    return
                chunk = self._unwrap(item)
                yield chunk
                if chunk.final:
                    return
        finally:
            if unsubscribe is not None:
                unsubscribe()
            self._close(session, wait=False)  # released in the background within one step

    def vocode(self, tokens: list[int] | torch.Tensor, inp: ModelInput, stream: bool = False,
               speed: float = 1.0) -> Iterator[AudioChunk]:
        """Speech tokens given by the caller (voice conversion, replay) through the same chunking as
        :meth:`synthesize`; ``inp`` supplies the flow prompt and speaker embedding (its text is unused)."""
        speed = self.check_options(stream, speed)
        ids = torch.as_tensor(tokens).reshape(-1).tolist()
        if any(not 0 <= t < self.config.flow.vocab_size for t in ids):
            raise InvalidInputError(f"speech tokens must be in [0, {self.config.flow.vocab_size})")
        def open_session() -> Session:
            session = self._open_session(inp, stream, speed, 0, 0, 0)
            session.tokens, session.llm_done = ids, True
            return session

        return self._iterate(open_session, None, 0, None, None)

    @staticmethod
    def check_options(stream: bool, speed: float, seed: int | None = None) -> float:
        """Raise :class:`InvalidInputError` for options no session can honour (callers check before any work);
        returns ``speed`` as a float. Any real scalar is a speed: int, float, numpy or one-element torch."""
        lo, hi = SPEED_RANGE
        value = speed
        if (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()) or (
                isinstance(value, np.ndarray) and value.size == 1):
            value = value.item()
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not lo <= float(value) <= hi:
            raise InvalidInputError(f"speed must be between {lo:g} and {hi:g}, got {speed!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
            raise InvalidInputError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        return float(value)

    @property
    def active_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    @property
    def flow_cache_bytes(self) -> int:
        """Bytes all sessions' incremental flow caches hold now (the budget is ``limits.flow_cache_mb``)."""
        with self._lock:
            return sum(self._flow_cache_bytes.values())

    def close(self) -> None:
        """Stop the scheduler and worker threads and free the KV-cache pool (running requests fail)."""
        self._finalizer.detach()
        self.scheduler.close()
        self.worker.close()

    # ------------------------------------------------------------------ sessions

    def _llm_job(self, inp: ModelInput, text_stream: TokenStream | None,
                 fixed_tokens: int | None) -> tuple[Job, int]:
        """(the request's LLM job, KV positions it may need) — validated now."""
        fixed = self.fixed_tokens if fixed_tokens is None else CosyVoice3LM.check_fixed_tokens(fixed_tokens)
        if text_stream is not None:
            from cosyvoice.llm.bistream import bistream_job  # the text-stream algorithm (issue 7)

            # strict=False: a stop id other than eos ends the utterance instead of failing it (docs/differences.md)
            job = bistream_job(self.llm, inp.prompt_text, inp.llm_prompt_speech_token, text_stream,
                               max_len=self.limits.max_llm_positions, endofprompt_id=self.endofprompt_id, strict=False)
            return job, self.limits.max_llm_positions  # its length is unknown: bounded by the row
        lm_input, min_len, max_len = self.llm.prepare(
            inp.text, inp.prompt_text, inp.llm_prompt_speech_token, endofprompt_id=self.endofprompt_id)
        if fixed is not None:
            min_len = max_len = fixed
        needed = lm_input.shape[0] + max(max_len - 1, 0)
        # max_len (20 x text tokens) is a bound that speech rarely nears (~7 x), so a request is refused here only
        # when its prompt cannot fit; one that really runs out of its row ends with a clear error at that step
        if lm_input.shape[0] >= self.limits.max_llm_positions:
            raise ResourceLimitError(
                f"this request's prompt alone needs {lm_input.shape[0]} LLM positions; the engine holds "
                f"{self.limits.max_llm_positions} per session (COSYVOICE_MAX_LLM_POSITIONS): shorten the text")
        return self.llm.generate_job(lm_input, min_len, max_len, ban_stop=fixed is not None), needed

    def _open_session(self, inp: ModelInput, stream: bool, speed: float, seed: int | None, sample_offset: int,
                      first_index: int) -> Session:
        if not self._slots.acquire(timeout=self.limits.queue_timeout_seconds):
            raise ResourceLimitError(
                f"busy: {self.limits.max_sessions} requests are already synthesising and none finished within "
                f"{self.limits.queue_timeout_seconds:g} s; retry later (COSYVOICE_MAX_SESSIONS raises the bound)")
        policy = ChunkPolicy(prompt_len=inp.flow_prompt_speech_token.shape[1],
                             lookahead=self.config.flow.pre_lookahead_len)
        session = Session(id=next(self._ids), seed=secrets.randbits(63) if seed is None else int(seed), inp=inp,
                          stream=stream, speed=speed, policy=policy, sample_offset=sample_offset,
                          next_index=first_index)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def _start(self, session: Session, job: Job | None, needed: int, text_stream: TokenStream | None) -> None:
        """Hand the session's LLM job to the scheduler (or, eager, to a thread of its own)."""
        if job is None:  # vocode(): the tokens are all there
            self._schedule(session)
            return

        def on_tokens(tokens: tuple[int, ...]) -> None:
            session.add_tokens(tokens)
            self._schedule(session)

        def on_done(error: BaseException | None) -> None:
            session.llm_finished(error)
            self._schedule(session)
            self._maybe_release(session)

        ticket = Ticket(job, session.seed, on_tokens, on_done, positions_needed=needed)
        if self.strategy == "eager":
            thread = threading.Thread(target=run_ticket_eager, name=f"cosyvoice-llm-{session.id}", daemon=True,
                                      # a bounded wait: a session closed while it waits for text is noticed
                                      args=(self.llm, ticket, None if text_stream is None else
                                            functools.partial(text_stream.wait, TEXT_WAIT_SECONDS)))
            session.ticket, session.llm_thread = ticket, thread
            thread.start()
            return
        self.scheduler.submit(ticket)
        session.ticket = ticket
        if text_stream is not None:
            session.unsubscribe_text = text_stream.subscribe(lambda: self.scheduler.wake(ticket))

    def _schedule(self, session: Session) -> None:
        """Queue the session's next chunk with the worker if the policy allows one now (batched strategy)."""
        if self.strategy == "eager":
            return  # the consumer computes its own chunks
        with session.cond:
            work = session.take_work()
            first = isinstance(work, ChunkWork) and work.start == 0
            priority = (0.0, 0.0) if first else (1.0, session.deadline())
        if work is None:
            return
        if isinstance(work, BaseException):
            session.put(work)
            return
        self.worker.submit(priority, lambda: self._run_work(session, work))

    def _run_work(self, session: Session, work: ChunkWork) -> None:
        """Worker thread: compute one chunk (unless cancelled), queue it, schedule the next."""
        if session.cancelled:
            with session.cond:
                session.busy = False
        else:
            try:
                session.put(self._compute(session, work))
            except BaseException as exc:
                session.put(_as_cosyvoice_error(exc, "speech synthesis"))
                if session.ticket is not None:
                    self.scheduler.cancel(session.ticket)
            self._schedule(session)
        self._maybe_release(session)

    def _compute(self, session: Session, work: ChunkWork) -> AudioChunk:
        if work.tokens and (work.final or session.stream):
            tokens = torch.tensor([work.tokens], dtype=torch.int64)
            pcm = self.token2wav(session, tokens, session.inp, work.start, streaming=not work.final,
                                 finalize=work.final, speed=session.speed)
        else:
            pcm = torch.zeros(0)  # the LLM stopped at once: nothing to say, but the request still completes
        now = time.perf_counter()
        chunk = AudioChunk(pcm, self.sample_rate, session.next_index, session.sample_offset, work.start, work.stop,
                           work.final, now - (session.last_output or session.started))
        session.next_index += 1
        session.sample_offset += pcm.numel()
        session.last_output = now
        return chunk

    def _maybe_release(self, session: Session) -> None:
        """Free the session's slot and state once the LLM is done with it and no chunk is being computed."""
        with session.cond:
            if session.releasing or not session.llm_done or session.busy:
                return
            if not (session.finished or session.cancelled):
                return
            session.releasing = True
        with self._lock:
            self._sessions.pop(session.id, None)
            self._flow_cache_bytes.pop(session.id, None)
        if session.unsubscribe_text is not None:  # later writes must not wake the scheduler for it
            session.unsubscribe_text()
        session.flow_stream = session.hift_stream = session.mel_cache = session.time_scale = None
        self._slots.release()
        session.released.set()  # last: whoever waits for it finds everything freed

    def _cancel(self, session: Session) -> None:
        """Stop everything working for the session (any thread): the LLM before its next step, queued chunks."""
        session.cancel()
        ticket = session.ticket
        if ticket is None:
            return
        if self.strategy == "batched":
            self.scheduler.cancel(ticket)
        else:
            ticket.cancelled = True  # polled by the eager runner before every step

    def _close(self, session: Session, wait: bool) -> None:
        """Cancel what still runs for the session; free it now or (LLM still stepping) within one step."""
        self._cancel(session)
        if session.ticket is None:  # the LLM never started (vocode(), or a failed start)
            session.llm_finished(None)
        elif session.llm_thread is not None:
            session.llm_thread.join()
        self._maybe_release(session)
        if wait:
            session.released.wait()

    def _unwrap(self, item: AudioChunk | BaseException) -> AudioChunk:
        if isinstance(item, CosyVoiceError):
            raise item
        if isinstance(item, BaseException):
            raise _as_cosyvoice_error(item, "speech token generation") from item
        return item

    def _iterate(self, open_session, job: Job | None, needed: int, text_stream: TokenStream | None,
                 cancel: CancelToken | None) -> Iterator[AudioChunk]:
        if cancel is not None and cancel.cancelled:
            return
        session = open_session()  # on the first next(): an iterator never started holds no slot
        unsubscribe = cancel.subscribe(lambda: self._cancel(session)) if cancel is not None else None
        try:
            self._start(session, job, needed, text_stream)
            while True:
                if self.strategy == "eager":
                    self._compute_next_eager(session)
                item = session.get()
                if item is None:  # cancelled from another thread
                    return
                chunk = self._unwrap(item)
                yield chunk
                if chunk.final:
                    return
        finally:
            if unsubscribe is not None:
                unsubscribe()
            self._close(session, wait=True)

    def _compute_next_eager(self, session: Session) -> None:
        """Baseline: wait for the next chunk's tokens and compute it in the caller's thread."""
        with session.cond:
            session.cond.wait_for(lambda: session.work_ready() or session.cancelled)
            work = session.take_work()
        if work is None:  # cancelled
            return
        if isinstance(work, BaseException):
            session.put(work)
            return
        try:
            session.put(self._compute(session, work))
        except CosyVoiceError as exc:
            session.put(exc)
        except Exception as exc:
            session.put(_as_cosyvoice_error(exc, "speech synthesis"))

    # ------------------------------------------------------------------ token → waveform

    @torch.inference_mode()
    def token2wav(self, session: Session, tokens: torch.Tensor, inp: ModelInput, token_offset: int,
                  streaming: bool, finalize: bool, speed: float = 1.0) -> torch.Tensor:
        """Flow + HiFT for one chunk, as the reference: new mel frames join the session's mel cache and the
        vocoder re-runs over the whole cache; only samples after the previous chunk are returned.

        ``tokens`` [1, T] are all tokens so far. A streaming session's flow calls go through its
        :class:`FlowStream` (given only the new tokens; it reuses the finished chunk-causal chunks instead of
        recomputing the utterance, equal within float rounding, and falls back to recomputing when the
        engine's flow-cache budget is spent), and its vocoder calls through its :class:`HiFTStream`, which
        vocodes a bounded window (the same samples).
        """
        dev = self.device
        if self.incremental_flow and (streaming or session.flow_stream is not None):
            if session.flow_stream is None:
                session.flow_stream = FlowStream(self.flow, inp.flow_prompt_speech_token.to(dev),
                                                 inp.prompt_speech_feat.to(dev), inp.flow_embedding.to(dev))
            self._budget_flow_cache(session, tokens.shape[1])
            mel = session.flow_stream.inference(tokens[:, session.flow_fed:].to(dev), finalize=finalize)
            session.flow_fed = tokens.shape[1]
            with self._lock:
                self._flow_cache_bytes[session.id] = session.flow_stream.cache_bytes
        else:
            prompt_token, prompt_feat = inp.flow_prompt_speech_token.to(dev), inp.prompt_speech_feat.to(dev)
            mel = self.flow.inference(
                token=tokens.to(dev), token_len=tokens.shape[1], prompt_token=prompt_token,
                prompt_token_len=prompt_token.shape[1], prompt_feat=prompt_feat, prompt_feat_len=prompt_feat.shape[1],
                embedding=inp.flow_embedding.to(dev), streaming=streaming, finalize=finalize)
            mel = mel[:, :, token_offset * self.config.flow.token_mel_ratio:]
        if streaming and speed != 1.0 and session.time_scale is None:
            session.time_scale = MelTimeScale(speed)  # streamed speed: each chunk's mel stretched, continuity kept
        if session.time_scale is not None:
            mel = session.time_scale(mel, finalize=finalize)
        if self.incremental_vocoder and (streaming or session.hift_stream is not None):
            if session.hift_stream is None:
                session.hift_stream = HiFTStream(self.hift)
            return session.hift_stream.inference(mel, finalize=finalize)[0].float().cpu()
        session.mel_cache = mel if session.mel_cache is None else torch.cat([session.mel_cache, mel], dim=2)
        full_mel = session.mel_cache
        if speed != 1.0 and session.time_scale is None:
            full_mel = F.interpolate(full_mel, size=int(full_mel.shape[2] / speed), mode="linear")
        speech, _ = self.hift.inference(speech_feat=full_mel, finalize=finalize)
        out = speech[0, session.speech_offset:]
        session.speech_offset += out.shape[0]
        return out.float().cpu()

    def _budget_flow_cache(self, session: Session, n_tokens: int) -> None:
        """Each stream may cache at most ``flow_cache_mb / max_sessions``, so all caches together stay within
        ``limits.flow_cache_mb`` whatever runs at once; a stream that would grow past its share drops its cache
        and recomputes from then on (the reference's path: the same output up to rounding). The share does not
        depend on other sessions, so neither does a session's output."""
        stream = session.flow_stream
        if not stream.caching:
            return
        frames = (stream.prompt_token.shape[1] + n_tokens) * self.config.flow.token_mel_ratio
        if frames * FlowStream.bytes_per_frame(self.flow) > self.flow_cache_share:
            stream.drop_cache()
            self.flow_cache_fallbacks += 1

    @property
    def flow_cache_share(self) -> float:
        """Bytes one stream's incremental flow cache may hold."""
        return self.limits.flow_cache_mb * 2**20 / self.limits.max_sessions


def _stop_threads(scheduler: LLMScheduler, worker: Token2WavWorker) -> None:
    scheduler.stop()
    worker.stop()


def _as_cosyvoice_error(exc: BaseException, stage: str) -> CosyVoiceError:
    """Our error type for an unexpected failure; running out of GPU memory is a resource limit, not a bug."""
    if isinstance(exc, CosyVoiceError):
        return exc
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return ResourceLimitError(f"{stage} ran out of GPU memory; retry with fewer concurrent requests "
                                  "(COSYVOICE_MAX_SESSIONS) or shorter text")
    return CosyVoiceError(f"{stage} failed: {type(exc).__name__}: {exc}")
