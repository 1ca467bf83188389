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
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from cosyvoice.backends import attach_flow, attach_hift, attach_llm, resolve_backend
from cosyvoice.backends import precision as fast
from cosyvoice.bundle import bundle_digest, open_model_dir
from cosyvoice.engine import AudioChunk, CancelToken, ChunkSchedule, Engine
from cosyvoice.errors import CosyVoiceError, InvalidInputError
from cosyvoice.flow.prompt_cache import PromptCache
from cosyvoice.frontend import prompts
from cosyvoice.frontend.audio import resample
from cosyvoice.frontend.frontend import CosyVoiceFrontend, ModelInput, Voice
from cosyvoice.llm.job import TokenStream
from cosyvoice.settings import PRECISIONS, Limits, parse_precision, precision_from_env, prompt_cache_from_env

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
    plan: fast.PrecisionPlan  # what each stage computes in (the service reports it)

    @property
    def sample_rate(self) -> int:
        return self.engine.sample_rate

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str | torch.device | None = None, dtype: str = "fp32",
             limits: Limits | None = None, download_root: str | Path = "pretrained_models",
             backend: str | None = None, precision: str | None = None, prompt_cache: bool | None = None) -> Model:
        """A local model folder or a ModelScope id; half precision only on CUDA (the reference ignores it on CPU).
        ``backend`` runs the flow estimator and the vocoder (on a CPU with onnxruntime also the LLM's stack) on
        torch, onnxruntime or tensorrt (None: ``COSYVOICE_BACKEND``, else automatic; :mod:`cosyvoice.backends`).
        ``precision`` chooses fp32, bf16 or int8 weights for the LLM and the DiT on a CPU, or ``auto`` (None:
        ``COSYVOICE_PRECISION``, else fp32; :mod:`cosyvoice.backends.precision`). ``prompt_cache``: keep each
        voice's flow prefix across requests (None: ``COSYVOICE_PROMPT_CACHE``, on unless set off); the service
        also keeps it on disk with the voices."""
        wanted = precision or precision_from_env()
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
        wanted = fast.resolve(wanted, device, backend)
        marker = frontend.tokenizer.end_of_prompt_id
        if device.type == "cpu":  # each stage loaded and given its precision in turn (a lower peak of memory)
            plan, llm, flow = fast.plan_and_apply(wanted, lambda: bundle.load_llm(device, precision, marker),
                                                  lambda: bundle.load_flow(device, precision),
                                                  model_root=bundle.root, store=fast.AutoStore.beside(bundle.root),
                                                  model_digest=lambda: bundle_digest(bundle.root))
        else:
            llm, flow = bundle.load_llm(device, precision, marker), bundle.load_flow(device, precision)
            name = next(k for k, v in PRECISIONS.items() if v == precision)
            plan = fast.PrecisionPlan(wanted, name, name)
        llm = attach_llm(llm, bundle.root, backend, device)
        flow = attach_flow(flow, bundle.root, backend, device)
        hift = attach_hift(bundle.load_hift(device), bundle.root, backend, device)
        hift.fold_weight_norm()  # bit-equal output without recomputing g * v / ||v|| per call (after the export)
        cache = None
        if prompt_cache_from_env() if prompt_cache is None else prompt_cache:
            root = bundle.root
            cache = PromptCache(int(limits.prompt_cache_mb * 2**20), lambda: bundle_digest(root))
            # the cache's key needs the model digest (seconds for a real bundle): hashed now, not in the first request
            threading.Thread(target=bundle_digest, args=(root,), name="cosyvoice-model-digest", daemon=True).start()
        engine = Engine(bundle.config, llm, flow, hift, device, limits,
                        trim_leading_silence_ms=limits.trim_leading_silence_ms or None, prompt_cache=cache or False)
        return cls(str(bundle.root), device, precision, limits, frontend, engine, plan)

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

    def model_input(self, frontend: CosyVoiceFrontend, head: torch.Tensor, segment: str) -> ModelInput:
        return frontend.model_input(segment, self.voice, self.prompt_ids, self.llm_prompt_speech, head)


@dataclass(frozen=True)
class Plan:
    """A request as the model takes it: its voice, the conditioning, the text's pieces (normalised, without any
    prompt head), the token ids every piece starts with (``head``: the cross-lingual system prompt, or the head
    of text that carries ``<|endofprompt|>``; may be empty) and the request's seed."""

    voice_id: str
    cond: Conditioning
    head: torch.Tensor  # [1, T_h]
    segments: tuple[str, ...]
    seed: int

    def inputs(self, frontend: CosyVoiceFrontend) -> Iterator[tuple[ModelInput, int]]:
        """Each piece's model input with its seed (:func:`segment_seed`)."""
        for i, segment in enumerate(self.segments):
            yield self.cond.model_input(frontend, self.head, segment), segment_seed(self.seed, i)


