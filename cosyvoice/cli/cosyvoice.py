"""The official Python API (``CosyVoice3``, ``AutoModel``) as a thin facade over our engine.

Existing scripts switch by changing one import: method names, arguments and the yielded
``{'tts_speech': tensor[1, N]}`` dicts are those of the official ``cosyvoice.cli.cosyvoice``.
Additions are keyword-only: ``seed=`` for reproducible sampling, :meth:`CosyVoice3.synthesize`, which
yields :class:`~cosyvoice.engine.AudioChunk` with timing and token-range metadata, and
:meth:`CosyVoice3.synthesize_stream` for text that arrives over time (a chat model's output, a WebSocket).

Saved voices (``add_zero_shot_spk``, ``save_spkinfo``, ``zero_shot_spk_id=``) are the named voices of the
model's :class:`~cosyvoice.voices.VoiceLibrary`; ``{model_dir}/spk2info.pt`` is imported at start-up and
written by ``save_spkinfo`` without ever dropping an entry (:mod:`cosyvoice.spkinfo`).
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from cosyvoice.backends import resolve_backend
from cosyvoice.bundle import open_model_dir, resolve_model_dir
from cosyvoice.engine import AudioChunk, CancelToken, Engine
from cosyvoice.errors import CosyVoiceError, InvalidInputError, ModelBundleError, NotFoundError
from cosyvoice.frontend import prompts
from cosyvoice.frontend.audio import AudioSource, resample
from cosyvoice.frontend.frontend import CosyVoiceFrontend, ModelInput, Voice
from cosyvoice.frontend.tokenizer import CosyVoice3Tokenizer
from cosyvoice.llm.job import TokenStream
from cosyvoice.settings import Limits, default_voice_dir, parse_precision
from cosyvoice.spkinfo import SPKINFO_FILE, read_spkinfo, voice_to_official, write_spkinfo
from cosyvoice.voices import VoiceLibrary

logger = logging.getLogger(__name__)

Mode = Literal["zero_shot", "cross_lingual", "instruct2"]
#: sample rate of a bare float tensor / array given as a prompt (what the official servers pass)
TENSOR_PROMPT_RATE = 16000
#: text given as pieces: any iterable of str that is not itself a str (a generator, a list, ...)
TextInput = str | Iterable[str]


class TextStreamClosedError(CosyVoiceError):
    """Text was written to a text stream whose synthesis has ended (finished, failed or abandoned)."""


class TextStreamWriter:
    """The writing end of a text-stream synthesis (see :meth:`CosyVoice3.synthesize_stream`).

    ``write`` tokenises each piece on its own, as the official frontend does for generator text (no text
    normalisation), and hands the ids to the LLM at once; ``close`` ends the text (or fails the request
    with the writer's error). Thread-safe; usable from any thread, e.g. a WebSocket reader.
    """

    def __init__(self, tokenizer: CosyVoice3Tokenizer, stream: TokenStream, max_chars: int) -> None:
        self._tokenizer, self._stream, self._max_chars = tokenizer, stream, max_chars
        self._lock = threading.Lock()
        self._chars = 0
        self._closed = False  # no more text: closed by the writer, or the synthesis ended

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, text: str) -> None:
        """Add a piece of text to speak. Raises :class:`TextStreamClosedError` once the synthesis has ended."""
        if not isinstance(text, str):
            error = InvalidInputError(f"text pieces must be strings, got {type(text).__name__}")
            self.close(error)
            raise error
        ids = self._tokenizer.encode(text, allowed_special="all") if text else []
        with self._lock:
            if self._closed:
                raise TextStreamClosedError("this text stream is closed: its synthesis has ended or close() was "
                                            "called; start a new synthesis for more text")
            self._chars += len(text)
            if self._chars > self._max_chars:
                error = InvalidInputError(
                    f"the streamed text exceeds {self._max_chars} characters, the limit per request "
                    "(COSYVOICE_MAX_TEXT_CHARS); start a new request for more")
                self._close_locked(error)
                raise error
            if ids:
                self._stream.put(ids)

    def close(self, error: BaseException | None = None) -> None:
        """End the text; with ``error`` the synthesis fails with it. Closing twice is harmless."""
        with self._lock:
            self._close_locked(error)

    def _close_locked(self, error: BaseException | None) -> None:
        if not self._closed:
            self._closed = True
            self._stream.close(error)


def _is_text_stream(text: object) -> bool:
    return not isinstance(text, (str, bytes, bytearray)) and isinstance(text, Iterable)


def _pump(pieces: Iterable[str], writer: TextStreamWriter) -> None:
    """Feed an iterable of text pieces into ``writer``; its exception, if any, fails the synthesis."""
    try:
        for piece in pieces:
            writer.write(piece)
    except TextStreamClosedError:
        return  # the listener went away: stop pulling text
    except BaseException as exc:  # the caller's generator failed: the synthesis reports its error
        writer.close(exc)
        return
    writer.close()


def _prompt_source(prompt_wav: Any) -> Any:
    """A bare float tensor / array ``[N]`` or ``[1, N]`` is 16 kHz audio (the official servers' convention)."""
    if isinstance(prompt_wav, (torch.Tensor, np.ndarray)):
        is_float = prompt_wav.is_floating_point() if isinstance(prompt_wav, torch.Tensor) else \
            np.issubdtype(prompt_wav.dtype, np.floating)
        if not is_float or prompt_wav.ndim not in (1, 2) or (prompt_wav.ndim == 2 and prompt_wav.shape[0] != 1):
            raise InvalidInputError(f"a prompt given as a tensor must be float samples [N] or [1, N] at "
                                    f"{TENSOR_PROMPT_RATE} Hz, got {prompt_wav.dtype} of shape "
                                    f"{tuple(prompt_wav.shape)}")
        return prompt_wav.reshape(-1), TENSOR_PROMPT_RATE
    return prompt_wav


def _request_seed(seed: int | None) -> int | None:
    """``seed`` as given, or one drawn now from torch's global generator (so ``torch.manual_seed`` repeats a call)."""
    if seed is not None:
        return seed
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


class _SavedVoices(Mapping):
    """``spk2info`` as a read-only mapping name -> :class:`Voice` over the voice library (loaded on access)."""

    def __init__(self, library: VoiceLibrary) -> None:
        self._library = library

    def __getitem__(self, name: str) -> Voice:
        if name not in self._names():
            raise KeyError(name)
        return self._library.get(name)[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def _names(self) -> list[str]:
        return [i.name for i in self._library.named()]


class CosyVoice3:
    """Fun-CosyVoice3 text-to-speech, API-compatible with the official ``CosyVoice3``.

    ``model_dir`` is a local model folder or a ModelScope id (downloaded into ``pretrained_models/``).
    ``fp16`` runs the LLM and flow in float16 on CUDA (ignored on CPU, as the reference does); ``dtype``
    ("fp32", "bf16", "fp16") chooses any of the three, also CUDA-only for half precision. The vocoder
    always runs in float32. ``load_trt``, ``load_vllm`` and ``trt_concurrent`` are accepted for drop-in
    compatibility; this engine does not use them. ``voice_dir`` is the voice library's folder (default:
    :func:`cosyvoice.settings.default_voice_dir`), where saved voices live. ``backend`` runs the flow estimator
    and the vocoder on torch, onnxruntime or tensorrt (default ``COSYVOICE_BACKEND``, else auto: onnxruntime on
    a CPU, torch on CUDA; :mod:`cosyvoice.backends`).
    """

    def __init__(self, model_dir: str | Path, load_trt: bool = False, load_vllm: bool = False, fp16: bool = False,
                 trt_concurrent: int = 1, *, device: str | torch.device | None = None, dtype: str | None = None,
                 limits: Limits | None = None, download_root: str | Path = "pretrained_models",
                 voice_dir: str | Path | None = None, backend: str | None = None) -> None:
        bundle = open_model_dir(model_dir, download_root)
        self.model_dir = str(bundle.root)
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if (load_trt or load_vllm) and self.device.type == "cuda":
            logger.warning("load_trt/load_vllm are not used by this engine; running the PyTorch modules")
        precision = parse_precision(dtype or ("fp16" if fp16 else "fp32"))
        if precision != torch.float32 and self.device.type != "cuda":
            logger.warning("no CUDA device: half precision ignored, running in float32")
            precision = torch.float32
        self.fp16 = precision == torch.float16
        self.limits = limits or Limits.from_env()
        # the ONNX models follow the chosen device (CUDA only where onnxruntime-gpu is installed)
        providers = ["CPUExecutionProvider"] if self.device.type == "cpu" else None
        self.frontend = CosyVoiceFrontend(bundle, self.limits, providers=providers)
        backend = resolve_backend(backend, self.device)  # flow estimator + vocoder (cosyvoice.backends)
        self.engine = Engine(bundle.config, bundle.load_llm(self.device, precision),
                             bundle.load_flow(self.device, precision, backend),
                             bundle.load_hift(self.device, backend), self.device, self.limits,
                             endofprompt_id=self.frontend.tokenizer.end_of_prompt_id)
        self.sample_rate = bundle.config.sample_rate
        self.voices = self._open_voices(Path(voice_dir) if voice_dir is not None else default_voice_dir())
        self._spk_lock = threading.Lock()
        self._import_spkinfo()

    # ------------------------------------------------------------------ saved voices (official spk2info)

    def _open_voices(self, root: Path) -> VoiceLibrary:
        """The voice library under ``root``; where it cannot be created (a read-only folder) the model still
        starts, with a library in a temporary folder, and says so (``save_spkinfo`` still persists voices)."""
        limits = self.limits

        def library(path: Path) -> VoiceLibrary:
            return VoiceLibrary(path, self.frontend, model_dir=self.model_dir, max_entries=limits.max_cached_voices,
                                max_bytes=limits.max_cached_voice_bytes, max_named=limits.max_named_voices)

        try:
            return library(root)
        except OSError as exc:
            fallback = Path(tempfile.mkdtemp(prefix="cosyvoice-voices-"))
            logger.error("cannot use the voice folder %s (%s); saved voices are kept in %s for this run only "
                         "(pass voice_dir= or set COSYVOICE_VOICE_DIR)", root, exc, fallback)
            return library(fallback)

    @property
    def spk2info(self) -> Mapping[str, Voice]:
        """Saved voices by speaker id (read-only; add with ``add_zero_shot_spk``)."""
        return _SavedVoices(self.voices)

    def list_available_spks(self) -> list[str]:
        """Speaker ids usable as ``spk_id`` / ``zero_shot_spk_id`` (see :meth:`unusable_spks` for the rest)."""
        return [info.name for info in self.voices.named()]

    def unusable_spks(self) -> dict[str, str]:
        """Entries of ``spk2info.pt`` this model cannot use, with the reason; they are kept and written back."""
        with self._spk_lock:
            return dict(self._unusable_reasons)

    def add_zero_shot_spk(self, prompt_text: str, prompt_wav: AudioSource, zero_shot_spk_id: str) -> bool:
        """Featurise a prompt once and keep it under ``zero_shot_spk_id`` (replacing a voice of that id)."""
        if not isinstance(zero_shot_spk_id, str) or not zero_shot_spk_id.strip():
            raise InvalidInputError("zero_shot_spk_id must be a non-empty name for the saved voice")
        if not isinstance(prompt_text, str):
            raise InvalidInputError(f"prompt_text must be a string, got {type(prompt_text).__name__}")
        voice_id, _ = self.voices.get_or_create(_prompt_source(prompt_wav), prompt_text)
        self.voices.assign(zero_shot_spk_id, voice_id, replace_name=True)
        return True

    def save_spkinfo(self) -> None:
        """Write the saved voices to ``{model_dir}/spk2info.pt`` in the official format, atomically.

        Entries we could not use are written back unchanged; a file that could not be read is copied
        aside (``spk2info.pt.unreadable-*``) first.
        """
        with self._spk_lock:
            data: dict[Any, Any] = {}
            for info in self.voices.named():
                data[info.name] = voice_to_official(self.voices.get(info.id)[1])
            for name, entry in self._unusable.items():
                key = name if name not in data else _free_key(f"{name} (unusable)", data)
                data[key] = entry
            backup = write_spkinfo(self._spkinfo_path, data, unreadable=self._spkinfo_unreadable)
            if backup is not None:
                logger.warning("saved voices written to %s; the unreadable file it replaced is kept as %s",
                               self._spkinfo_path, backup)
            self._spkinfo_unreadable = False

    @property
    def _spkinfo_path(self) -> Path:
        return Path(self.model_dir) / SPKINFO_FILE

    def _import_spkinfo(self) -> None:
        """Bring ``spk2info.pt``'s usable voices into the library; keep everything else for write-back."""
        found = read_spkinfo(self._spkinfo_path)
        self._spkinfo_unreadable = found.error is not None
        self._unusable: dict[Any, Any] = dict(found.unusable)
        self._unusable_reasons: dict[str, str] = {str(k): v for k, v in found.reasons.items()}
        if found.error:
            self._unusable_reasons[SPKINFO_FILE] = found.error
        for name, voice in found.voices.items():
            try:
                held = self._named_voice(name)
                if held is None:
                    self.voices.put(name, voice)
                elif not _same_voice(held, voice):
                    # a different library voice has this id: the file's voice stays usable under another name
                    other = _free_key(f"{name} (spk2info.pt)", set(self.list_available_spks()))
                    self.voices.put(other, voice)
                    logger.warning("spk2info.pt speaker %r differs from the saved voice of that name; imported as %r",
                                   name, other)
            except (CosyVoiceError, OSError) as exc:
                self._unusable[name] = voice_to_official(voice)
                self._unusable_reasons[name] = f"could not be added to the voice library: {exc}"
                logger.warning("spk2info.pt speaker %r kept in the file only: %s", name, exc)

    def _named_voice(self, name: str) -> Voice | None:
        """The saved (named, not built-in) voice called ``name``; the folder is re-read only on a miss."""
        key = " ".join(name.split())
        try:
            info = self.voices.info(key)
        except NotFoundError:
            return None
        if info.name != key or info.builtin:
            return None
        return self.voices.get(info.id)[1]

    def _saved_voice(self, spk_id: str) -> Voice:
        if not isinstance(spk_id, str):
            raise InvalidInputError(f"a speaker id must be a string, got {type(spk_id).__name__}")
        voice = self._named_voice(spk_id)
        if voice is not None:
            return voice
        reason = self.unusable_spks().get(spk_id)
        if reason is not None:
            raise InvalidInputError(f"speaker {spk_id!r} of spk2info.pt cannot be used with this model ({reason}); "
                                    "it is kept in the file unchanged")
        known = self.list_available_spks()
        raise InvalidInputError(f"unknown speaker id {spk_id!r}; saved voices: {known or 'none'} "
                                "(add one with add_zero_shot_spk)")

    # ------------------------------------------------------------------ synthesis

    def synthesize(self, mode: Mode, tts_text: TextInput, *, prompt_text: str = "",
                   prompt_wav: AudioSource | None = None, instruct_text: str = "", zero_shot_spk_id: str = "",
                   voice: Voice | None = None, stream: bool = False, speed: float = 1.0, text_frontend: bool = True,
                   seed: int | None = None, split_prefixed: bool = False,
                   cancel: CancelToken | None = None) -> Iterator[AudioChunk]:
        """All modes in one call, yielding :class:`AudioChunk` (index and sample offsets run across segments).

        The voice is, in order of precedence: ``voice`` (e.g. from a voice library), the saved
        ``zero_shot_spk_id``, or ``prompt_wav`` (+ ``prompt_text`` for zero-shot). ``split_prefixed``
        splits text after its ``<|endofprompt|>`` into sentences (see ``CosyVoiceFrontend.segments``);
        the official methods leave it off, as the reference does. ``tts_text`` may be an iterable of text
        pieces (a generator) in zero-shot and instruct2 mode: it is read in a thread of its own as the
        speech goes (see :meth:`synthesize_stream`). Without ``seed`` one is drawn from torch's global
        generator at the call. Every input is validated here, before any synthesis, so a bad request
        fails at the call, not at the first chunk. ``cancel`` ends the request from any thread (within one
        LLM step; the iterator then stops without a final chunk).
        """
        if _is_text_stream(tts_text):
            writer, chunks = self.synthesize_stream(
                mode, prompt_text=prompt_text, prompt_wav=prompt_wav, instruct_text=instruct_text,
                zero_shot_spk_id=zero_shot_spk_id, voice=voice, stream=stream, speed=speed,
                text_frontend=text_frontend, seed=seed, cancel=cancel)
            return _pumped(tts_text, writer, chunks)
        speed = Engine.check_options(stream, speed, seed)
        seed = _request_seed(seed)
        segments = self.frontend.segments(tts_text, text_frontend, split_prefixed)
        voice, prompt_ids, llm_prompt_speech = self._conditioning(mode, prompt_text, prompt_wav, instruct_text,
                                                                  zero_shot_spk_id, text_frontend, voice)
        if not self.frontend.has_end_of_prompt(tts_text, prompt_ids):
            raise InvalidInputError(
                "CosyVoice3 needs '<|endofprompt|>' in the prompt: end the zero-shot transcript with it "
                "('You are a helpful assistant.<|endofprompt|>' + transcript), wrap the instruct2 instruction as "
                "'You are a helpful assistant. <instruction><|endofprompt|>', or start cross-lingual text with "
                "'You are a helpful assistant.<|endofprompt|>' (cosyvoice.frontend.prompts does this for you)")
        inputs = (self.frontend.model_input(seg, voice, prompt_ids, llm_prompt_speech) for seg in segments)
        return self._run(segments, inputs, stream, speed, seed, cancel)

    def synthesize_stream(self, mode: Mode, *, prompt_text: str = "", prompt_wav: AudioSource | None = None,
                          instruct_text: str = "", zero_shot_spk_id: str = "", voice: Voice | None = None,
                          stream: bool = True, speed: float = 1.0, text_frontend: bool = True,
                          seed: int | None = None,
                          cancel: CancelToken | None = None) -> tuple[TextStreamWriter, Iterator[AudioChunk]]:
        """Speech for text that arrives over time: ``(writer, chunks)``.

        Write pieces with ``writer.write(text)`` from any thread and end with ``writer.close()`` (or
        ``writer.close(exc)`` to fail the request); iterate ``chunks`` for the audio, which starts before the
        text is complete (the reference's bi-streaming algorithm: 5 text tokens to 15 speech tokens). Modes:
        zero-shot and instruct2 (their prompt text carries ``<|endofprompt|>``, which the algorithm needs).
        Closing ``chunks`` ends the request and makes further writes raise :class:`TextStreamClosedError`.
        The prompt is validated and featurised here, at the call.
        """
        if mode == "cross_lingual":
            raise InvalidInputError("text given as a stream works in zero_shot and instruct2 mode only (the "
                                    "reference's bi-streaming needs <|endofprompt|> in the prompt text); use "
                                    "instruct2 with a neutral instruction for a voice without a transcript")
        speed = Engine.check_options(stream, speed, seed)
        seed = _request_seed(seed)
        voice, prompt_ids, llm_prompt_speech = self._conditioning(mode, prompt_text, prompt_wav, instruct_text,
                                                                  zero_shot_spk_id, text_frontend, voice)
        if not self.frontend.has_end_of_prompt(prompt_ids):
            raise InvalidInputError(
                "text-stream synthesis needs '<|endofprompt|>' in the prompt text: end the zero-shot transcript "
                "('You are a helpful assistant.<|endofprompt|>' + transcript) or the instruct2 instruction "
                "('You are a helpful assistant. <instruction><|endofprompt|>') with it")
        inp = self.frontend.model_input("", voice, prompt_ids, llm_prompt_speech)
        text = TokenStream()
        writer = TextStreamWriter(self.frontend.tokenizer, text, self.limits.max_text_chars)

        def chunks() -> Iterator[AudioChunk]:
            try:
                yield from self.engine.synthesize(inp, stream=stream, speed=speed, seed=seed, text_stream=text,
                                                  cancel=cancel)
            finally:
                writer.close()  # the request is over: later writes raise, a pump stops

        return writer, chunks()

    def _conditioning(self, mode: Mode, prompt_text: str, prompt_wav: AudioSource | None, instruct_text: str,
                      spk_id: str, text_frontend: bool, voice: Voice | None) -> tuple[Voice, torch.Tensor, bool]:
        """(voice, LLM prompt text ids, whether the LLM continues the voice's speech tokens) for ``mode``."""
        if mode not in ("zero_shot", "cross_lingual", "instruct2"):
            raise InvalidInputError(f"unknown mode {mode!r}; use zero_shot, cross_lingual or instruct2")
        prompt_wav = _prompt_source(prompt_wav)
        if voice is not None:
            if mode == "zero_shot" and voice.prompt_text.numel() == 0:
                raise InvalidInputError("this voice has no transcript, which zero-shot cloning needs; use "
                                        "cross-lingual or instruct2 mode with it, or add it again with its transcript")
        elif spk_id:
            voice = self._saved_voice(spk_id)
        elif prompt_wav is None or (isinstance(prompt_wav, str) and not prompt_wav):
            raise InvalidInputError(f"{mode} needs a prompt recording (prompt_wav) or a saved zero_shot_spk_id")
        elif mode == "zero_shot":
            if not isinstance(prompt_text, str) or not prompt_text.strip():
                raise InvalidInputError("zero-shot cloning needs the transcript of the prompt recording "
                                        "(prompt_text), or use cross-lingual mode which needs none")
            self.frontend.check_text(prompt_text, "prompt_text")
            voice = self.frontend.voice(prompt_text, prompt_wav, text_frontend)
        else:
            voice = Voice(self.frontend.prompt_features(prompt_wav), torch.zeros(1, 0, dtype=torch.int32))
        if mode == "zero_shot":
            return voice, voice.prompt_text, True
        if mode == "cross_lingual":
            return voice, torch.zeros(1, 0, dtype=torch.int32), False
        self.frontend.check_text(instruct_text, "instruct_text")
        # the instruction replaces the transcript; the reference keeps a saved voice's transcript here
        # instead, silently dropping the instruction (docs/differences.md)
        return voice, self.frontend.encode(instruct_text), False

    def _run(self, segments: list[str], inputs: Iterator[ModelInput], stream: bool, speed: float,
             seed: int, cancel: CancelToken | None) -> Iterator[AudioChunk]:
        index = offset = 0
        for i, (segment, inp) in enumerate(zip(segments, inputs, strict=True)):
            if cancel is not None and cancel.cancelled:
                return
            # users' text stays out of INFO logs (privacy); DEBUG shows it when diagnosing
            logger.debug("synthesising segment %d/%d: %s", i + 1, len(segments), segment)
            for chunk in self.engine.synthesize(inp, stream=stream, speed=speed, seed=(seed + i) % 2**63,
                                                sample_offset=offset, first_index=index, cancel=cancel):
                index, offset = chunk.index + 1, chunk.sample_offset + chunk.pcm.numel()
                yield chunk

    @staticmethod
    def _as_dicts(chunks: Iterator[AudioChunk]) -> Iterator[dict[str, torch.Tensor]]:
        for chunk in chunks:
            yield {"tts_speech": chunk.pcm.unsqueeze(0)}

    def inference_zero_shot(self, tts_text: TextInput, prompt_text: str, prompt_wav: AudioSource | None,
                            zero_shot_spk_id: str = "", stream: bool = False, speed: float = 1.0,
                            text_frontend: bool = True, *, seed: int | None = None) -> Iterator[dict]:
        """Speak ``tts_text`` (a string or a generator of pieces) in the voice of ``prompt_wav`` whose
        transcript is ``prompt_text``."""
        return self._as_dicts(self.synthesize(
            "zero_shot", tts_text, prompt_text=prompt_text, prompt_wav=prompt_wav, zero_shot_spk_id=zero_shot_spk_id,
            stream=stream, speed=speed, text_frontend=text_frontend, seed=seed))

    def inference_cross_lingual(self, tts_text: str, prompt_wav: AudioSource | None, zero_shot_spk_id: str = "",
                                stream: bool = False, speed: float = 1.0, text_frontend: bool = True, *,
                                seed: int | None = None) -> Iterator[dict]:
        """Speak ``tts_text`` (any language) in the voice of ``prompt_wav``; no transcript needed."""
        return self._as_dicts(self.synthesize(
            "cross_lingual", tts_text, prompt_wav=prompt_wav, zero_shot_spk_id=zero_shot_spk_id, stream=stream,
            speed=speed, text_frontend=text_frontend, seed=seed))

    def inference_instruct2(self, tts_text: TextInput, instruct_text: str, prompt_wav: AudioSource | None,
                            zero_shot_spk_id: str = "", stream: bool = False, speed: float = 1.0,
                            text_frontend: bool = True, *, seed: int | None = None) -> Iterator[dict]:
        """Speak ``tts_text`` (a string or a generator of pieces) in the voice of ``prompt_wav`` following a
        natural-language instruction."""
        return self._as_dicts(self.synthesize(
            "instruct2", tts_text, prompt_wav=prompt_wav, instruct_text=instruct_text,
            zero_shot_spk_id=zero_shot_spk_id, stream=stream, speed=speed, text_frontend=text_frontend, seed=seed))

    def inference_sft(self, tts_text: str, spk_id: str, stream: bool = False, speed: float = 1.0,
                      text_frontend: bool = True, *, seed: int | None = None) -> Iterator[dict]:
        """Speak ``tts_text`` as the saved voice ``spk_id`` (CosyVoice3 has no built-in SFT speakers).

        A voice saved with its transcript is cloned zero-shot; one without, cross-lingually.
        """
        voice = self._saved_voice(spk_id)
        if voice.prompt_text.numel():
            chunks = self.synthesize("zero_shot", tts_text, voice=voice, stream=stream, speed=speed,
                                     text_frontend=text_frontend, seed=seed)
        else:
            if not isinstance(tts_text, str):
                raise InvalidInputError("a saved voice without a transcript cannot speak streamed text; give a string")
            chunks = self.synthesize("cross_lingual", prompts.cross_lingual_text(tts_text), voice=voice, stream=stream,
                                     speed=speed, text_frontend=text_frontend, seed=seed, split_prefixed=True)
        return self._as_dicts(chunks)

    def inference_instruct(self, tts_text: TextInput, spk_id: str, instruct_text: str, stream: bool = False,
                           speed: float = 1.0, text_frontend: bool = True, *,
                           seed: int | None = None) -> Iterator[dict]:
        """Speak ``tts_text`` as the saved voice ``spk_id`` following ``instruct_text``: instruct2 with that voice
        (the instruction is put in CosyVoice3's form, ``You are a helpful assistant. ...<|endofprompt|>``)."""
        if not isinstance(instruct_text, str):
            raise InvalidInputError(f"instruct_text must be a string, got {type(instruct_text).__name__}")
        voice = self._saved_voice(spk_id)
        return self._as_dicts(self.synthesize("instruct2", tts_text, voice=voice, instruct_text=prompts.instruct_text(
            instruct_text), stream=stream, speed=speed, text_frontend=text_frontend, seed=seed))

    def inference_vc(self, source_wav: AudioSource, prompt_wav: AudioSource, stream: bool = False,
                     speed: float = 1.0) -> Iterator[dict]:
        """Voice conversion: the speech of ``source_wav`` (its speech tokens) in the voice of ``prompt_wav``."""
        speed = Engine.check_options(stream, speed)
        wav, rate = self.frontend.load_prompt(_prompt_source(source_wav))
        tokens = self.frontend.speech_tokenizer(resample(wav, rate, TENSOR_PROMPT_RATE))
        features = self.frontend.prompt_features(_prompt_source(prompt_wav))
        empty = torch.zeros(1, 0, dtype=torch.int32)
        inp = ModelInput(text=empty, prompt_text=empty, llm_prompt_speech_token=empty,
                         flow_prompt_speech_token=features.speech_token.to(torch.int32),
                         prompt_speech_feat=features.speech_feat, flow_embedding=features.embedding)
        return self._as_dicts(self.engine.vocode(tokens, inp, stream=stream, speed=speed))


def _pumped(pieces: Iterable[str], writer: TextStreamWriter, chunks: Iterator[AudioChunk]) -> Iterator[AudioChunk]:
    """``chunks``, with a thread feeding ``pieces`` into ``writer`` from the first request for audio on."""
    pump = threading.Thread(target=_pump, args=(iter(pieces), writer), daemon=True, name="cosyvoice-text-pump")
    try:
        pump.start()
        yield from chunks
    finally:
        chunks.close()
        writer.close()


def _same_voice(a: Voice, b: Voice) -> bool:
    ta, tb = {**a.features.tensors(), "t": a.prompt_text}, {**b.features.tensors(), "t": b.prompt_text}
    return all(ta[k].shape == tb[k].shape and torch.equal(ta[k].to(tb[k].dtype), tb[k]) for k in ta)


def _free_key(name: str, taken: Iterable[Any]) -> str:
    """``name``, or ``name 2``, ``name 3``... whichever is not in ``taken``."""
    taken = set(taken)
    key, n = name, 1
    while key in taken:
        n += 1
        key = f"{name} {n}"
    return key


def AutoModel(**kwargs) -> CosyVoice3:  # the official factory's (non-PEP8) name
    """The official factory: picks the model class from the yaml in ``model_dir`` (CosyVoice3 only here)."""
    model_dir = resolve_model_dir(kwargs["model_dir"], kwargs.get("download_root", "pretrained_models"))
    if (model_dir / "cosyvoice3.yaml").is_file():
        return CosyVoice3(**{**kwargs, "model_dir": model_dir})
    for name in ("cosyvoice.yaml", "cosyvoice2.yaml"):
        if (model_dir / name).is_file():
            raise ModelBundleError(f"{model_dir} holds a CosyVoice1/2 model ({name}); this engine runs CosyVoice3 "
                                   "(Fun-CosyVoice3-0.5B-2512) only")
    raise ModelBundleError(f"{model_dir} has no cosyvoice3.yaml: not a CosyVoice3 model directory")
