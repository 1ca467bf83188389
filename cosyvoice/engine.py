"""The synthesis engine: one object owns the networks and the device; each request is a session.

Data flow of one session (see docs/architecture.md):

    LLM producer thread ──tokens──▶ Session (condition variable) ──▶ consumer (the caller's generator)
                                                                      ├─ flow (tokens → mel), per chunk policy
                                                                      └─ HiFT (mel → waveform) → AudioChunk

The producer wakes the consumer whenever a token arrives (no polling). Closing the consumer's
generator (or an exception anywhere) cancels the producer within one decode step, joins it, and
frees the session slot. Each session owns all of its state (tokens, chunk policy, mel cache), so
concurrent requests never influence each other — the reference shares its growing hop length
across requests (docs/differences.md).
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from cosyvoice.config import CosyVoice3Config
from cosyvoice.errors import CosyVoiceError, InvalidInputError, ResourceLimitError
from cosyvoice.flow import CausalMaskedDiffWithDiT, FlowStream
from cosyvoice.frontend.frontend import ModelInput
from cosyvoice.hifigan import CausalHiFTGenerator, HiFTStream
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.llm.model import ENDOFPROMPT_ID
from cosyvoice.settings import SPEED_RANGE, Limits


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


@dataclass
class Session:
    """Per-request state. The producer thread appends tokens; the consumer reads them."""

    id: int
    seed: int
    tokens: list[int] = field(default_factory=list)
    llm_done: bool = False
    error: BaseException | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    cond: threading.Condition = field(default_factory=threading.Condition)
    flow_stream: FlowStream | None = None  # streaming requests: the flow's cache of finished chunks
    hift_stream: HiFTStream | None = None  # streaming requests: the vocoder's window and phase carry
    mel_cache: torch.Tensor | None = None
    speech_offset: int = 0


class Engine:
    """Owns the three networks on one device and runs sessions on them."""

    def __init__(self, config: CosyVoice3Config, llm: CosyVoice3LM, flow: CausalMaskedDiffWithDiT,
                 hift: CausalHiFTGenerator, device: torch.device, limits: Limits | None = None,
                 endofprompt_id: int = ENDOFPROMPT_ID, incremental_flow: bool = True,
                 incremental_vocoder: bool = True) -> None:
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
        self._slots = threading.BoundedSemaphore(self.limits.max_sessions)
        self._sessions: dict[int, Session] = {}
        self._sessions_lock = threading.Lock()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ bookkeeping

    @property
    def active_sessions(self) -> int:
        with self._sessions_lock:
            return len(self._sessions)

    def _open_session(self, seed: int | None) -> Session:
        if not self._slots.acquire(timeout=self.limits.queue_timeout_seconds):
            raise ResourceLimitError(
                f"busy: {self.limits.max_sessions} requests are already synthesising and none finished within "
                f"{self.limits.queue_timeout_seconds:g} s; retry later (COSYVOICE_MAX_SESSIONS raises the bound)")
        session = Session(id=next(self._ids), seed=secrets.randbits(63) if seed is None else int(seed))
        with self._sessions_lock:
            self._sessions[session.id] = session
        return session

    def _close_session(self, session: Session, producer: threading.Thread | None) -> None:
        session.cancelled.set()
        if producer is not None:
            producer.join()
        with self._sessions_lock:
            self._sessions.pop(session.id, None)
        session.mel_cache = session.flow_stream = session.hift_stream = None
        self._slots.release()

    # ------------------------------------------------------------------ LLM producer

    def _produce(self, session: Session, inp: ModelInput) -> None:
        try:
            with torch.inference_mode():
                tokens = self.llm.generate(
                    text=inp.text, prompt_text=inp.prompt_text, prompt_speech_token=inp.llm_prompt_speech_token,
                    seed=session.seed, endofprompt_id=self.endofprompt_id,
                    should_stop=session.cancelled.is_set)  # polled before every decode step
                with contextlib.closing(tokens):
                    for token in tokens:
                        with session.cond:
                            session.tokens.append(token)
                            session.cond.notify()
        except BaseException as exc:  # handed to the consumer, which re-raises it in the caller's thread
            session.error = exc
        finally:
            with session.cond:
                session.llm_done = True
                session.cond.notify()

    # ------------------------------------------------------------------ token → waveform

    @torch.inference_mode()
    def token2wav(self, session: Session, tokens: torch.Tensor, inp: ModelInput, token_offset: int,
                  streaming: bool, finalize: bool, speed: float = 1.0) -> torch.Tensor:
        """Flow + HiFT for one chunk, as the reference: new mel frames join the session's mel cache and the
        vocoder re-runs over the whole cache; only samples after the previous chunk are returned.

        A streaming session's flow calls go through its :class:`FlowStream`, which reuses the finished
        chunk-causal chunks instead of recomputing the utterance (equal within float rounding), and its
        vocoder calls through its :class:`HiFTStream`, which vocodes a bounded window (the same samples).
        """
        dev = self.device
        if self.incremental_flow and (streaming or session.flow_stream is not None):
            if session.flow_stream is None:
                session.flow_stream = FlowStream(self.flow, inp.flow_prompt_speech_token.to(dev),
                                                 inp.prompt_speech_feat.to(dev), inp.flow_embedding.to(dev))
            mel = session.flow_stream.inference(tokens.to(dev), streaming=streaming, finalize=finalize)
        else:
            prompt_token, prompt_feat = inp.flow_prompt_speech_token.to(dev), inp.prompt_speech_feat.to(dev)
            mel = self.flow.inference(
                token=tokens.to(dev), token_len=tokens.shape[1], prompt_token=prompt_token,
                prompt_token_len=prompt_token.shape[1], prompt_feat=prompt_feat, prompt_feat_len=prompt_feat.shape[1],
                embedding=inp.flow_embedding.to(dev), streaming=streaming, finalize=finalize)
        mel = mel[:, :, token_offset * self.config.flow.token_mel_ratio:]
        if self.incremental_vocoder and (streaming or session.hift_stream is not None):
            if session.hift_stream is None:
                session.hift_stream = HiFTStream(self.hift)
            return session.hift_stream.inference(mel, finalize=finalize)[0].float().cpu()
        session.mel_cache = mel if session.mel_cache is None else torch.cat([session.mel_cache, mel], dim=2)
        full_mel = session.mel_cache
        if speed != 1.0:
            full_mel = F.interpolate(full_mel, size=int(full_mel.shape[2] / speed), mode="linear")
        speech, _ = self.hift.inference(speech_feat=full_mel, finalize=finalize)
        out = speech[0, session.speech_offset:]
        session.speech_offset += out.shape[0]
        return out.float().cpu()

    # ------------------------------------------------------------------ sessions

    def synthesize(self, inp: ModelInput, stream: bool = False, speed: float = 1.0, seed: int | None = None,
                   sample_offset: int = 0, first_index: int = 0) -> Iterator[AudioChunk]:
        """Speak one text segment. Streaming yields chunks as the policy allows; otherwise one chunk."""
        self.check_options(stream, speed, seed)
        session = self._open_session(seed)
        producer = threading.Thread(target=self._produce, args=(session, inp), daemon=True,
                                    name=f"cosyvoice-llm-{session.id}")
        try:
            producer.start()
            yield from self._consume(session, inp, stream, speed, sample_offset, first_index)
        except CosyVoiceError:
            raise
        except Exception as exc:  # flow/vocoder failures reach the caller as our error type, with the cause
            raise _as_cosyvoice_error(exc, "speech synthesis") from exc
        finally:
            self._close_session(session, producer)

    def vocode(self, tokens: list[int] | torch.Tensor, inp: ModelInput, stream: bool = False,
               speed: float = 1.0) -> Iterator[AudioChunk]:
        """Speech tokens given by the caller (voice conversion, replay) through the same chunking as
        :meth:`synthesize`; ``inp`` supplies the flow prompt and speaker embedding (its text is unused)."""
        self.check_options(stream, speed)
        ids = torch.as_tensor(tokens).reshape(-1).tolist()
        if any(not 0 <= t < self.config.flow.vocab_size for t in ids):
            raise InvalidInputError(f"speech tokens must be in [0, {self.config.flow.vocab_size})")
        session = self._open_session(0)
        session.tokens, session.llm_done = ids, True
        try:
            yield from self._consume(session, inp, stream, speed, 0, 0)
        finally:
            self._close_session(session, None)

    @staticmethod
    def check_options(stream: bool, speed: float, seed: int | None = None) -> None:
        """Raise :class:`InvalidInputError` for options no session can honour (callers check before any work)."""
        lo, hi = SPEED_RANGE
        if not isinstance(speed, (int, float)) or not lo <= speed <= hi:
            raise InvalidInputError(f"speed must be between {lo:g} and {hi:g}, got {speed!r}")
        if stream and speed != 1.0:
            raise InvalidInputError("speed other than 1.0 is only supported with stream=False "
                                    "(the reference model cannot change speed mid-stream)")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
            raise InvalidInputError(f"seed must be an integer in [0, 2**63), got {seed!r}")

    def _wait_for(self, session: Session, predicate) -> None:
        with session.cond:
            session.cond.wait_for(lambda: predicate() or session.llm_done)
        err = session.error
        if isinstance(err, CosyVoiceError):
            raise err
        if err is not None:
            raise _as_cosyvoice_error(err, "speech token generation") from err

    def _consume(self, session: Session, inp: ModelInput, stream: bool, speed: float, sample_offset: int,
                 first_index: int) -> Iterator[AudioChunk]:
        policy = ChunkPolicy(prompt_len=inp.flow_prompt_speech_token.shape[1],
                             lookahead=self.config.flow.pre_lookahead_len)
        index = first_index
        started = time.perf_counter()
        if stream:
            while True:
                self._wait_for(session, lambda: policy.ready(len(session.tokens)))
                with session.cond:
                    n_tokens = len(session.tokens)
                    if not policy.ready(n_tokens):
                        break  # the LLM finished; what is left goes into the final chunk
                    hop = policy.current_hop()
                    tokens = torch.tensor([session.tokens[:policy.offset + hop + policy.lookahead]], dtype=torch.int64)
                offset = policy.offset
                pcm = self.token2wav(session, tokens, inp, offset, streaming=True, finalize=False)
                start, end = policy.advance()
                now = time.perf_counter()
                yield AudioChunk(pcm, self.sample_rate, index, sample_offset, start, end, False, now - started)
                sample_offset += pcm.numel()
                index += 1
                started = time.perf_counter()
        else:
            self._wait_for(session, lambda: False)
        with session.cond:
            all_tokens = list(session.tokens)
        if all_tokens:
            tokens = torch.tensor([all_tokens], dtype=torch.int64)
            pcm = self.token2wav(session, tokens, inp, policy.offset, streaming=False, finalize=True, speed=speed)
        else:
            pcm = torch.zeros(0)  # the LLM stopped at once: nothing to say, but the request still completes
        yield AudioChunk(pcm, self.sample_rate, index, sample_offset, policy.offset, len(all_tokens), True,
                         time.perf_counter() - started)


def _as_cosyvoice_error(exc: BaseException, stage: str) -> CosyVoiceError:
    """Our error type for an unexpected failure; running out of GPU memory is a resource limit, not a bug."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return ResourceLimitError(f"{stage} ran out of GPU memory; retry with fewer concurrent requests "
                                  "(COSYVOICE_MAX_SESSIONS) or shorter text")
    return CosyVoiceError(f"{stage} failed: {type(exc).__name__}: {exc}")
