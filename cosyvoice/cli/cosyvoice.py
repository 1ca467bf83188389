"""The official Python API (``CosyVoice3``, ``AutoModel``): an adapter over the service layer.

Existing scripts switch by changing one import: method names, arguments and the yielded
``{'tts_speech': tensor[1, N]}`` dicts are those of the official ``cosyvoice.cli.cosyvoice``. Each call is
translated into one :class:`~cosyvoice.service.SynthesisRequest` and run by the :class:`TTSService` every
server and the web UI use: validation, admission, voices, segmenting and seeding happen there, once. The
official conventions are kept: prompts come in the model's form (``<|endofprompt|>`` required, nothing added),
text carrying the marker is one unnormalised piece, a bare float tensor prompt is 16 kHz audio, and an
unseeded call draws its seed from torch's global generator.

Additions are keyword-only: ``seed=`` for reproducible sampling and the flow's schedule (``steps=``, ``final=``,
``first_hop=``: :class:`Schedule`) on every synthesis method, :meth:`CosyVoice3.synthesize`, which
yields :class:`~cosyvoice.engine.AudioChunk` with timing and token-range metadata, and
:meth:`CosyVoice3.synthesize_stream` for text that arrives over time (a chat model's output, a WebSocket).

Saved voices (``add_zero_shot_spk``, ``save_spkinfo``, ``zero_shot_spk_id=``) are the named voices of the
service's :class:`~cosyvoice.voices.VoiceLibrary`; ``{model_dir}/spk2info.pt`` is imported at start-up and
written by ``save_spkinfo`` without ever dropping an entry (:mod:`cosyvoice.spkinfo`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import numpy as np
import torch

from cosyvoice.bundle import resolve_model_dir
from cosyvoice.engine import AudioChunk, CancelToken, Engine
from cosyvoice.errors import InvalidInputError, ModelBundleError, NotFoundError
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import CosyVoiceFrontend, Voice
from cosyvoice.pipeline import Model, TextFeed, TextStreamClosedError
from cosyvoice.service import TENSOR_PROMPT_RATE, SynthesisRequest, SynthesisSession, TTSService
from cosyvoice.settings import Limits, default_voice_dir
from cosyvoice.spkinfo import SPKINFO_FILE, SpeakerFile
from cosyvoice.voices import VoiceLibrary

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack

logger = logging.getLogger(__name__)

Mode = Literal["zero_shot", "cross_lingual", "instruct2"]
#: text given as pieces: any iterable of str that is not itself a str (a generator, a list, ...)
TextInput = str | Iterable[str]
#: the official parameter each service field comes from, for error messages that name what the caller passed
_OFFICIAL_FIELDS = {"text": "tts_text", "transcript": "prompt_text", "prompt_audio": "prompt_wav",
                    "instruction": "instruct_text", "voice": "zero_shot_spk_id"}

__all__ = ["AutoModel", "CosyVoice3", "Schedule", "TextFeed", "TextStreamClosedError"]


class Schedule(TypedDict, total=False):
    """The flow's schedule of one call, each left out for the reference's, so takes made from a script can be
    compared in a blind A/B test: ``steps`` (Euler steps), ``final`` (``"full"``: the last flow call over the whole
    utterance, as the reference; ``"chunked"``: chunk-causal, constant cost per second) and ``first_hop`` (speech
    tokens of the first chunk: fewer start the audio sooner). Checked by the service as every server's are."""

    steps: int | None
    final: str | None
    first_hop: int | None


def _is_text_stream(text: object) -> bool:
    return not isinstance(text, (str, bytes, bytearray)) and isinstance(text, Iterable)


