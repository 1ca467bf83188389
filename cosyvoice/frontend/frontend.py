"""The frontend of one model: text and prompt audio in, the engine's :class:`ModelInput` out.

It owns the model dir's tokenizer, the text normaliser, the two ONNX models (sessions created once)
and the prompt limits, so every adapter turns user input into model input the same way. It does not
know about streaming or devices: everything it returns lives on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cosyvoice.bundle import ModelBundle
from cosyvoice.frontend.audio import AudioSource, load_prompt_audio
from cosyvoice.frontend.features import MelParams
from cosyvoice.frontend.onnx_models import CampPlus, SpeechTokenizer
from cosyvoice.frontend.prompt import PromptFeatures, extract_prompt_features
from cosyvoice.frontend.text import TextFrontend
from cosyvoice.frontend.tokenizer import CosyVoice3Tokenizer
from cosyvoice.settings import Limits


@dataclass(frozen=True)
class ModelInput:
    """What the engine needs for one text segment (the reference's ``model_input``), on the CPU."""

    text: torch.Tensor  # [1, T_text] token ids of the text to speak
    prompt_text: torch.Tensor  # [1, T_p] ids of the prompt transcript / instruction (may be empty)
    llm_prompt_speech_token: torch.Tensor  # [1, T_s] prompt speech tokens the LLM continues (may be empty)
    flow_prompt_speech_token: torch.Tensor  # [1, T_f] prompt speech tokens the flow conditions on
    prompt_speech_feat: torch.Tensor  # [1, ratio*T_f, 80] prompt mel
    flow_embedding: torch.Tensor  # [1, 192] CAM++ speaker embedding


@dataclass(frozen=True)
class Voice:
    """A prompt voice ready for synthesis: its features and its transcript's token ids (may be empty)."""

    features: PromptFeatures
    prompt_text: torch.Tensor  # [1, T_p] int32


def _ids(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.int32).reshape(1, -1)


class CosyVoiceFrontend:
    """Tokenizer + text normaliser + prompt feature extraction for one model directory."""

    def __init__(self, bundle: ModelBundle, limits: Limits, providers: list[str] | None = None) -> None:
        self.limits = limits
        self.sample_rate = bundle.config.sample_rate
        self.token_mel_ratio = bundle.config.flow.token_mel_ratio
        self.tokenizer = CosyVoice3Tokenizer(bundle.tokenizer_dir)
        self.text = TextFrontend(self.tokenizer)
        self.speech_tokenizer = SpeechTokenizer(bundle.speech_tokenizer_path, providers=providers,
                                                max_seconds=limits.max_prompt_seconds)
        self.campplus = CampPlus(bundle.campplus_path, providers=providers)
        self.mel_params = MelParams.from_model_dir(bundle.root)

    # ------------------------------------------------------------------ text

    def encode(self, text: str) -> torch.Tensor:
        return _ids(self.tokenizer.encode(text, allowed_special="all"))

    # ------------------------------------------------------------------ prompt audio

    def prompt_features(self, prompt_wav: AudioSource) -> PromptFeatures:
        """Decode, validate and featurise a prompt recording (path, file-like, bytes or (array, rate))."""
        wav, sample_rate = self.load_prompt(prompt_wav)
        return self.features(wav, sample_rate)

    def load_prompt(self, prompt_wav: AudioSource) -> tuple[torch.Tensor, int]:
        """Decode and validate a prompt recording against the limits: mono [1, N] at its own rate."""
        limits = self.limits
        return load_prompt_audio(prompt_wav, min_sample_rate=limits.min_prompt_sample_rate,
                                 min_seconds=limits.min_prompt_seconds, max_seconds=limits.max_prompt_seconds,
                                 max_bytes=limits.max_prompt_bytes, max_channels=limits.max_prompt_channels,
                                 max_sample_rate=limits.max_prompt_sample_rate)

    def features(self, wav: torch.Tensor, sample_rate: int) -> PromptFeatures:
        """Prompt features of audio that :meth:`load_prompt` accepted."""
        return extract_prompt_features(wav, sample_rate, self.speech_tokenizer, self.campplus, self.sample_rate,
                                       mel_params=self.mel_params, token_mel_ratio=self.token_mel_ratio)

    def voice(self, prompt_text: str, prompt_wav: AudioSource) -> Voice:
        """A :class:`Voice` from a recording and its transcript (``''`` for modes that use no transcript)."""
        return self.voice_from(self.prompt_features(prompt_wav), prompt_text)

    def voice_from(self, features: PromptFeatures, prompt_text: str) -> Voice:
        """A :class:`Voice` from already computed features and the transcript, tokenised as written (the
        reference never normalises a transcript: it carries the system prompt's markup there)."""
        return Voice(features=features, prompt_text=self.encode(prompt_text))

    # ------------------------------------------------------------------ model input per mode

    def model_input(self, segment: str, voice: Voice, prompt_text: torch.Tensor | None = None,
                    llm_prompt_speech: bool = True, head: torch.Tensor | None = None) -> ModelInput:
        """Model input for one normalised text segment, its ids after ``head`` (ids, e.g. a system prompt).

        zero-shot: the voice's transcript + speech tokens prompt the LLM; cross-lingual: neither
        (``prompt_text`` empty, ``llm_prompt_speech=False``); instruct2: the instruction replaces the
        transcript and the LLM gets no prompt speech. The flow is always prompted with the voice.
        """
        f = voice.features
        speech = f.speech_token.to(torch.int32)
        empty = torch.zeros(1, 0, dtype=torch.int32)
        text = self.encode(segment)
        return ModelInput(
            text=text if head is None or not head.numel() else torch.cat([head, text], dim=1),
            prompt_text=voice.prompt_text if prompt_text is None else prompt_text,
            llm_prompt_speech_token=speech if llm_prompt_speech else empty,
            flow_prompt_speech_token=speech,
            prompt_speech_feat=f.speech_feat,
            flow_embedding=f.embedding,
        )
