"""Token to wave: each session's flow + vocoder state (:class:`T2WState`), the computation of one chunk
(:class:`Token2Wav`), and the worker thread that runs every session's chunks (:class:`Token2WavWorker`).

The worker owns the states: it alone decides when a session's next chunk is due (its chunk policy), computes
it, queues it for the caller and frees the session once nothing works for it any more. Chunk order: first
chunks first (they decide the time to first audio), in arrival order; then the others by their session's
playback deadline (when the client will have played everything it was sent), earliest first. Streaming chunks
due together run their flow step packed into one DiT call (:func:`~cosyvoice.flow.extend_packed`, up to the
worker's ``batch`` sessions). On CUDA the worker runs on a CUDA stream of its own, so its kernels overlap the LLM
scheduler's (default stream). With ``hold_llm`` (the engine's ``first_chunk_priority``) a session's LLM is held
back while its first chunk is computed: the tokens beyond that chunk are not needed yet, and decoding them takes a
core from the chunk that decides the time to first audio (docs/perf.md, 2026-12-06, 06:20).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cosyvoice.config import CosyVoice3Config
from cosyvoice.engine.graphs import CompiledDiT
from cosyvoice.engine.memory import FlowCacheLedger
from cosyvoice.engine.session import AudioChunk, ChunkPolicy, ChunkWork, Session
from cosyvoice.engine.silence import LeadingSilenceTrim
from cosyvoice.errors import CosyVoiceError, ResourceLimitError
from cosyvoice.flow import CausalMaskedDiffWithDiT, FlowStream, PendingExtension, Stopped, extend_packed
from cosyvoice.flow.prompt_cache import PromptCache
from cosyvoice.hifigan import CausalHiFTGenerator, HiFTStream
from cosyvoice.hifigan.speed import MelTimeScale

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class T2WState:
    """One session's token-to-wave state. Only the thread computing its chunks touches it (one at a time)."""

    policy: ChunkPolicy
    next_index: int
    sample_offset: int
    last_output: float  # when the previous chunk (or the request) was made
    audio_seconds: float = 0.0  # audio sent so far: the playback deadline's clock
    finished: bool = False  # the final chunk or an error was sent
    flow_stream: FlowStream | None = None
    hift_stream: HiFTStream | None = None
    time_scale: MelTimeScale | None = None  # streamed at speed != 1: the mel stretch carried across chunks
    mel_cache: torch.Tensor | None = None  # the recompute (reference) vocoder path's whole mel
    speech_offset: int = 0  # samples of the recompute vocoder path already returned
    flow_fed: int = 0  # tokens given to flow_stream so far
    trim: LeadingSilenceTrim | None = None  # the request's leading silence, while it is being trimmed

    @classmethod
    def open(cls, session: Session, lookahead: int, trim_ms: float | None = None,
             sample_rate: int = 0) -> T2WState:
        policy = ChunkPolicy(prompt_len=session.inp.flow_prompt_speech_token.shape[1], lookahead=lookahead,
                             first_hop=session.schedule.first_hop)
        state = cls(policy, session.first_index, session.sample_offset, session.started)
        if trim_ms is not None and session.stream and session.first_index == 0:  # a request's first segment
            state.trim = LeadingSilenceTrim(sample_rate, trim_ms)
        return state

    def due(self, session: Session) -> bool:
        """Whether a chunk (or the LLM's error) can be sent now."""
        if self.finished:
            return False
        n, llm_done, error = session.llm_snapshot()
        return error is not None or llm_done or (session.chunked and self.policy.ready(n))

    def take(self, session: Session) -> ChunkWork | BaseException:
        """The chunk that is due (advancing the policy), or the LLM's error. Only when :meth:`due`."""
        n, llm_done, error = session.llm_snapshot()
        if error is not None:
            return error
        if session.chunked and self.policy.ready(n):
            hop = self.policy.current_hop()
            start, stop = self.policy.advance()
            with session.cond:
                tokens = session.tokens[:start + hop + self.policy.lookahead]
            return ChunkWork(tokens, start, stop, final=False)
        assert llm_done
        with session.cond:
            tokens = session.tokens[:n]
        return ChunkWork(tokens, self.policy.offset, n, final=True)

    def packable(self, session: Session, t2w: Token2Wav) -> bool:
        """Whether the due chunk is a streaming chunk whose flow step can join a packed DiT call."""
        n, _, error = session.llm_snapshot()
        caching = self.flow_stream is None or self.flow_stream.caching
        return session.chunked and error is None and self.policy.ready(n) and t2w.incremental_flow and caching

    def deadline(self, session: Session) -> float:
        """When the client will have played everything sent so far: the next chunk is due by then."""
        return session.started + self.audio_seconds


