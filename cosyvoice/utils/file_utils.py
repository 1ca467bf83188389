"""``cosyvoice.utils.file_utils`` as official scripts import it: ``load_wav`` and ``logging``."""

from __future__ import annotations

import logging

import torch

from cosyvoice.errors import InvalidInputError
from cosyvoice.frontend.audio import AudioSource, decode_audio, downmix, resample

__all__ = ["load_wav", "logging"]  # the official module re-exports the configured ``logging`` module


def load_wav(wav: AudioSource, target_sr: int, min_sr: int = 16000) -> torch.Tensor:
    """Mono float32 audio ``[1, N]`` at ``target_sr`` from a path, file-like, bytes or (array, rate) pair.

    As the official function: channels are averaged, other rates resampled, and a file sampled below
    ``min_sr`` is refused (here with :class:`InvalidInputError` instead of an assertion).
    """
    samples, sample_rate = decode_audio(wav)
    speech = downmix(samples)
    if sample_rate != target_sr:
        if sample_rate < min_sr:
            raise InvalidInputError(f"the audio is sampled at {sample_rate} Hz; at least {min_sr} Hz is needed")
        speech = resample(speech, sample_rate, target_sr)
    return speech
