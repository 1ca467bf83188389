"""From a decoded voice prompt to the three tensors zero-shot synthesis conditions on.

The official zero-shot frontend derives them from two resampled copies of the prompt: 16 kHz audio for the
speech tokenizer and the speaker encoder, and audio at the model rate for the flow's mel prompt. It then
trims mel and tokens so there are exactly ``token_mel_ratio`` mel frames per token, because the flow model
lays prompt mel frames and upsampled prompt tokens side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cosyvoice.errors import ConfigError, InvalidInputError
from cosyvoice.frontend.audio import resample
from cosyvoice.frontend.features import WHISPER_SAMPLE_RATE, MelParams, prompt_mel
from cosyvoice.frontend.onnx_models import CampPlus, SpeechTokenizer


@dataclass(frozen=True)
class PromptFeatures:
    """A voice prompt reduced to what synthesis needs; this is what a voice cache stores.

    speech_feat:  [1, T_mel, 80] float32 natural-log mel at the model rate (flow prompt)
    speech_token: [1, T_tok] int32 speech tokens (LLM and flow prompt), T_mel = token_mel_ratio * T_tok
    embedding:    [1, 192] float32 CAM++ speaker embedding, not normalised (the flow normalises it)
    """

    speech_feat: torch.Tensor
    speech_token: torch.Tensor
    embedding: torch.Tensor

    def __post_init__(self) -> None:
        if self.speech_feat.dim() != 3 or self.speech_feat.shape[0] != 1:
            raise InvalidInputError(f"speech_feat must be [1, T, n_mels], got {tuple(self.speech_feat.shape)}")
        if self.speech_token.dim() != 2 or self.speech_token.shape[0] != 1 or self.speech_token.is_floating_point():
            raise InvalidInputError(f"speech_token must be integer [1, T], got {tuple(self.speech_token.shape)} "
                                    f"{self.speech_token.dtype}")
        if self.embedding.dim() != 2 or self.embedding.shape[0] != 1:
            raise InvalidInputError(f"embedding must be [1, D], got {tuple(self.embedding.shape)}")

    def to(self, device: torch.device | str) -> PromptFeatures:
        return PromptFeatures(self.speech_feat.to(device), self.speech_token.to(device), self.embedding.to(device))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor mapping (e.g. for ``safetensors.torch.save_file``)."""
        return {"speech_feat": self.speech_feat, "speech_token": self.speech_token, "embedding": self.embedding}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> PromptFeatures:
        missing = {"speech_feat", "speech_token", "embedding"} - tensors.keys()
        if missing:
            raise InvalidInputError(f"stored prompt features lack {sorted(missing)}")
        return cls(tensors["speech_feat"], tensors["speech_token"], tensors["embedding"])


def extract_prompt_features(wav: torch.Tensor | np.ndarray, sample_rate: int, tokenizer: SpeechTokenizer,
                            campplus: CampPlus, target_sr: int = 24000, *, mel_params: MelParams | None = None,
                            token_mel_ratio: int = 2) -> PromptFeatures:
    """Mono prompt audio [1, N] (or [N]) at ``sample_rate`` -> :class:`PromptFeatures` (tensors on CPU).

    ``mel_params`` is the model dir's ``feat_extractor`` (defaults: the released 24 kHz model); its sample
    rate must be ``target_sr``. Validate user audio first (``audio.load_prompt_audio``); this function
    computes features for whatever it is given.
    """
    mel_params = mel_params or MelParams()
    if mel_params.sample_rate != target_sr:
        raise ConfigError(f"the prompt mel is configured for {mel_params.sample_rate} Hz but the model runs at "
                          f"{target_sr} Hz")
    wav = (wav if isinstance(wav, torch.Tensor) else torch.from_numpy(np.asarray(wav))).to(torch.float32)
    wav = wav.reshape(1, -1)
    wav_16k = resample(wav, sample_rate, WHISPER_SAMPLE_RATE)
    speech_feat = prompt_mel(resample(wav, sample_rate, target_sr), mel_params).transpose(1, 2).cpu()
    speech_token = tokenizer(wav_16k)
    embedding = campplus(wav_16k)
    if target_sr != 24000:  # the reference aligns mel and tokens only for 24 kHz models (all released CosyVoice3)
        return PromptFeatures(speech_feat=speech_feat.contiguous(), speech_token=speech_token, embedding=embedding)
    n_tokens = min(speech_feat.shape[1] // token_mel_ratio, speech_token.shape[1])
    return PromptFeatures(speech_feat=speech_feat[:, :token_mel_ratio * n_tokens].contiguous(),
                          speech_token=speech_token[:, :n_tokens].contiguous(), embedding=embedding)