def _prompt_source(prompt_wav: Any) -> Any:
    """The official wire form of a prompt, as the service takes it: a bare float tensor / array ``[N]`` or
    ``[1, N]`` is 16 kHz audio (the official servers' convention); ``''`` or None is no prompt."""
    if prompt_wav is None or (isinstance(prompt_wav, str) and not prompt_wav):
        return None
    if isinstance(prompt_wav, (torch.Tensor, np.ndarray)):
        is_float = prompt_wav.is_floating_point() if isinstance(prompt_wav, torch.Tensor) else \
            np.issubdtype(prompt_wav.dtype, np.floating)
        if not is_float or prompt_wav.ndim not in (1, 2) or (prompt_wav.ndim == 2 and prompt_wav.shape[0] != 1):
            raise InvalidInputError(f"a prompt given as a tensor must be float samples [N] or [1, N] at "
                                    f"{TENSOR_PROMPT_RATE} Hz, got {prompt_wav.dtype} of shape "
                                    f"{tuple(prompt_wav.shape)}", "prompt_wav")
        return prompt_wav.reshape(-1), TENSOR_PROMPT_RATE
    return prompt_wav


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
    a CPU, torch on CUDA; :mod:`cosyvoice.backends`). ``precision`` (CPU): fp32, bf16 or int8 weights for the
    LLM and the DiT, or auto (default ``COSYVOICE_PRECISION``, else fp32; :mod:`cosyvoice.backends.precision`).
    """

    def __init__(self, model_dir: str | Path, load_trt: bool = False, load_vllm: bool = False, fp16: bool = False,
                 trt_concurrent: int = 1, *, device: str | torch.device | None = None, dtype: str | None = None,
                 limits: Limits | None = None, download_root: str | Path = "pretrained_models",
                 voice_dir: str | Path | None = None, backend: str | None = None,
                 precision: str | None = None) -> None:
        self.service = TTSService.load(model_dir, voice_dir if voice_dir is not None else default_voice_dir(),
                                       device=device, dtype=dtype or ("fp16" if fp16 else "fp32"), limits=limits,
                                       download_root=download_root, backend=backend, precision=precision)
        self.model: Model = self.service.model
        self.model_dir, self.device, self.limits = self.model.model_dir, self.model.device, self.model.limits
        if (load_trt or load_vllm) and self.device.type == "cuda":
            logger.warning("load_trt/load_vllm are not used by this engine; running the PyTorch modules")
        self.fp16 = self.model.precision == torch.float16
        self.sample_rate = self.model.sample_rate
        self.voices = self.service.voices
        self.speakers = SpeakerFile(Path(self.model_dir) / SPKINFO_FILE, self.voices)
        self.speakers.load()

    @property
    def frontend(self) -> CosyVoiceFrontend:
        return self.model.frontend

    @property
    def engine(self) -> Engine:
        return self.model.engine

    # ------------------------------------------------------------------ saved voices (official spk2info)

    @property
    def spk2info(self) -> Mapping[str, Voice]:
        """Saved voices by speaker id (read-only; add with ``add_zero_shot_spk``)."""
        return _SavedVoices(self.voices)

    def list_available_spks(self) -> list[str]:
        """Speaker ids usable as ``spk_id`` / ``zero_shot_spk_id`` (see :meth:`unusable_spks` for the rest)."""
        return [info.name for info in self.voices.named()]

    def unusable_spks(self) -> dict[str, str]:
        """Entries of ``spk2info.pt`` this model cannot use, with the reason; they are kept and written back."""
        return self.speakers.unusable()

    def add_zero_shot_spk(self, prompt_text: str, prompt_wav: AudioSource, zero_shot_spk_id: str) -> bool:
        """Featurise a prompt once and keep it under ``zero_shot_spk_id`` (replacing a voice of that id)."""
        self.speakers.add(prompt_text, _prompt_source(prompt_wav), zero_shot_spk_id)
        return True

    def save_spkinfo(self) -> None:
        """Write the saved voices to ``{model_dir}/spk2info.pt`` in the official format, atomically, merged
        with what other processes wrote there meanwhile (:class:`~cosyvoice.spkinfo.SpeakerFile`)."""
        self.speakers.save()

    # ------------------------------------------------------------------ synthesis

    def synthesize(self, mode: Mode, tts_text: TextInput, *, prompt_text: str = "",
                   prompt_wav: AudioSource | None = None, instruct_text: str = "", zero_shot_spk_id: str = "",
                   stream: bool = False, speed: float = 1.0, text_frontend: bool = True, seed: int | None = None,
                   split_prefixed: bool = False, cancel: CancelToken | None = None,
                   **schedule: Unpack[Schedule]) -> SynthesisSession:
        """All modes in one call, yielding :class:`AudioChunk` (index and sample offsets run across segments).

        The voice is the saved ``zero_shot_spk_id`` if given, else ``prompt_wav`` (+ ``prompt_text`` for
        zero-shot). ``split_prefixed`` splits text after its ``<|endofprompt|>`` into sentences; the official
        methods leave it off, as the reference does. ``tts_text`` may be an iterable of text pieces (a
        generator) in zero-shot and instruct2 mode: it is read on a thread of its own as the speech goes (see
        :meth:`synthesize_stream`). Every input is validated at the call, before any synthesis; ``cancel``
        ends the request from any thread (within one LLM step).
        """
        request = self._request(mode, "" if _is_text_stream(tts_text) else tts_text, prompt_text, prompt_wav,
                                instruct_text, zero_shot_spk_id, stream, speed, text_frontend, seed, split_prefixed,
                                schedule)
        with _official_errors(zero_shot_spk_id, self):
            if _is_text_stream(tts_text):
                return self.service.synthesize_text_stream(request, tts_text, cancel=cancel)
            return self.service.synthesize(request, cancel=cancel)

    def synthesize_stream(self, mode: Mode, *, prompt_text: str = "", prompt_wav: AudioSource | None = None,
                          instruct_text: str = "", zero_shot_spk_id: str = "", stream: bool = True,
                          speed: float = 1.0, text_frontend: bool = True, seed: int | None = None,
                          cancel: CancelToken | None = None,
                          **schedule: Unpack[Schedule]) -> tuple[TextFeed, SynthesisSession]:
        """Speech for text that arrives over time: ``(writer, chunks)``.

        Write pieces with ``writer.write(text)`` from any thread and end with ``writer.close()`` (or
        ``writer.close(exc)`` to fail the request); iterate ``chunks`` for the audio, which starts before the
        text is complete (the reference's bi-streaming algorithm: 5 text tokens to 15 speech tokens). Modes:
        zero-shot and instruct2 (their prompt text carries ``<|endofprompt|>``, which the algorithm needs).
        Closing ``chunks`` ends the request and makes further writes raise :class:`TextStreamClosedError`.
        """
        request = self._request(mode, "", prompt_text, prompt_wav, instruct_text, zero_shot_spk_id, stream, speed,
                                text_frontend, seed, False, schedule)
        with _official_errors(zero_shot_spk_id, self):
            session = self.service.synthesize_text_stream(request, cancel=cancel)
        return session.writer, session

    def _request(self, mode: Mode, text: str, prompt_text: str, prompt_wav: AudioSource | None, instruct_text: str,
                 spk_id: str, stream: bool, speed: float, text_frontend: bool, seed: int | None,
                 split_prefixed: bool, schedule: Schedule) -> SynthesisRequest:
        """The official call as a service request: prompts verbatim (``prompt_conventions=False``)."""
        if mode not in ("zero_shot", "cross_lingual", "instruct2"):
            raise InvalidInputError(f"unknown mode {mode!r}; use zero_shot, cross_lingual or instruct2", "mode")
        return SynthesisRequest(text, mode, voice=spk_id or None,
                                prompt_audio=None if spk_id else _prompt_source(prompt_wav), transcript=prompt_text,
                                instruction=instruct_text, speed=speed, seed=seed, stream=stream,
                                text_frontend=text_frontend, split_prefixed=split_prefixed, prompt_conventions=False,
                                **schedule)

    @staticmethod
    def _as_dicts(chunks: Iterator[AudioChunk]) -> Iterator[dict[str, torch.Tensor]]:
        for chunk in chunks:
            yield {"tts_speech": chunk.pcm.unsqueeze(0)}

    def inference_zero_shot(self, tts_text: TextInput, prompt_text: str, prompt_wav: AudioSource | None,
                            zero_shot_spk_id: str = "", stream: bool = False, speed: float = 1.0,
                            text_frontend: bool = True, *, seed: int | None = None,
                            **schedule: Unpack[Schedule]) -> Iterator[dict]:
        """Speak ``tts_text`` (a string or a generator of pieces) in the voice of ``prompt_wav`` whose
        transcript is ``prompt_text``."""
        return self._as_dicts(self.synthesize(
            "zero_shot", tts_text, prompt_text=prompt_text, prompt_wav=prompt_wav, zero_shot_spk_id=zero_shot_spk_id,
            stream=stream, speed=speed, text_frontend=text_frontend, seed=seed, **schedule))

    def inference_cross_lingual(self, tts_text: str, prompt_wav: AudioSource | None, zero_shot_spk_id: str = "",
                                stream: bool = False, speed: float = 1.0, text_frontend: bool = True, *,
                                seed: int | None = None, **schedule: Unpack[Schedule]) -> Iterator[dict]:
        """Speak ``tts_text`` (any language) in the voice of ``prompt_wav``; no transcript needed."""
        return self._as_dicts(self.synthesize(
            "cross_lingual", tts_text, prompt_wav=prompt_wav, zero_shot_spk_id=zero_shot_spk_id, stream=stream,
            speed=speed, text_frontend=text_frontend, seed=seed, **schedule))

    def inference_instruct2(self, tts_text: TextInput, instruct_text: str, prompt_wav: AudioSource | None,
                            zero_shot_spk_id: str = "", stream: bool = False, speed: float = 1.0,
                            text_frontend: bool = True, *, seed: int | None = None,
                            **schedule: Unpack[Schedule]) -> Iterator[dict]:
        """Speak ``tts_text`` (a string or a generator of pieces) in the voice of ``prompt_wav`` following a
        natural-language instruction."""
        return self._as_dicts(self.synthesize(
            "instruct2", tts_text, prompt_wav=prompt_wav, instruct_text=instruct_text,
            zero_shot_spk_id=zero_shot_spk_id, stream=stream, speed=speed, text_frontend=text_frontend, seed=seed,
            **schedule))

    def inference_sft(self, tts_text: str, spk_id: str, stream: bool = False, speed: float = 1.0,
                      text_frontend: bool = True, *, seed: int | None = None,
                            **schedule: Unpack[Schedule]) -> Iterator[dict]:
        """Speak ``tts_text`` as the saved voice ``spk_id`` (CosyVoice3 has no built-in SFT speakers).

        A voice saved with its transcript is cloned zero-shot; one without, cross-lingually.
        """
        request = SynthesisRequest("" if _is_text_stream(tts_text) else tts_text, "sft", voice=spk_id, speed=speed,
                                   seed=seed, stream=stream, text_frontend=text_frontend, **schedule)
        with _official_errors(spk_id, self):
            if _is_text_stream(tts_text):
                return self._as_dicts(self.service.synthesize_text_stream(request, tts_text))
            return self._as_dicts(self.service.synthesize(request))

    def inference_instruct(self, tts_text: TextInput, spk_id: str, instruct_text: str, stream: bool = False,
                           speed: float = 1.0, text_frontend: bool = True, *,
                           seed: int | None = None, **schedule: Unpack[Schedule]) -> Iterator[dict]:
        """Speak ``tts_text`` as the saved voice ``spk_id`` following ``instruct_text``: instruct2 with that voice
        (the instruction is put in CosyVoice3's form, ``You are a helpful assistant. ...<|endofprompt|>``)."""
        request = SynthesisRequest("" if _is_text_stream(tts_text) else tts_text, "instruct", voice=spk_id,
                                   instruction=instruct_text, speed=speed, seed=seed, stream=stream,
                                   text_frontend=text_frontend, **schedule)
        with _official_errors(spk_id, self):
            if _is_text_stream(tts_text):
                return self._as_dicts(self.service.synthesize_text_stream(request, tts_text))
            return self._as_dicts(self.service.synthesize(request))

    def inference_vc(self, source_wav: AudioSource, prompt_wav: AudioSource, stream: bool = False,
                     speed: float = 1.0) -> Iterator[dict]:
        """Voice conversion: the speech of ``source_wav`` (its speech tokens) in the voice of ``prompt_wav``."""
        return self._as_dicts(self.service.convert_voice(_prompt_source(source_wav), _prompt_source(prompt_wav),
                                                         stream=stream, speed=speed))


@contextlib.contextmanager
def _official_errors(spk_id: str, api: CosyVoice3) -> Iterator[None]:
    """Service errors in the official API's words: fields named as its parameters, unknown speakers listed."""
    try:
        yield
    except NotFoundError as exc:
        if exc.field != "voice" or not spk_id:
            raise
        reason = api.unusable_spks().get(spk_id)
        if reason is not None:
            raise InvalidInputError(f"speaker {spk_id!r} of spk2info.pt cannot be used with this model ({reason}); "
                                    "it is kept in the file unchanged", "zero_shot_spk_id") from exc
        known = api.list_available_spks()
        raise InvalidInputError(f"unknown speaker id {spk_id!r}; saved voices: {known or 'none'} (add one with "
                                "add_zero_shot_spk)", "zero_shot_spk_id") from exc
    except InvalidInputError as exc:
        exc.field = _OFFICIAL_FIELDS.get(exc.field, exc.field)
        raise


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


# the official module also defines the older generations' classes; official scripts import them (issue 12 item 15)
from cosyvoice.cli.legacy import CosyVoice, CosyVoice2  # noqa: E402, F401
