"""The request pipeline: a validated request's pieces → model inputs → engine sessions → audio chunks.

Data flows one way (docs/architecture.md, "Request path"): adapters → :mod:`cosyvoice.service` (validation,
admission, voices) → here → :mod:`cosyvoice.engine`. Everything here assumes valid input (the service checked
it at the edge); what it turns into model input it turns once:

* the mode's conditioning (:class:`Conditioning`): which prompt text ids the LLM gets and whether it
  continues the voice's speech tokens; CosyVoice3's prompt conventions (:mod:`cosyvoice.frontend.prompts`)
  are applied here, where the token ids are made;
* the text's segments (the frontend's normaliser and splitter) and each segment's seed (:func:`segment_seed`);
* text that arrives over time (:class:`TextFeed`): token by token into the engine's bi-streaming input, or
  sentence by sentence where the mode has no such input (cross-lingual).

:class:`Model` is one loaded model folder: its frontend and its engine on one device.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from cosyvoice.backends import resolve_backend
from cosyvoice.bundle import bundle_digest, open_model_dir
from cosyvoice.engine import AudioChunk, CancelToken, Engine
from cosyvoice.errors import CosyVoiceError, InvalidInputError
from cosyvoice.flow.prompt_cache import PromptCache
from cosyvoice.frontend import prompts
from cosyvoice.frontend.audio import resample
from cosyvoice.frontend.frontend import CosyVoiceFrontend, ModelInput, Voice
from cosyvoice.llm.job import TokenStream
from cosyvoice.settings import Limits, parse_precision, prompt_cache_from_env

logger = logging.getLogger(__name__)

EngineMode = Literal["zero_shot", "cross_lingual", "instruct2"]
SEED_SPACE = 2**63
#: sample rate of voice-conversion source audio for the speech tokenizer
TOKENIZER_RATE = 16000


def segment_seed(seed: int, index: int) -> int:
    """The seed of a request's ``index``-th segment (or streamed sentence): the one rule for every path."""
    return (seed + index) % SEED_SPACE


@dataclass
class Model:
    """One model folder loaded on one device: the frontend (text and prompt audio → model input) and the engine."""

    model_dir: str
    device: torch.device
    precision: torch.dtype
    limits: Limits
    frontend: CosyVoiceFrontend
    engine: Engine

    @property
    def sample_rate(self) -> int:
        return self.engine.sample_rate

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str | torch.device | None = None, dtype: str = "fp32",
             limits: Limits | None = None, download_root: str | Path = "pretrained_models",
             backend: str | None = None, prompt_cache: bool | None = None) -> Model:
        """A local model folder or a ModelScope id; half precision only on CUDA (the reference ignores it on CPU).
        ``backend`` runs the flow estimator and the vocoder on torch, onnxruntime or tensorrt (None:
        ``COSYVOICE_BACKEND``, else automatic; :mod:`cosyvoice.backends`). ``prompt_cache``: keep each voice's
        flow prefix across requests (None: ``COSYVOICE_PROMPT_CACHE``, on unless set off); the service also keeps
        it on disk with the voices."""
        bundle = open_model_dir(model_dir, download_root)
        device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        precision = parse_precision(dtype)
        if precision != torch.float32 and device.type != "cuda":
            logger.warning("no CUDA device: half precision ignored, running in float32")
            precision = torch.float32
        limits = limits or Limits.from_env()
        # the ONNX models follow the chosen device (CUDA only where onnxruntime-gpu is installed)
        providers = ["CPUExecutionProvider"] if device.type == "cpu" else None
        frontend = CosyVoiceFrontend(bundle, limits, providers=providers)
        backend = resolve_backend(backend, device)
        cache = None
        if prompt_cache_from_env() if prompt_cache is None else prompt_cache:
            root = bundle.root
            cache = PromptCache(int(limits.prompt_cache_mb * 2**20), lambda: bundle_digest(root))
            # the cache's key needs the model digest (seconds for a real bundle): hashed now, not in the first request
            threading.Thread(target=bundle_digest, args=(root,), name="cosyvoice-model-digest", daemon=True).start()
        engine = Engine(bundle.config, bundle.load_llm(device, precision), bundle.load_flow(device, precision, backend),
                        bundle.load_hift(device, backend), device, limits,
                        endofprompt_id=frontend.tokenizer.end_of_prompt_id,
                        trim_leading_silence_ms=limits.trim_leading_silence_ms or None, prompt_cache=cache or False)
        return cls(str(bundle.root), device, precision, limits, frontend, engine)

    def close(self) -> None:
        self.engine.close()