class Token2Wav:
    """Flow + vocoder for one chunk of one session, on the engine's networks.

    ``incremental_flow`` / ``incremental_vocoder`` False: re-run the flow / vocoder over the whole utterance
    per chunk, as the reference does (the benchmark baseline). ``flow_cache``: which streams may keep their
    incremental flow cache (the engine's memory budget; None: all of them). ``prompt_cache``: streams start from their
    voice's flow prefix, computed once per voice (:mod:`cosyvoice.flow.prompt_cache`).
    """

    def __init__(self, config: CosyVoice3Config, flow: CausalMaskedDiffWithDiT, hift: CausalHiFTGenerator,
                 device: torch.device, incremental_flow: bool = True, incremental_vocoder: bool = True,
                 flow_cache: FlowCacheLedger | None = None, trim_leading_silence_ms: float | None = None,
                 compiled: CompiledDiT | None = None, prompt_cache: PromptCache | None = None) -> None:
        self.config, self.flow, self.hift, self.device = config, flow, hift, device
        self.sample_rate = config.sample_rate
        self.incremental_flow, self.incremental_vocoder = incremental_flow, incremental_vocoder
        self.flow_cache = flow_cache
        self.trim_leading_silence_ms = trim_leading_silence_ms
        self.compiled = compiled  # the packed DiT step compiled per shape bucket (every flow step goes through it)
        self.prompt_cache = prompt_cache

    def open(self, session: Session) -> T2WState:
        """A new session's state."""
        return T2WState.open(session, self.config.flow.pre_lookahead_len, self.trim_leading_silence_ms,
                             self.sample_rate)

    def chunk(self, session: Session, state: T2WState, work: ChunkWork) -> AudioChunk | None:
        """Compute ``work`` and advance ``state``'s offsets (None: the session was cancelled meanwhile)."""
        return self.chunks([(session, state, work)])[0]

    @torch.inference_mode()
    def chunks(self, items: list[tuple[Session, T2WState, ChunkWork]]) -> list[AudioChunk | None]:
        """Compute several sessions' chunks; their incremental flow steps run as ONE packed DiT call per Euler
        step (:func:`~cosyvoice.flow.extend_packed`), the rest (vocoder, recompute paths) one session at a time.
        A session cancelled meanwhile gets None: its own flow call stops before the next Euler step (a packed
        call once every session in it is cancelled), its vocoder does not run (an unstreamed utterance's are
        seconds of the one worker's time that nobody would hear)."""
        for session, state, work in items:
            self._open_flow_stream(session, state, work)
        mels = [self._flow(session, state, work) for session, state, work in items]
        pending = [m for m in mels if isinstance(m, PendingExtension)]
        waiting = [session for (session, _, _), m in zip(items, mels, strict=True) if isinstance(m, PendingExtension)]

        def stop() -> bool:
            return all(session.cancelled for session in waiting)

        try:
            if len(pending) > 1 or (pending and self.compiled is not None):
                compiled = (self.compiled.trunk, self.compiled.buckets) if self.compiled is not None else ()
                solved = iter(extend_packed(pending, *compiled, stop=stop))
            else:
                solved = iter([p.stream.solve(p, stop) for p in pending])
        except Stopped:
            solved = iter([None] * len(pending))
        mels = [next(solved) if isinstance(m, PendingExtension) else m for m in mels]
        return [None if session.cancelled else self._emit(session, state, work, mel)
                for (session, state, work), mel in zip(items, mels, strict=True)]

    def _emit(self, session: Session, state: T2WState, work: ChunkWork, mel: torch.Tensor | None) -> AudioChunk:
        """Vocode a chunk's new mel and advance ``state``'s offsets."""
        # no mel: the LLM stopped at once; nothing to say, but the request still completes
        pcm = torch.zeros(0) if mel is None else self.vocode(state, mel, not work.final, work.final, session.speed)
        if state.trim is not None:  # held back until the first audible sample (may leave this chunk empty)
            pcm = state.trim.push(pcm, work.final)
            state.trim = state.trim if state.trim.waiting else None
        now = time.perf_counter()
        chunk = AudioChunk(pcm, self.sample_rate, state.next_index, state.sample_offset, work.start, work.stop,
                           work.final, now - state.last_output, tuple(work.tokens[work.start:work.stop]))
        state.next_index += 1
        state.sample_offset += pcm.numel()
        state.last_output = now
        state.audio_seconds += pcm.numel() / self.sample_rate
        state.finished = work.final
        return chunk

    def _open_flow_stream(self, session: Session, state: T2WState, work: ChunkWork) -> None:
        """Give a streaming session its :class:`FlowStream` (from the voice's prefix where the prompt cache has
        one) and reserve the flow-cache bytes this chunk grows it to. Run for every chunk of a packed call before
        any of them begins: making room may drop another stream's cache, never one whose step is under way."""
        if not (work.tokens and self.incremental_flow and (self._streaming(session, work) or state.flow_stream)):
            return
        inp, n_tokens = session.inp, len(work.tokens)
        if state.flow_stream is None:
            dev = self.device
            voice = (self.flow, inp.flow_prompt_speech_token.to(dev), inp.prompt_speech_feat.to(dev),
                     inp.flow_embedding.to(dev), session.steps)
            # a stream that starts over its budget recomputes at once: no use for the voice's prefix
            need = self._cache_need(inp.flow_prompt_speech_token.shape[1], n_tokens, session.steps)
            cached = self.prompt_cache is not None and (self.flow_cache is None or self.flow_cache.fits(session.id,
                                                                                                         need))
            state.flow_stream = self.prompt_cache.stream(*voice) if cached else FlowStream(*voice)
        if self.flow_cache is not None:
            stream = state.flow_stream
            self.flow_cache.reserve(session.id, stream,
                                    self._cache_need(stream.prompt_token.shape[1], n_tokens, stream.steps))

    @staticmethod
    def _streaming(session: Session, work: ChunkWork) -> bool:
        """The chunk-causal mask: every chunk but a ``"full"`` final one (the reference's last call)."""
        return not work.final or session.schedule.final == "chunked"

    def _flow(self, session: Session, state: T2WState, work: ChunkWork) -> torch.Tensor | PendingExtension | None:
        """A chunk's new mel frames, or the incremental flow step that computes them (None: no tokens at all, or
        the session was cancelled during its flow call).

        A streaming session's flow calls go through its :class:`FlowStream` (given only the new tokens; it reuses
        the finished chunk-causal chunks instead of recomputing the utterance, equal within float rounding, and
        falls back to recomputing when the flow-cache budget is spent). Otherwise, as the reference: the flow
        over all tokens so far, keeping the frames after the previous chunk. The last call has full attention (the
        reference), or with the ``"chunked"`` final call the chunk-causal mask over the new frames only.
        """
        if not work.tokens:
            return None
        dev, inp = self.device, session.inp
        tokens = torch.tensor([work.tokens], dtype=torch.int64)
        streaming, finalize = self._streaming(session, work), work.final
        if state.flow_stream is not None:
            try:
                step = state.flow_stream.begin(tokens[:, state.flow_fed:].to(dev), finalize=finalize,
                                               streaming=streaming, stop=lambda: session.cancelled)
            except Stopped:
                return None
            state.flow_fed = tokens.shape[1]
            return step
        prompt_token, prompt_feat = inp.flow_prompt_speech_token.to(dev), inp.prompt_speech_feat.to(dev)
        try:
            mel = self.flow.inference(
                token=tokens.to(dev), token_len=tokens.shape[1], prompt_token=prompt_token,
                prompt_token_len=prompt_token.shape[1], prompt_feat=prompt_feat, prompt_feat_len=prompt_feat.shape[1],
                embedding=inp.flow_embedding.to(dev), streaming=streaming, finalize=finalize, n_steps=session.steps,
                stop=lambda: session.cancelled)
        except Stopped:
            return None
        return mel[:, :, work.start * self.config.flow.token_mel_ratio:]

    def vocode(self, state: T2WState, mel: torch.Tensor, streaming: bool, finalize: bool,
               speed: float) -> torch.Tensor:
        """The new mel frames of a chunk -> its new samples (float32 on the CPU). A streaming session's vocoder
        calls go through its :class:`HiFTStream`, which vocodes a bounded window (the same samples); otherwise,
        as the reference: the new frames join the session's mel cache and the vocoder re-runs over all of it."""
        if streaming and speed != 1.0 and state.time_scale is None:
            state.time_scale = MelTimeScale(speed)  # streamed speed: each chunk's mel stretched, continuity kept
        if state.time_scale is not None:
            mel = state.time_scale(mel, finalize=finalize)
        if self.incremental_vocoder and (streaming or state.hift_stream is not None):
            if state.hift_stream is None:
                state.hift_stream = HiFTStream(self.hift)
            return state.hift_stream.inference(mel, finalize=finalize)[0].float().cpu()
        state.mel_cache = mel if state.mel_cache is None else torch.cat([state.mel_cache, mel], dim=2)
        full_mel = state.mel_cache
        if speed != 1.0 and state.time_scale is None:
            full_mel = F.interpolate(full_mel, size=int(full_mel.shape[2] / speed), mode="linear")
        speech, _ = self.hift.inference(speech_feat=full_mel, finalize=finalize)
        out = speech[0, state.speech_offset:]
        state.speech_offset += out.shape[0]
        return out.float().cpu()

    def release(self, session: Session) -> None:
        """``session`` ended: its flow cache's reservation is free."""
        if self.flow_cache is not None:
            self.flow_cache.release(session.id)

    def _cache_need(self, n_prompt_tokens: int, n_tokens: int, steps: int | None) -> int:
        """Bytes a stream's flow cache holds once it has ``n_tokens`` after its prompt's."""
        frames = (n_prompt_tokens + n_tokens) * self.config.flow.token_mel_ratio
        return frames * FlowStream.bytes_per_frame(self.flow, steps=steps)


