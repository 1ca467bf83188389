"""The official Python API (``CosyVoice3``, ``AutoModel``) as a thin facade over our engine.

Existing scripts switch by changing one import: method names, arguments and the yielded
``{'tts_speech': tensor[1, N]}`` dicts are those of the official ``cosyvoice.cli.cosyvoice``.
Additions are keyword-only: ``seed=`` for reproducible sampling and :meth:`CosyVoice3.synthesize`,
which yields :class:`~cosyvoice.engine.AudioChunk` with timing and token-range metadata.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from cosyvoice.bundle import open_model_dir, resolve_model_dir
from cosyvoice.engine import AudioChunk, Engine
from cosyvoice.errors import InvalidInputError, ModelBundleError
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import CosyVoiceFrontend, ModelInput, Voice
from cosyvoice.frontend.prompt import PromptFeatures
from cosyvoice.settings import Limits, parse_precision

logger = logging.getLogger(__name__)

Mode = Literal["zero_shot", "cross_lingual", "instruct2"]
SPKINFO_FILE = "spk2info.pt"


class CosyVoice3:
    """Fun-CosyVoice3 text-to-speech, API-compatible with the official ``CosyVoice3``.

    ``model_dir`` is a local model folder or a ModelScope id (downloaded into ``pretrained_models/``).
    ``fp16`` runs the LLM and flow in float16 on CUDA (ignored on CPU, as the reference does); ``dtype``
    ("fp32", "bf16", "fp16") chooses any of the three, also CUDA-only for half precision. The vocoder
    always runs in float32. ``load_trt``, ``load_vllm`` and ``trt_concurrent`` are accepted for drop-in
    compatibility; this engine does not use them.
    """

    def __init__(self, model_dir: str | Path, load_trt: bool = False, load_vllm: bool = False, fp16: bool = False,
                 trt_concurrent: int = 1, *, device: str | torch.device | None = None, dtype: str | None = None,
                 limits: Limits | None = None, download_root: str | Path = "pretrained_models") -> None:
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
        self.engine = Engine(bundle.config, bundle.load_llm(self.device, precision),
                             bundle.load_flow(self.device, precision),
                             bundle.load_hift(self.device), self.device, self.limits,
                             endofprompt_id=self.frontend.tokenizer.end_of_prompt_id)
        self.sample_rate = bundle.config.sample_rate
        self._spk_lock = threading.Lock()
        self.spk2info: dict[str, Voice] = self._load_spkinfo(bundle.root / SPKINFO_FILE)

    # ------------------------------------------------------------------ saved voices

    def list_available_spks(self) -> list[str]:
        with self._spk_lock:
            return list(self.spk2info)

    def add_zero_shot_spk(self, prompt_text: str, prompt_wav: AudioSource, zero_shot_spk_id: str) -> bool:
        """Featurise a prompt once and keep it under ``zero_shot_spk_id`` for later calls."""
        if not isinstance(zero_shot_spk_id, str) or not zero_shot_spk_id.strip():
            raise InvalidInputError("zero_shot_spk_id must be a non-empty name for the saved voice")
        voice = self.frontend.voice(prompt_text, prompt_wav, text_frontend=False)
        with self._spk_lock:
            self.spk2info[zero_shot_spk_id] = voice
        return True

    def save_spkinfo(self) -> None:
        """Write saved voices to ``{model_dir}/spk2info.pt`` in the official format (tensors only)."""
        with self._spk_lock:
            data = {name: _voice_to_official(v) for name, v in self.spk2info.items()}
        torch.save(data, Path(self.model_dir) / SPKINFO_FILE)

    @staticmethod
    def _load_spkinfo(path: Path) -> dict[str, Voice]:
        if not path.is_file():
            return {}
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
            return {str(name): _voice_from_official(entry) for name, entry in raw.items()}
        except Exception as exc:  # a broken voice file must not keep the model from starting
            logger.error("ignoring %s: %s", path, exc)
            return {}

    def _saved_voice(self, spk_id: str) -> Voice:
        with self._spk_lock:
            voice = self.spk2info.get(spk_id)
            known = sorted(self.spk2info)
        if voice is None:
            raise InvalidInputError(f"unknown speaker id {spk_id!r}; saved voices: {known or 'none'} "
                                    "(add one with add_zero_shot_spk)")
        return voice

    # ------------------------------------------------------------------ synthesis

    def synthesize(self, mode: Mode, tts_text: str, *, prompt_text: str = "", prompt_wav: AudioSource | None = None,
                   instruct_text: str = "", zero_shot_spk_id: str = "", voice: Voice | None = None,
                   stream: bool = False, speed: float = 1.0, text_frontend: bool = True, seed: int | None = None,
                   split_prefixed: bool = False) -> Iterator[AudioChunk]:
        """All modes in one call, yielding :class:`AudioChunk` (index and sample offsets run across segments).

        The voice is, in order of precedence: ``voice`` (e.g. from a voice library), the saved
        ``zero_shot_spk_id``, or ``prompt_wav`` (+ ``prompt_text`` for zero-shot). ``split_prefixed``
        splits text after its ``<|endofprompt|>`` into sentences (see ``CosyVoiceFrontend.segments``);
        the official methods leave it off, as the reference does. Every input is validated here, before
        any synthesis, so a bad request fails at the call, not at the first chunk.
        """
        Engine.check_options(stream, speed, seed)
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
        return self._run(segments, inputs, stream, speed, seed)

    def _conditioning(self, mode: Mode, prompt_text: str, prompt_wav: AudioSource | None, instruct_text: str,
                      spk_id: str, text_frontend: bool, voice: Voice | None) -> tuple[Voice, torch.Tensor, bool]:
        """(voice, LLM prompt text ids, whether the LLM continues the voice's speech tokens) for ``mode``."""
        if mode not in ("zero_shot", "cross_lingual", "instruct2"):
            raise InvalidInputError(f"unknown mode {mode!r}; use zero_shot, cross_lingual or instruct2")
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
             seed: int | None) -> Iterator[AudioChunk]:
        index = offset = 0
        for i, (segment, inp) in enumerate(zip(segments, inputs, strict=True)):
            # users' text stays out of INFO logs (privacy); DEBUG shows it when diagnosing
            logger.debug("synthesising segment %d/%d: %s", i + 1, len(segments), segment)
            seg_seed = None if seed is None else (seed + i) % 2**63
            for chunk in self.engine.synthesize(inp, stream=stream, speed=speed, seed=seg_seed,
                                                sample_offset=offset, first_index=index):
                index, offset = chunk.index + 1, chunk.sample_offset + chunk.pcm.numel()
                yield chunk

    @staticmethod
    def _as_dicts(chunks: Iterator[AudioChunk]) -> Iterator[dict[str, torch.Tensor]]:
        for chunk in chunks:
            yield {"tts_speech": chunk.pcm.unsqueeze(0)}

    def inference_zero_shot(self, tts_text: str, prompt_text: str, prompt_wav: AudioSource | None,
                            zero_shot_spk_id: str = "", stream: bool = False, speed: float = 1.0,
                            text_frontend: bool = True, *, seed: int | None = None) -> Iterator[dict]:
        """Speak ``tts_text`` in the voice of ``prompt_wav`` whose transcript is ``prompt_text``."""
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

    def inference_instruct2(self, tts_text: str, instruct_text: str, prompt_wav: AudioSource | None,
                            zero_shot_spk_id: str = "", stream: bool = False, speed: float = 1.0,
                            text_frontend: bool = True, *, seed: int | None = None) -> Iterator[dict]:
        """Speak ``tts_text`` in the voice of ``prompt_wav`` following a natural-language instruction."""
        return self._as_dicts(self.synthesize(
            "instruct2", tts_text, prompt_wav=prompt_wav, instruct_text=instruct_text,
            zero_shot_spk_id=zero_shot_spk_id, stream=stream, speed=speed, text_frontend=text_frontend, seed=seed))


def _voice_to_official(voice: Voice) -> dict[str, torch.Tensor]:
    f = voice.features
    def length(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[1]], dtype=torch.int32)

    return {
        "prompt_text": voice.prompt_text, "prompt_text_len": length(voice.prompt_text),
        "llm_prompt_speech_token": f.speech_token, "llm_prompt_speech_token_len": length(f.speech_token),
        "flow_prompt_speech_token": f.speech_token, "flow_prompt_speech_token_len": length(f.speech_token),
        "prompt_speech_feat": f.speech_feat, "prompt_speech_feat_len": length(f.speech_feat),
        "llm_embedding": f.embedding, "flow_embedding": f.embedding,
    }


def _voice_from_official(entry: dict[str, torch.Tensor]) -> Voice:
    features = PromptFeatures(speech_feat=entry["prompt_speech_feat"], speech_token=entry["flow_prompt_speech_token"],
                              embedding=entry["flow_embedding"])
    return Voice(features, entry.get("prompt_text", torch.zeros(1, 0, dtype=torch.int32)).to(torch.int32))


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