@dataclass(frozen=True)
class Conditioning:
    """What a mode gives the LLM and the flow besides the text: the voice, the LLM's prompt text ids and whether
    the LLM continues the voice's speech tokens (zero-shot) or starts fresh (cross-lingual, instruct2)."""

    mode: EngineMode
    voice: Voice
    prompt_ids: torch.Tensor  # [1, T_p]
    llm_prompt_speech: bool

    def model_input(self, frontend: CosyVoiceFrontend, segment: str) -> ModelInput:
        return frontend.model_input(segment, self.voice, self.prompt_ids, self.llm_prompt_speech)


def conditioning(frontend: CosyVoiceFrontend, mode: EngineMode, voice: Voice, instruction: str = "") -> Conditioning:
    """The conditioning of ``mode``. A zero-shot voice's transcript ids carry the system prefix already (the
    voice library stores them so); an instruction is wrapped here (``You are a helpful assistant. ...``)."""
    if mode == "zero_shot":
        assert voice.prompt_text.numel(), "zero-shot needs a voice with a transcript (the service checks)"
        return Conditioning(mode, voice, voice.prompt_text, True)
    if mode == "cross_lingual":
        return Conditioning(mode, voice, torch.zeros(1, 0, dtype=torch.int32), False)
    # the instruction replaces the transcript; the reference keeps a saved voice's transcript here instead,
    # silently dropping the instruction (docs/differences.md)
    return Conditioning(mode, voice, frontend.encode(prompts.instruct_text(instruction)), False)


def text_segments(frontend: CosyVoiceFrontend, mode: EngineMode, text: str, *, text_frontend: bool = True,
                  split_prefixed: bool = True) -> list[str]:
    """The normalised pieces of ``text`` to speak one after another, in the model's form.

    Cross-lingual text gets the system prefix (``cross_lingual_text``). ``split_prefixed=False`` keeps text
    that carries ``<|endofprompt|>`` as one unnormalised piece, as the reference does (the official API);
    otherwise the part after the marker is normalised and split like plain text, each piece prefixed again.
    """
    if mode == "cross_lingual":
        text = prompts.cross_lingual_text(text)
    return frontend.segments(text, text_frontend, split_prefixed)


def run_segments(model: Model, cond: Conditioning, segments: list[str], *, stream: bool, speed: float, seed: int,
                 cancel: CancelToken, first_index: int = 0, first_sample: int = 0,
                 steps: int | None = None) -> Iterator[AudioChunk]:
    """Each segment's chunks in turn; indices and sample offsets run across segments."""
    index, offset = first_index, first_sample
    for i, segment in enumerate(segments):
        if cancel.cancelled:
            return
        # users' text stays out of INFO logs (privacy); DEBUG shows it when diagnosing
        logger.debug("synthesising segment %d/%d: %s", i + 1, len(segments), segment)
        for chunk in model.engine.synthesize(cond.model_input(model.frontend, segment), stream=stream, speed=speed,
                                             seed=segment_seed(seed, i), sample_offset=offset, first_index=index,
                                             cancel=cancel, steps=steps):
            index, offset = chunk.index + 1, chunk.sample_offset + chunk.pcm.numel()
            yield chunk


async def arun_segments(model: Model, cond: Conditioning, segments: list[str], *, stream: bool, speed: float,
                        seed: int, cancel: CancelToken, first_index: int = 0, first_sample: int = 0,
                        steps: int | None = None) -> AsyncIterator[AudioChunk]:
    """:func:`run_segments` on the event loop: the engine hands chunks over without a thread per request."""
    index, offset = first_index, first_sample
    for i, segment in enumerate(segments):
        if cancel.cancelled:
            return
        logger.debug("synthesising segment %d/%d: %s", i + 1, len(segments), segment)
        chunks = model.engine.asynthesize(cond.model_input(model.frontend, segment), stream=stream, speed=speed,
                                          seed=segment_seed(seed, i), sample_offset=offset, first_index=index,
                                          cancel=cancel, steps=steps)
        try:
            async for chunk in chunks:
                index, offset = chunk.index + 1, chunk.sample_offset + chunk.pcm.numel()
                yield chunk
        finally:
            await chunks.aclose()


