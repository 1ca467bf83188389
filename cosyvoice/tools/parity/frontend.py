"""Parity of the audio/prompt frontend against ``frontend.safetensors`` of a golden folder.

Everything starts from the golden prompt wav and the bundle's ONNX models, so each row tests our whole
path up to that point (decode -> resample -> features -> ONNX), not a single function fed golden inputs.
The text-side rows (``zs_text``, ``zs_prompt_text``) belong to the text frontend's check.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from cosyvoice.config import load_config
from cosyvoice.frontend.audio import decode_audio, downmix, resample
from cosyvoice.frontend.features import WHISPER_SAMPLE_RATE, MelParams, kaldi_fbank, prompt_mel, whisper_log_mel
from cosyvoice.frontend.onnx_models import CampPlus, SpeechTokenizer
from cosyvoice.frontend.prompt import extract_prompt_features
from cosyvoice.tools.parity.common import Golden, Result, compare, compare_exact
from cosyvoice.tools.parity.tolerances import FEATURE_ATOL, FEATURE_RTOL

COMPONENT = "frontend"
FILE = "frontend.safetensors"

# Near-silent STFT bins are dominated by float32 FFT rounding, which MKL makes CPU-dependent (~5e-4 in log
# units); the fixtures match MKL's reproducible code path, selected by this variable before torch starts.
_MKL_HINT = "set MKL_CBWR=COMPATIBLE before importing torch (MKL FFT rounding is CPU-dependent)"


def prompt_wav_path(golden: Golden) -> Path:
    """The prompt file the fixtures were made from: ``_config.prompt.file``, else the folder's only wav."""
    name = golden.manifest.get("_config", {}).get("prompt", {}).get("file")
    if name:
        return golden.root / name
    wavs = sorted(golden.root.glob("*.wav"))
    if len(wavs) != 1:
        raise FileNotFoundError(f"{golden.root}: cannot tell the prompt wav ({len(wavs)} *.wav files, no "
                                "_config.prompt.file in manifest.json)")
    return wavs[0]


def check(golden: Golden) -> list[Result]:
    ref = golden.arrays(FILE)
    cfg = load_config(golden.bundle_dir)
    mel_params = MelParams.from_model_dir(golden.bundle_dir)
    tokenizer = SpeechTokenizer.from_model_dir(golden.bundle_dir)
    campplus = CampPlus.from_model_dir(golden.bundle_dir)

    samples, sample_rate = decode_audio(prompt_wav_path(golden))
    wav = downmix(samples)
    with torch.inference_mode():
        wav_16k = resample(wav, sample_rate, WHISPER_SAMPLE_RATE)
        log_mel = whisper_log_mel(wav_16k, n_mels=tokenizer.n_mels)
        fbank = kaldi_fbank(wav_16k, num_mel_bins=campplus.num_mel_bins)
        ours = {
            "wav_16k": wav_16k,
            "speech_feat_mel80": prompt_mel(resample(wav, sample_rate, cfg.sample_rate), mel_params).transpose(1, 2),
            "whisper_logmel128": log_mel,
            "speech_tokens": tokenizer.tokenize_log_mel(log_mel),
            "kaldi_fbank80_raw": fbank,
            "campplus_embedding": campplus.embed_fbank(fbank - fbank.mean(dim=0, keepdim=True)),
        }
        prompt = extract_prompt_features(wav, sample_rate, tokenizer, campplus, cfg.sample_rate,
                                         mel_params=mel_params, token_mel_ratio=cfg.token_mel_ratio)
    ours.update({
        "zs_prompt_speech_feat": prompt.speech_feat,
        "zs_llm_prompt_speech_token": prompt.speech_token,
        "zs_flow_prompt_speech_token": prompt.speech_token,
        "zs_llm_embedding": prompt.embedding,
    })

    results = []
    for name, value in ours.items():
        if name not in ref:
            continue
        if ref[name].dtype.kind in "iu":
            results.append(compare_exact(COMPONENT, name, value, ref[name]))
            continue
        result = compare(COMPONENT, name, value, ref[name], FEATURE_ATOL, FEATURE_RTOL)
        if not result.passed and os.environ.get("MKL_CBWR") is None:
            result = dataclasses.replace(result, note=_MKL_HINT)
        results.append(result)
    return results