def no_ids() -> torch.Tensor:
    return torch.zeros(1, 0, dtype=torch.int32)


def plain_transcript(transcript: str) -> str:
    """A transcript as a user or the official API gave it, without CosyVoice3's system prompt: what the voice
    library keeps (``''`` when nothing else is left)."""
    return prompts.split_prompt(transcript)[1]


def text_plan(frontend: CosyVoiceFrontend, mode: EngineMode, text: str, *, text_frontend: bool = True,
              split_prefixed: bool = True) -> tuple[torch.Tensor, list[str]]:
    """``(head ids, pieces)``: the normalised pieces of ``text`` to speak one after another, and the token ids
    each piece's ids follow.

    Cross-lingual text gets the system prompt (``cross_lingual_text``) as its head. Text that carries
    ``<|endofprompt|>`` keeps the part up to the last marker as its head; ``split_prefixed=False`` keeps such
    text one unnormalised piece, as the reference does (the official API); otherwise the part after the marker
    is normalised and split like plain text.
    """
    if mode == "cross_lingual":
        head, body = prompts.split_prompt(text)
    else:
        before, marker, body = text.rpartition(prompts.END_OF_PROMPT)
        head = before + marker
    if head and not body.strip():
        raise InvalidInputError(f"text has nothing to speak after {prompts.END_OF_PROMPT}: the marker ends a prompt "
                                "(a system prompt or an instruction); leave it out of the text to speak", "text")
    if head and not split_prefixed:
        return no_ids(), [head + body]
    pieces = frontend.text.split(body, text_frontend=text_frontend)
    if not pieces:
        raise InvalidInputError(f"text {body.strip()[:80]!r} has nothing to speak (only punctuation?)", "text")
    return frontend.encode(head) if head else no_ids(), pieces


#: the service's modes as the engine runs them (sft: the voice decides, see :func:`plan`)
ENGINE_MODES: dict[str, EngineMode] = {"zero_shot": "zero_shot", "cross_lingual": "cross_lingual",
                                       "instruct": "instruct2"}
#: a plain transcript -> (voice id, voice): how :func:`plan` gets the request's voice from the service
VoiceOf = Callable[[str], tuple[str, Voice]]


def plan(frontend: CosyVoiceFrontend, mode: str, text: str | None, voice_of: VoiceOf, *, seed: int,
         transcript: str = "", instruction: str = "", text_frontend: bool = True, split_prefixed: bool = True,
         model_form: bool = False) -> Plan:
    """A validated request's :class:`Plan`: the one step from its plain fields to model input.

    ``mode`` is the service's (``sft``: zero-shot for a voice with a transcript, else cross-lingual); ``text``
    None: the text arrives later, as a stream. The voice comes from ``voice_of(plain transcript)`` after the
    text is planned (an upload is decoded only for a request whose text can be spoken), except in sft mode,
    where it decides the engine mode. ``transcript`` is an uploaded prompt's: its system prompt (the default
    one, or one the user typed) is kept apart from the plain transcript the voice library keeps.
    ``model_form``: the official API's requests, which carry ``<|endofprompt|>`` where the mode needs it.
    The conventions are applied once, as token ids: the LLM's prompt ids are the mode's prompt text
    (:func:`prompts.llm_prompt`) followed, in zero-shot, by the voice's plain transcript ids.
    """
    voice = voice_of("") if mode == "sft" else None
    engine_mode = ENGINE_MODES[mode] if voice is None else (
        "zero_shot" if voice[1].prompt_text.numel() else "cross_lingual")
    head, pieces = no_ids(), []
    if text is not None:
        head, pieces = text_plan(frontend, engine_mode, text, text_frontend=text_frontend,
                                 split_prefixed=split_prefixed)
    transcript_head, plain = prompts.split_prompt(transcript) if transcript.strip() else ("", "")
    voice_id, chosen = voice or voice_of(plain)
    if model_form:  # after the voice, as the official API reports its errors
        prompts.check_model_form(mode, text, transcript, instruction)
    prompt = prompts.llm_prompt(engine_mode, instruction, transcript_head)
    prompt_ids = frontend.encode(prompt) if prompt else no_ids()
    if engine_mode == "zero_shot":
        assert chosen.prompt_text.numel(), "zero-shot needs a voice with a transcript (the service checks)"
        prompt_ids = torch.cat([prompt_ids, chosen.prompt_text], dim=1)
    cond = Conditioning(engine_mode, chosen, prompt_ids, engine_mode == "zero_shot")
    return Plan(voice_id, cond, head, tuple(pieces), seed)