# ---------------------------------------------------------------------------------------------- text streams

class TextStreamClosedError(CosyVoiceError):
    """Text was written to a text stream whose synthesis has ended (finished, failed or abandoned)."""


# a sentence ends at .!?;… (then closing quotes/brackets) followed by white space, or at CJK end marks or a
# new line; a trailing "." waits for the next piece, since "3." may continue as "3.14"
_SENTENCE_END = re.compile(r"[.!?;…]+[\"'”’)\]]*\s+|[。！？；]+[”’」』）]*|\n+")


class TextFeed:
    """The writing end of a text-stream synthesis: ``write`` pieces from any thread (a WebSocket reader on the
    event loop, a thread pumping a generator), then ``close()`` — or ``close(exc)`` to fail the request.

    ``tokens`` mode hands each piece's token ids to the engine's bi-streaming input at once (tokenised piece by
    piece without normalisation, as the official frontend does for generator text); ``sentences`` mode keeps
    the text until a sentence is complete and hands over whole sentences (cross-lingual has no bi-streaming).
    The total text is bounded by ``max_chars``. Writing after the synthesis ended raises
    :class:`TextStreamClosedError`.
    """

    def __init__(self, frontend: CosyVoiceFrontend, max_chars: int, kind: Literal["tokens", "sentences"]) -> None:
        self._frontend, self._max_chars, self.kind = frontend, max_chars, kind
        self.tokens = TokenStream()  # tokens mode: the engine's text input
        self._lock = threading.Condition()
        self._buffer = ""
        self._sentences: deque[str] = deque()  # sentences mode: complete sentences not yet taken
        self._chars = 0
        self._closed = False
        self._error: BaseException | None = None
        self._listeners: list[Callable[[], None]] = []

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, text: str) -> None:
        """Add a piece of text to speak."""
        if not isinstance(text, str):
            error = InvalidInputError(f"text pieces must be strings, got {type(text).__name__}", "text")
            self.close(error)
            raise error
        ids = self._frontend.tokenizer.encode(text, allowed_special="all") if self.kind == "tokens" and text else []
        with self._lock:
            if self._closed:
                raise TextStreamClosedError("this text stream is closed: its synthesis has ended or close() was "
                                            "called; start a new synthesis for more text")
            self._chars += len(text)
            if self._chars > self._max_chars:
                error = InvalidInputError(f"the streamed text exceeds {self._max_chars} characters, the limit per "
                                          "request; start a new request for more", "text")
                self._close_locked(error)
                raise error
            if self.kind == "tokens":
                if ids:
                    self.tokens.put(ids)
                return
            self._buffer += text
            while (end := _SENTENCE_END.search(self._buffer)) is not None:
                sentence, self._buffer = self._buffer[:end.end()].strip(), self._buffer[end.end():]
                if sentence:
                    self._sentences.append(sentence)
            self._notify_locked()

    def close(self, error: BaseException | None = None) -> None:
        """End the text; with ``error`` the synthesis fails with it. Closing twice is harmless."""
        with self._lock:
            self._close_locked(error)

    def _close_locked(self, error: BaseException | None) -> None:
        if self._closed:
            return
        self._closed, self._error = True, error
        if self.kind == "tokens":
            self.tokens.close(error)
            return
        if self._buffer.strip():
            self._sentences.append(self._buffer.strip())
        self._buffer = ""
        self._notify_locked()

    def _notify_locked(self) -> None:
        self._lock.notify_all()
        for listener in self._listeners:
            listener()

    def _take(self) -> str | None:
        """The next sentence, or None at the end; re-raises the writer's error. Call with the lock held."""
        if self._sentences:
            return self._sentences.popleft()
        if self._error is not None:
            raise self._error
        return None

    def sentences(self, cancel: CancelToken) -> Iterator[str]:
        """Sentences as they complete (blocking); ends when the text ends or the request is cancelled."""
        stop = cancel.subscribe(self._wake)
        try:
            while True:
                with self._lock:
                    self._lock.wait_for(lambda: self._sentences or self._closed or cancel.cancelled)
                    if cancel.cancelled:
                        return
                    sentence = self._take()
                if sentence is None:
                    return
                yield sentence
        finally:
            stop()

    async def asentences(self, cancel: CancelToken) -> AsyncIterator[str]:
        """:meth:`sentences` without blocking the event loop (writers on other threads wake it)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is reading any more
                loop.call_soon_threadsafe(ready.set)

        with self._lock:
            self._listeners.append(wake)
        stop = cancel.subscribe(wake)
        try:
            while True:
                with self._lock:
                    ready.clear()
                    if cancel.cancelled:
                        return
                    if self._sentences or self._closed:
                        sentence = self._take()
                        if sentence is None:
                            return
                    else:
                        sentence = None
                if sentence is None:
                    await ready.wait()
                    continue
                yield sentence
        finally:
            stop()
            with self._lock:
                self._listeners.remove(wake)

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()


def _speakable(sentence: str) -> bool:
    return any(ch.isalnum() for ch in sentence)  # punctuation or symbols alone: nothing to say, no reason to fail


def run_text_stream(model: Model, cond: Conditioning, feed: TextFeed, *, stream: bool, speed: float, seed: int,
                    cancel: CancelToken, steps: int | None = None) -> Iterator[AudioChunk]:
    """Audio for text that arrives through ``feed``, starting before the text is complete."""
    try:
        if feed.kind == "tokens":  # the reference's bi-streaming: speech tokens follow the text tokens as they come
            yield from model.engine.synthesize(cond.model_input(model.frontend, ""), stream=stream, speed=speed,
                                               seed=seed, text_stream=feed.tokens, cancel=cancel, steps=steps)
            return
        index = offset = 0
        for i, sentence in enumerate(feed.sentences(cancel)):
            if not _speakable(sentence):
                continue
            segments = text_segments(model.frontend, cond.mode, sentence)
            for chunk in run_segments(model, cond, segments, stream=stream, speed=speed, seed=segment_seed(seed, i),
                                      cancel=cancel, first_index=index, first_sample=offset, steps=steps):
                index, offset = chunk.index + 1, chunk.sample_offset + chunk.pcm.numel()
                yield chunk
    finally:
        feed.close()  # the request is over: later writes raise


async def arun_text_stream(model: Model, cond: Conditioning, feed: TextFeed, *, stream: bool, speed: float,
                           seed: int, cancel: CancelToken, steps: int | None = None) -> AsyncIterator[AudioChunk]:
    """:func:`run_text_stream` on the event loop."""
    try:
        if feed.kind == "tokens":
            chunks = model.engine.asynthesize(cond.model_input(model.frontend, ""), stream=stream, speed=speed,
                                              seed=seed, text_stream=feed.tokens, cancel=cancel, steps=steps)
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()
            return
        index = offset = i = 0
        async for sentence in feed.asentences(cancel):
            if not _speakable(sentence):
                continue
            segments = text_segments(model.frontend, cond.mode, sentence)
            async for chunk in arun_segments(model, cond, segments, stream=stream, speed=speed,
                                             seed=segment_seed(seed, i), cancel=cancel, first_index=index,
                                             first_sample=offset, steps=steps):
                index, offset = chunk.index + 1, chunk.sample_offset + chunk.pcm.numel()
                yield chunk
            i += 1
    finally:
        feed.close()


# ---------------------------------------------------------------------------------------------- voice conversion

def conversion_input(model: Model, source: tuple[torch.Tensor, int], prompt: Voice) -> tuple[list[int], ModelInput]:
    """(speech tokens of ``source``, the flow's input for ``prompt``'s voice): voice conversion's model input."""
    wav, rate = source
    tokens = model.frontend.speech_tokenizer(resample(wav, rate, TOKENIZER_RATE))
    features = prompt.features
    empty = torch.zeros(1, 0, dtype=torch.int32)
    inp = ModelInput(text=empty, prompt_text=empty, llm_prompt_speech_token=empty,
                     flow_prompt_speech_token=features.speech_token.to(torch.int32),
                     prompt_speech_feat=features.speech_feat, flow_embedding=features.embedding)
    return tokens.reshape(-1).tolist(), inp

