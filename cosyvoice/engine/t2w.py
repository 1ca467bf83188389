"""Token to wave: each session's flow + vocoder state (:class:`T2WState`), the computation of one chunk
(:class:`Token2Wav`), and the worker thread that runs every session's chunks (:class:`Token2WavWorker`).

The worker owns the states: it alone decides when a session's next chunk is due (its chunk policy), computes
it, queues it for the caller and frees the session once nothing works for it any more. Chunk order: first
chunks first (they decide the time to first audio), in arrival order; then the others by their session's
playback deadline (when the client will have played everything it was sent), earliest first. On CUDA the
worker runs on a CUDA stream of its own, so its kernels overlap the LLM scheduler's (default stream).
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
from cosyvoice.engine.session import AudioChunk, ChunkPolicy, ChunkWork, Session
from cosyvoice.errors import CosyVoiceError, ResourceLimitError
from cosyvoice.flow import CausalMaskedDiffWithDiT, FlowStream
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

    @classmethod
    def open(cls, session: Session, lookahead: int) -> T2WState:
        policy = ChunkPolicy(prompt_len=session.inp.flow_prompt_speech_token.shape[1], lookahead=lookahead)
        return cls(policy, session.first_index, session.sample_offset, session.started)

    def due(self, session: Session) -> bool:
        """Whether a chunk (or the LLM's error) can be sent now."""
        if self.finished:
            return False
        n, llm_done, error = session.llm_snapshot()
        return error is not None or llm_done or (session.stream and self.policy.ready(n))

    def take(self, session: Session) -> ChunkWork | BaseException:
        """The chunk that is due (advancing the policy), or the LLM's error. Only when :meth:`due`."""
        n, llm_done, error = session.llm_snapshot()
        if error is not None:
            return error
        if session.stream and self.policy.ready(n):
            hop = self.policy.current_hop()
            start, stop = self.policy.advance()
            with session.cond:
                tokens = session.tokens[:start + hop + self.policy.lookahead]
            return ChunkWork(tokens, start, stop, final=False)
        assert llm_done
        with session.cond:
            tokens = session.tokens[:n]
        return ChunkWork(tokens, self.policy.offset, n, final=True)

    def deadline(self, session: Session) -> float:
        """When the client will have played everything sent so far: the next chunk is due by then."""
        return session.started + self.audio_seconds


class Token2Wav:
    """Flow + vocoder for one chunk of one session, on the engine's networks.

    ``incremental_flow`` / ``incremental_vocoder`` False: re-run the flow / vocoder over the whole utterance
    per chunk, as the reference does (the benchmark baseline). ``flow_cache_share``: bytes one stream's
    incremental flow cache may hold (the engine's memory budget).
    """

    def __init__(self, config: CosyVoice3Config, flow: CausalMaskedDiffWithDiT, hift: CausalHiFTGenerator,
                 device: torch.device, incremental_flow: bool = True, incremental_vocoder: bool = True,
                 flow_cache_share: float = float("inf")) -> None:
        self.config, self.flow, self.hift, self.device = config, flow, hift, device
        self.sample_rate = config.sample_rate
        self.incremental_flow, self.incremental_vocoder = incremental_flow, incremental_vocoder
        self.flow_cache_share = flow_cache_share
        self.fallbacks = 0  # streams switched to recompute by the memory budget

    def chunk(self, session: Session, state: T2WState, work: ChunkWork) -> AudioChunk:
        """Compute ``work`` and advance ``state``'s offsets."""
        if work.tokens:
            pcm = self.pcm(session, state, torch.tensor([work.tokens], dtype=torch.int64), work.start,
                           streaming=not work.final, finalize=work.final)
        else:
            pcm = torch.zeros(0)  # the LLM stopped at once: nothing to say, but the request still completes
        now = time.perf_counter()
        chunk = AudioChunk(pcm, self.sample_rate, state.next_index, state.sample_offset, work.start, work.stop,
                           work.final, now - state.last_output)
        state.next_index += 1
        state.sample_offset += pcm.numel()
        state.last_output = now
        state.audio_seconds += pcm.numel() / self.sample_rate
        state.finished = work.final
        return chunk

    @torch.inference_mode()
    def pcm(self, session: Session, state: T2WState, tokens: torch.Tensor, token_offset: int, streaming: bool,
            finalize: bool) -> torch.Tensor:
        """Flow + HiFT for one chunk; only samples after the previous chunk are returned.

        ``tokens`` [1, T] are all tokens so far. A streaming session's flow calls go through its
        :class:`FlowStream` (given only the new tokens; it reuses the finished chunk-causal chunks instead of
        recomputing the utterance, equal within float rounding, and falls back to recomputing when the
        flow-cache budget is spent), and its vocoder calls through its :class:`HiFTStream`, which vocodes a
        bounded window (the same samples). Otherwise, as the reference: new mel frames join the session's
        mel cache and the vocoder re-runs over the whole cache.
        """
        dev, inp, speed = self.device, session.inp, session.speed
        if self.incremental_flow and (streaming or state.flow_stream is not None):
            if state.flow_stream is None:
                state.flow_stream = FlowStream(self.flow, inp.flow_prompt_speech_token.to(dev),
                                               inp.prompt_speech_feat.to(dev), inp.flow_embedding.to(dev))
            self._budget_flow_cache(state.flow_stream, tokens.shape[1])
            mel = state.flow_stream.inference(tokens[:, state.flow_fed:].to(dev), finalize=finalize)
            state.flow_fed = tokens.shape[1]
        else:
            prompt_token, prompt_feat = inp.flow_prompt_speech_token.to(dev), inp.prompt_speech_feat.to(dev)
            mel = self.flow.inference(
                token=tokens.to(dev), token_len=tokens.shape[1], prompt_token=prompt_token,
                prompt_token_len=prompt_token.shape[1], prompt_feat=prompt_feat, prompt_feat_len=prompt_feat.shape[1],
                embedding=inp.flow_embedding.to(dev), streaming=streaming, finalize=finalize)
            mel = mel[:, :, token_offset * self.config.flow.token_mel_ratio:]
        return self.vocode(state, mel, streaming, finalize, speed)

    def vocode(self, state: T2WState, mel: torch.Tensor, streaming: bool, finalize: bool,
               speed: float) -> torch.Tensor:
        """The new mel frames of a chunk -> its new samples (float32 on the CPU)."""
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

    def _budget_flow_cache(self, stream: FlowStream, n_tokens: int) -> None:
        """A stream that would grow past its share drops its cache and recomputes from then on (the reference's
        path: the same output up to rounding). The share does not depend on other sessions, so neither does a
        session's output."""
        if not stream.caching:
            return
        frames = (stream.prompt_token.shape[1] + n_tokens) * self.config.flow.token_mel_ratio
        if frames * FlowStream.bytes_per_frame(self.flow) > self.flow_cache_share:
            stream.drop_cache()
            self.fallbacks += 1


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

    ``add(session)`` hands a session over; ``notify(session)`` says something changed (tokens, the LLM's end,
    a cancel). ``on_release(session)`` is called from the worker once the session is finished or cancelled
    and its LLM done; ``on_failure(session)`` when a chunk failed (the engine stops the session's LLM).
    """

    def __init__(self, t2w: Token2Wav, on_release: Callable[[Session], None],
                 on_failure: Callable[[Session], None], name: str = "cosyvoice-t2w") -> None:
        self.t2w = t2w
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
        # unverified on GPU (no device this session): a side stream so flow/vocoder overlap the LLM's kernels
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            while True:
                self._take_news()
                due = self._due()
                if due is None:
                    with self._cond:
                        if self._stop and not self._news:
                            return
                        self._cond.wait_for(lambda: self._news or self._stop)
                    continue
                self._run(*due)
                del due  # hold nothing of a finished chunk while asleep

    def _take_news(self) -> None:
        with self._cond:
            news, self._news = self._news, []
        for session in news:
            if session not in self._states and not session.released.is_set():
                self._states[session] = T2WState.open(session, self.t2w.config.flow.pre_lookahead_len)

    def _due(self) -> tuple[Session, T2WState] | None:
        """Release the sessions nothing works for any more; the one whose chunk is most urgent, if any."""
        best: tuple[tuple[float, float], Session, T2WState] | None = None
        for session, state in list(self._states.items()):
            if session.cancelled or state.finished:
                if session.llm_snapshot()[1]:  # the LLM will not touch it again
                    self._release(session)
                continue
            if not state.due(session):
                continue
            first = state.next_index == session.first_index
            priority = (0.0, float(session.id)) if first else (1.0, state.deadline(session))
            if best is None or priority < best[0]:
                best = (priority, session, state)
        return None if best is None else best[1:]

    def _run(self, session: Session, state: T2WState) -> None:
        """Compute the session's due chunk and queue it (or the error that ends the session)."""
        work = state.take(session)
        if isinstance(work, BaseException):
            state.finished = True
            session.put(work)
            return
        try:
            chunk = self.t2w.chunk(session, state, work)
        except BaseException as exc:  # the session fails, not the worker
            state.finished = True
            session.put(as_cosyvoice_error(exc, "speech synthesis"))
            self._on_failure(session)
            return
        finally:
            if state.flow_stream is not None:
                with self._cond:
                    self._cache_bytes[session.id] = state.flow_stream.cache_bytes
        session.put(chunk)

    def _release(self, session: Session) -> None:
        state = self._states.pop(session)
        state.flow_stream = state.hift_stream = state.mel_cache = state.time_scale = None
        with self._cond:
            self._cache_bytes.pop(session.id, None)
        try:
            self._on_release(session)
        except Exception:  # a listener's bug must not stop the worker
            logger.exception("releasing a session failed")
        session.released.set()  # last: whoever waits for it finds everything freed