class _Cursor:
    """Chunk indices and sample offsets that run on across the engine calls of one request."""

    def __init__(self) -> None:
        self.index = self.offset = 0

    def passed(self, chunk: AudioChunk) -> AudioChunk:
        self.index, self.offset = chunk.index + 1, chunk.sample_offset + chunk.pcm.numel()
        return chunk


def run_inputs(model: Model, inputs: Iterable[tuple[ModelInput, int]], *, stream: bool, speed: float,
               cancel: CancelToken, text_stream: TokenStream | None = None,
               steps: int | None = None, schedule: ChunkSchedule | None = None) -> Iterator[AudioChunk]:
    """Each model input's chunks in turn, with its seed; indices and sample offsets run across inputs.
    ``text_stream``: the text ids of a bi-streaming input (:meth:`TextFeed.inputs`), arriving as they come;
    ``steps``: the flow's Euler steps (None: the model's); ``schedule``: first hop and last flow call (None: the
    reference's), for each input."""
    cursor = _Cursor()
    pending = iter(inputs)
    # checked before the next input is made: a cancelled request does not featurise its next piece of text
    while not cancel.cancelled:
        try:
            inp, seed = next(pending)
        except StopIteration:
            return
        for chunk in model.engine.synthesize(inp, stream=stream, speed=speed, seed=seed, sample_offset=cursor.offset,
                                             first_index=cursor.index, text_stream=text_stream, cancel=cancel,
                                             steps=steps, schedule=schedule):
            yield cursor.passed(chunk)


async def arun_inputs(model: Model, inputs: AsyncIterable[tuple[ModelInput, int]], *, stream: bool, speed: float,
                      cancel: CancelToken, text_stream: TokenStream | None = None,
                      steps: int | None = None, schedule: ChunkSchedule | None = None) -> AsyncIterator[AudioChunk]:
    """:func:`run_inputs` on the event loop: the engine hands chunks over without a thread per request."""
    cursor = _Cursor()
    pending = aiter(inputs)
    while not cancel.cancelled:  # as in run_inputs: checked before the next input is made
        try:
            inp, seed = await anext(pending)
        except StopAsyncIteration:
            return
        chunks = model.engine.asynthesize(inp, stream=stream, speed=speed, seed=seed, sample_offset=cursor.offset,
                                          first_index=cursor.index, text_stream=text_stream, cancel=cancel,
                                          steps=steps, schedule=schedule)
        try:
            async for chunk in chunks:
                yield cursor.passed(chunk)
        finally:
            await chunks.aclose()


async def as_async(items: Iterable[tuple[ModelInput, int]]) -> AsyncIterator[tuple[ModelInput, int]]:
    """Model inputs made at once (a :class:`Plan`'s) for :func:`arun_inputs`."""
    for item in items:
        yield item


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

    @property
    def text_ids(self) -> TokenStream | None:
        """The engine's bi-streaming text input (tokens mode), else None."""
        return self.tokens if self.kind == "tokens" else None

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


def _sentence_inputs(frontend: CosyVoiceFrontend, cond: Conditioning, sentence: str,
                     seed: int) -> list[tuple[ModelInput, int]]:
    """A streamed sentence's model inputs with their seeds (``seed`` is the sentence's own)."""
    if not _speakable(sentence):
        return []
    head, pieces = text_plan(frontend, cond.mode, sentence)
    return list(Plan("", cond, head, tuple(pieces), seed).inputs(frontend))


def stream_inputs(frontend: CosyVoiceFrontend, cond: Conditioning, feed: TextFeed, seed: int,
                  cancel: CancelToken) -> Iterator[tuple[ModelInput, int]]:
    """The model inputs of text that arrives through ``feed`` (for :func:`run_inputs`, with ``feed.text_ids`` as
    its text stream): one bi-streaming input, or each sentence's as it completes."""
    if feed.kind == "tokens":  # the reference's bi-streaming: speech tokens follow the text tokens as they come
        yield cond.model_input(frontend, no_ids(), ""), seed
        return
    for i, sentence in enumerate(feed.sentences(cancel)):
        yield from _sentence_inputs(frontend, cond, sentence, segment_seed(seed, i))


async def astream_inputs(frontend: CosyVoiceFrontend, cond: Conditioning, feed: TextFeed, seed: int,
                         cancel: CancelToken) -> AsyncIterator[tuple[ModelInput, int]]:
    """:func:`stream_inputs` for :func:`arun_inputs`: waiting for a sentence never blocks the event loop."""
    if feed.kind == "tokens":
        yield cond.model_input(frontend, no_ids(), ""), seed
        return
    i = 0
    async for sentence in feed.asentences(cancel):
        for item in _sentence_inputs(frontend, cond, sentence, segment_seed(seed, i)):
            yield item
        i += 1


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

