"""Spectral features of the prompt audio, reimplemented to match the official frontend.

Three feature extractors feed three different consumers:

* :func:`prompt_mel` — the 80-bin log-mel the flow model is conditioned on (Matcha-TTS recipe, 24 kHz);
* :func:`whisper_log_mel` — the 128-bin Whisper log-mel the speech tokenizer reads (16 kHz);
* :func:`kaldi_fbank` — Kaldi-style log filterbanks the CAM++ speaker encoder reads (16 kHz).

Every constant and every float32 step order follows the reference pipelines, so outputs agree with the
golden fixtures to ~1e-6. Mel bases and windows are cached per (parameters, device, dtype): the reference
caches Matcha's basis by ``fmax`` and device only, which silently reuses a wrong basis when two
configurations share an ``fmax``; we key by every parameter instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cosyvoice.config import Tagged, read_hyperpyyaml
from cosyvoice.errors import ConfigError

# ----------------------------------------------------------------------------- Slaney mel filterbank (numpy)

_SLANEY_LINEAR_STEP_HZ = 200.0 / 3.0  # mel spacing of the linear part below 1 kHz
_SLANEY_LOG_START_HZ = 1000.0
_SLANEY_LOG_START_MEL = _SLANEY_LOG_START_HZ / _SLANEY_LINEAR_STEP_HZ
_SLANEY_LOG_STEP = math.log(6.4) / 27.0  # 27 mels per factor 6.4 above 1 kHz


def _hz_to_slaney_mel(hz: float) -> float:
    if hz < _SLANEY_LOG_START_HZ:
        return hz / _SLANEY_LINEAR_STEP_HZ
    return _SLANEY_LOG_START_MEL + math.log(hz / _SLANEY_LOG_START_HZ) / _SLANEY_LOG_STEP


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    linear = mel * _SLANEY_LINEAR_STEP_HZ
    logarithmic = _SLANEY_LOG_START_HZ * np.exp(_SLANEY_LOG_STEP * (mel - _SLANEY_LOG_START_MEL))
    return np.where(mel >= _SLANEY_LOG_START_MEL, logarithmic, linear)


@lru_cache(maxsize=16)
def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                          fmax: float | None = None) -> np.ndarray:
    """Triangular filters on the Slaney mel scale, area-normalised ("slaney" norm), [n_mels, n_fft//2+1] float32.

    This is the basis librosa builds by default (htk=False, norm='slaney'), which both Matcha and
    Whisper use. The result is cached and read-only.
    """
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    bin_hz = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    edges_mel = np.linspace(_hz_to_slaney_mel(float(fmin)), _hz_to_slaney_mel(fmax), n_mels + 2)
    edges_hz = _slaney_mel_to_hz(edges_mel)
    widths = np.diff(edges_hz)
    distance = edges_hz[:, None] - bin_hz[None, :]  # edge minus bin frequency
    rising = -distance[:-2] / widths[:-1, None]
    falling = distance[2:] / widths[1:, None]
    # librosa stores the triangles in float32 first, then scales them by the float64 area norm
    triangles = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    area_norm = 2.0 / (edges_hz[2:] - edges_hz[:-2])
    basis = (triangles.astype(np.float64) * area_norm[:, None]).astype(np.float32)
    basis.setflags(write=False)
    return basis


@lru_cache(maxsize=32)
def _slaney_basis_tensor(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None,
                         device: str, dtype: torch.dtype) -> torch.Tensor:
    basis = slaney_mel_filterbank(sample_rate, n_fft, n_mels, fmin, fmax)
    return torch.from_numpy(basis.copy()).to(device=device, dtype=dtype)


@lru_cache(maxsize=32)
def _window(kind: str, length: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "hann":
        return torch.hann_window(length, device=device, dtype=dtype)  # periodic
    if kind == "povey":  # Kaldi: symmetric Hann raised to 0.85
        return torch.hann_window(length, periodic=False, device=device, dtype=dtype).pow(0.85)
    raise ValueError(f"unknown window {kind!r}")


# ----------------------------------------------------------------------------- prompt mel (flow conditioning)


@dataclass(frozen=True)
class MelParams:
    """Matcha ``mel_spectrogram`` arguments (a model dir's ``feat_extractor``); defaults: the released model."""

    sample_rate: int = 24000
    n_fft: int = 1920
    num_mels: int = 80
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = None
    center: bool = False

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> MelParams:
        """Read ``feat_extractor`` from ``cosyvoice3.yaml`` (as data; nothing is imported)."""
        node = read_hyperpyyaml(Path(model_dir) / "cosyvoice3.yaml").get("feat_extractor")
        if not isinstance(node, Tagged) or not isinstance(node.args, dict) \
                or not node.target.endswith("mel_spectrogram"):
            raise ConfigError("cosyvoice3.yaml: 'feat_extractor' must be a '!name:...mel_spectrogram' node")
        args = node.args
        try:
            return cls(sample_rate=int(args["sampling_rate"]), n_fft=int(args["n_fft"]),
                       num_mels=int(args["num_mels"]), hop_size=int(args["hop_size"]),
                       win_size=int(args["win_size"]), fmin=float(args.get("fmin", 0) or 0),
                       fmax=None if args.get("fmax") is None else float(args["fmax"]),
                       center=bool(args.get("center", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"cosyvoice3.yaml: 'feat_extractor' is incomplete or mistyped ({exc})") from exc


def prompt_mel(wav: torch.Tensor, params: MelParams = MelParams()) -> torch.Tensor:
    """Natural-log mel magnitude spectrogram of ``wav`` [B, N] (at ``params.sample_rate``) -> [B, num_mels, T].

    Frames: reflect-pad (n_fft - hop)/2 on both sides, then an STFT without centring, so
    T = (N + n_fft - hop - n_fft) // hop + 1 ≈ N / hop.
    """
    if wav.dim() == 1:
        wav = wav[None]
    pad = (params.n_fft - params.hop_size) // 2
    padded = F.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]
    window = _window("hann", params.win_size, str(wav.device), wav.dtype)
    spec = torch.view_as_real(torch.stft(padded, params.n_fft, hop_length=params.hop_size,
                                         win_length=params.win_size, window=window, center=params.center,
                                         pad_mode="reflect", normalized=False, onesided=True, return_complex=True))
    magnitude = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)  # Matcha's epsilon inside the sqrt
    basis = _slaney_basis_tensor(params.sample_rate, params.n_fft, params.num_mels, params.fmin, params.fmax,
                                 str(wav.device), wav.dtype)
    return torch.log(torch.clamp(torch.matmul(basis, magnitude), min=1e-5))


# ----------------------------------------------------------------------------- Whisper log-mel (speech tokenizer)

WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160


def whisper_log_mel(wav_16k: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """Whisper's normalised log10 power mel of 16 kHz audio [B, N] -> [B, n_mels, N // 160].

    The centred STFT yields N//160 + 1 frames; Whisper drops the last one. The dynamic range is
    clipped to 8 decades below the maximum of the whole batch, then mapped to roughly [-1, 1].
    """
    if wav_16k.dim() == 1:
        wav_16k = wav_16k[None]
    window = _window("hann", WHISPER_N_FFT, str(wav_16k.device), wav_16k.dtype)
    stft = torch.stft(wav_16k, WHISPER_N_FFT, WHISPER_HOP, window=window, center=True, pad_mode="reflect",
                      return_complex=True)
    power = stft[..., :-1].abs() ** 2
    basis = _slaney_basis_tensor(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels, 0.0, None,
                                 str(wav_16k.device), wav_16k.dtype)
    log_spec = torch.clamp(basis @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


# ----------------------------------------------------------------------------- Kaldi fbank (speaker encoder)

_KALDI_FRAME_MS = 25.0
_KALDI_SHIFT_MS = 10.0
_KALDI_PREEMPHASIS = 0.97
_KALDI_LOW_HZ = 20.0
_FLOAT32_EPS = torch.finfo(torch.float32).eps  # Kaldi's log floor


def _kaldi_mel(hz: torch.Tensor | float) -> torch.Tensor | float:
    """Kaldi's (HTK) mel scale: 1127 ln(1 + f/700)."""
    if isinstance(hz, torch.Tensor):
        return 1127.0 * (1.0 + hz / 700.0).log()
    return 1127.0 * math.log(1.0 + hz / 700.0)


@lru_cache(maxsize=16)
def _kaldi_mel_banks(num_bins: int, padded_window: int, sample_rate: float, low_hz: float, high_hz: float,
                     device: str) -> torch.Tensor:
    """Triangles equally spaced on the HTK mel scale over FFT bins, [num_bins, padded_window//2 + 1] float32.

    Triangles are built over the first padded_window/2 bins; the Nyquist bin gets zero weight (as Kaldi).
    """
    if high_hz <= 0.0:
        high_hz += 0.5 * sample_rate  # 0 means "up to Nyquist", negative means "below Nyquist"
    mel_low, mel_high = _kaldi_mel(low_hz), _kaldi_mel(high_hz)
    step = (mel_high - mel_low) / (num_bins + 1)
    index = torch.arange(num_bins, device=device).unsqueeze(1)
    left = mel_low + index * step
    center = mel_low + (index + 1.0) * step
    right = mel_low + (index + 2.0) * step
    bin_mel = _kaldi_mel((sample_rate / padded_window) * torch.arange(padded_window // 2, device=device,
                                                                       dtype=torch.float32)).unsqueeze(0)
    rising = (bin_mel - left) / (center - left)
    falling = (right - bin_mel) / (right - center)
    banks = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return F.pad(banks, (0, 1))


def kaldi_fbank(wav: torch.Tensor, num_mel_bins: int = 80, sample_rate: int = 16000) -> torch.Tensor:
    """Log mel filterbank energies of the first channel of ``wav`` ([C, N] or [N]) -> [T, num_mel_bins].

    Same as ``torchaudio.compliance.kaldi.fbank`` with dither 0 and every other option at its default:
    25 ms frames every 10 ms, only frames that fit entirely (snip_edges), per-frame DC removal,
    pre-emphasis 0.97, Povey window, FFT size rounded up to a power of two, power spectrum,
    mel bins from 20 Hz to Nyquist, natural log floored at float32 epsilon. The input stays in its
    own scale (the official frontend feeds [-1, 1) audio, not int16 values).
    """
    signal = wav[0] if wav.dim() == 2 else wav
    frame = int(sample_rate * _KALDI_FRAME_MS * 0.001)
    shift = int(sample_rate * _KALDI_SHIFT_MS * 0.001)
    padded = 1 << (frame - 1).bit_length()
    if signal.numel() < frame:
        return signal.new_zeros((0, num_mel_bins))
    frames = signal.unfold(0, frame, shift)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)  # first sample is its own predecessor
    frames = frames - _KALDI_PREEMPHASIS * previous
    frames = frames * _window("povey", frame, str(signal.device), signal.dtype).unsqueeze(0)
    frames = F.pad(frames, (0, padded - frame))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    banks = _kaldi_mel_banks(num_mel_bins, padded, float(sample_rate), _KALDI_LOW_HZ, 0.0, str(signal.device))
    energies = torch.mm(power, banks.to(power.dtype).T)
    return torch.clamp(energies, min=_FLOAT32_EPS).log()