def as_cosyvoice_error(exc: BaseException, stage: str) -> CosyVoiceError:
    """Our error type for an unexpected failure; running out of GPU memory is a resource limit, not a bug."""
    if isinstance(exc, CosyVoiceError):
        return exc
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return ResourceLimitError(f"{stage} ran out of GPU memory; retry with fewer concurrent requests "
                                  "(COSYVOICE_MAX_SESSIONS) or shorter text")
    return CosyVoiceError(f"{stage} failed: {type(exc).__name__}: {exc}")


class Token2WavWorker:
    """One thread that runs every session's chunks (see the module docstring).

    Streaming chunks that are due together (the most urgent one first) run their flow step as ONE packed DiT
    call per Euler step, up to ``batch`` sessions. ``add(session)`` hands a session over; ``notify(session)``
    says something changed (tokens, the LLM's end, a cancel). ``on_release(session)`` is called from the worker
    once the session is finished or cancelled and its LLM done; ``on_failure(session)`` when a chunk failed (the
    engine stops the session's LLM). ``hold_llm(session, held)``: called with True before a session's first
    streaming chunk is computed and with False once it is done (the engine holds that session's LLM back meanwhile).
    ``threads``: this thread's torch team while the LLM steps; ``wide_threads``: its team for a chunk that starts
    while ``llm_stepping()`` says the LLM has no step to run (its session held for a first chunk, every request
    decoded, a text stream waiting), when the LLM's cores would idle; two torch teams are never wide at once, as
    OpenMP teams that oversubscribe the cores spin against each other (docs/perf.md, "Threads").
    """

    def __init__(self, t2w: Token2Wav, on_release: Callable[[Session], None],
                 on_failure: Callable[[Session], None], batch: int = 8, name: str = "cosyvoice-t2w",
                 threads: int | None = None, hold_llm: Callable[[Session, bool], None] | None = None,
                 wide_threads: int | None = None, llm_stepping: Callable[[], bool] | None = None) -> None:
        self.t2w = t2w
        self.hold_llm = hold_llm  # None: no priority (Engine.first_chunk_priority switches it)
        self.threads = threads  # intra-op threads of this thread's torch calls (None: torch's global setting)
        self.wide_threads, self.llm_stepping = wide_threads, llm_stepping
        self.batch = batch  # most streaming chunks packed into one DiT call (1: one session at a time)
        self.packed_calls = 0  # chunk computations that packed more than one session (tests, benchmarks)
        self.device = t2w.device
        self.name = name
        self._on_release, self._on_failure = on_release, on_failure
        self._cond = threading.Condition()
        self._news: list[Session] = []  # sessions to (re)examine, guarded by _cond
        self._thread: threading.Thread | None = None
        self._stop = False
        self._cache_bytes: dict[int, int] = {}  # session id -> bytes its FlowStream holds, guarded by _cond
        # the worker thread's own
        self._states: dict[Session, T2WState] = {}

    def add(self, session: Session) -> None:
        with self._cond:
            if self._stop:
                raise ResourceLimitError("the engine was shut down (Engine.close()); create a new one")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
        self.notify(session)

    def notify(self, session: Session) -> None:
        with self._cond:
            self._news.append(session)
            self._cond.notify()

    @property
    def flow_cache_bytes(self) -> int:
        with self._cond:
            return sum(self._cache_bytes.values())

    def stop(self) -> None:
        """Ask the thread to end once no session has a chunk due."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    def close(self) -> None:
        """Run what is due, then stop the thread and wait for it."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # ------------------------------------------------------------------ the worker thread

    def _loop(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # this thread's OpenMP team only (docs/perf.md, "Threads")
        # unverified on GPU (no device this session): a side stream so flow/vocoder overlap the LLM's kernels
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            while True:
                self._take_news()
                due = self._due()
                if not due:
                    with self._cond:
                        if self._stop and not self._news:
                            return
                        self._cond.wait_for(lambda: self._news or self._stop)
                    continue
                self._run(due)
                del due  # hold nothing of a finished chunk while asleep

    def _take_news(self) -> None:
        with self._cond:
            news, self._news = self._news, []
        for session in news:
            if session not in self._states and not session.released.is_set():
                self._states[session] = self.t2w.open(session)

    def _due(self) -> list[tuple[Session, T2WState]]:
        """Release the sessions nothing works for any more; the most urgent due chunk, and with it (packing)
        up to ``batch - 1`` other due streaming chunks, most urgent first. Empty: nothing is due."""
        due: list[tuple[tuple[float, float], Session, T2WState]] = []
        for session, state in list(self._states.items()):
            if session.cancelled or state.finished:
                if session.llm_snapshot()[1]:  # the LLM will not touch it again
                    self._release(session)
                continue
            if state.due(session):
                first = state.next_index == session.first_index
                due.append(((0.0, float(session.id)) if first else (1.0, state.deadline(session)), session, state))
        if not due:
            return []
        due.sort(key=lambda d: d[0])
        _, session, state = due[0]
        if self.batch == 1 or not state.packable(session, self.t2w):
            return [(session, state)]
        # one Euler loop per packed call: only sessions of the same step count share it
        return [(s, st) for _, s, st in due if st.packable(s, self.t2w) and s.steps == session.steps][:self.batch]

    def _run(self, due: list[tuple[Session, T2WState]]) -> None:
        """Compute the due chunks and queue them (or the errors that end their sessions)."""
        items = []
        for session, state in due:
            work = state.take(session)
            if isinstance(work, BaseException):
                state.finished = True
                session.put(work)
            else:
                items.append((session, state, work))
        hold = self.hold_llm
        held = [session for session, state, work in items
                if hold is not None and not work.final and state.next_index == session.first_index]
        for session in held:
            hold(session, True)
        self._team()
        try:
            chunks = self.t2w.chunks(items)
        except BaseException as exc:  # the sessions fail, not the worker
            for session, state, _ in items:
                state.finished = True
                session.put(as_cosyvoice_error(exc, "speech synthesis"))
                self._on_failure(session)
            return
        finally:
            for session in held:
                hold(session, False)
            with self._cond:
                for session, state, _ in items:
                    if state.flow_stream is not None:
                        self._cache_bytes[session.id] = state.flow_stream.cache_bytes
        self.packed_calls += len(items) > 1
        for (session, _, _), chunk in zip(items, chunks, strict=True):
            if chunk is not None:
                session.put(chunk)

    def _team(self) -> None:
        """This thread's torch team for the chunk about to run: ``wide_threads`` if the LLM has no step to run now,
        else ``threads`` (a chunk keeps its team to its end)."""
        if self.threads is None:
            return
        idle = self.wide_threads is not None and self.llm_stepping is not None and not self.llm_stepping()
        team = self.wide_threads if idle else self.threads
        if torch.get_num_threads() != team:
            torch.set_num_threads(team)

    def _release(self, session: Session) -> None:
        state = self._states.pop(session)
        state.flow_stream = state.hift_stream = state.mel_cache = state.time_scale = None
        self.t2w.release(session)
        with self._cond:
            self._cache_bytes.pop(session.id, None)
        try:
            self._on_release(session)
        except Exception:  # a listener's bug must not stop the worker
            logger.exception("releasing a session failed")
        session.released.set()  # last: whoever waits for it finds everything freed
