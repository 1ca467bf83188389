"""Prompt audio: decode whatever a user uploads, downmix, resample and validate it.

Decoding goes through libsndfile (``soundfile``: WAV, FLAC, OGG Vorbis/Opus, MP3, AIFF, ...) and falls back
to an ``ffmpeg`` subprocess for containers libsndfile cannot open (browser recordings: WebM/Opus, M4A/AAC).
Integer PCM becomes float32 as ``int / 2**(bits-1)``, the semantics of torchaudio's soundfile backend that the
official frontend used. Downmixing is the channel mean. Resampling reimplements torchaudio's default
``Resample`` (Hann-windowed sinc, 6 zero crossings, roll-off 0.99) so features match the reference.
"""

from __future__ import annotations

import io
import math
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F

from cosyvoice.errors import InvalidInputError

AudioSource = str | os.PathLike | bytes | bytearray | memoryview | BinaryIO | tuple
"""A path, raw file bytes, a binary file-like object, or an ``(array, sample_rate)`` pair."""

FFMPEG_TIMEOUT_S = 60.0

# Magic numbers, only used to name the format in error messages and to decide whether ffmpeg is worth a try.
_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, b"RIFF", "WAV"), (0, b"RF64", "WAV (RF64)"), (0, b"fLaC", "FLAC"), (0, b"OggS", "Ogg"),
    (0, b"ID3", "MP3"), (4, b"ftyp", "MP4/M4A"), (0, b"\x1a\x45\xdf\xa3", "WebM/Matroska"),
    (0, b"FORM", "AIFF"), (0, b"#!AMR", "AMR"), (0, b"caff", "CAF"),
)


def sniff_format(head: bytes) -> str | None:
    """Name the container of a file from its first bytes, or None if it looks like no audio format we know."""
    for offset, magic, name in _SIGNATURES:
        if head[offset:offset + len(magic)] == magic:
            return name
    if len(head) >= 3 and head[0] == 0xFF:
        if head[1] & 0xF6 == 0xF0:  # 12-bit sync, layer 00
            return "AAC (ADTS)"
        version, layer = (head[1] >> 3) & 3, (head[1] >> 1) & 3
        bitrate, rate = head[2] >> 4, (head[2] >> 2) & 3
        if head[1] & 0xE0 == 0xE0 and version != 1 and layer != 0 and bitrate != 15 and rate != 3:
            return "MP3"  # 11-bit frame sync and no reserved field values
    return None


# ----------------------------------------------------------------------------- decoding


def decode_audio(source: AudioSource, *, max_seconds: float | None = None,
                 max_bytes: int | None = None) -> tuple[np.ndarray, int]:
    """Decode ``source`` to float32 samples [channels, frames] and its sample rate.

    ``max_seconds`` refuses overlong files from their header, before reading them into memory;
    ``max_bytes`` refuses encoded input larger than that, before decoding it.
    Raises :class:`InvalidInputError` for anything that is not decodable audio.
    """
    if isinstance(source, tuple):
        samples, sample_rate = _from_array_pair(source)
        if max_seconds is not None and samples.shape[1] > max_seconds * sample_rate:
            raise _too_long(samples.shape[1] / sample_rate, max_seconds)
        return samples, sample_rate
    _refuse_long_by_header(source, max_seconds, max_bytes)
    data, path, label, head = _read_source(source, max_bytes)
    if not head:
        raise InvalidInputError(f"{label} is empty (0 bytes): no audio to read")
    try:
        return _decode_with_soundfile(path if path is not None else io.BytesIO(data), max_seconds)
    except (RuntimeError, TypeError):  # libsndfile cannot open or parse it
        fmt = sniff_format(head)
        if shutil.which("ffmpeg") is None:
            if fmt is None:
                raise InvalidInputError(
                    f"{label} is not a recognised audio file. Upload WAV, FLAC, OGG or MP3; "
                    "other formats (WebM, M4A/AAC) need ffmpeg installed on the server") from None
            raise InvalidInputError(
                f"cannot decode {fmt} audio from {label}: libsndfile does not read it and no 'ffmpeg' binary is on "
                "PATH. Install ffmpeg on the server (e.g. 'apt-get install ffmpeg') or upload WAV, FLAC, OGG or "
                "MP3") from None
        return _decode_with_ffmpeg(data, path, fmt, label, max_seconds)


def _refuse_long_by_header(source: AudioSource, max_seconds: float | None, max_bytes: int | None) -> None:
    """An oversized file whose header says it is too long gets the duration message: the length, not the file
    size, is what the user has to change (a 57 MB WAV is minutes of audio)."""
    if max_seconds is None or max_bytes is None or not isinstance(source, (str, os.PathLike)):
        return
    path = Path(source)
    if not path.is_file() or path.stat().st_size <= max_bytes:
        return
    try:
        info = sf.info(str(path))
    except (RuntimeError, TypeError):  # not readable from its header here: the size check answers
        return
    if info.samplerate and info.frames > max_seconds * info.samplerate:
        raise _too_long(info.frames / info.samplerate, max_seconds)


def _read_source(source: AudioSource, max_bytes: int | None) -> tuple[bytes | None, Path | None, str, bytes]:
    """Return (bytes or None, path or None, label for messages, first bytes); file objects are read completely
    (at most ``max_bytes`` + 1 bytes, so an oversized stream is refused without being held in memory)."""
    def check_size(n: int, label: str) -> None:
        if max_bytes is not None and n > max_bytes:
            raise InvalidInputError(f"{label} is larger than {max_bytes / 2**20:.0f} MiB, the upload limit "
                                    "(COSYVOICE_MAX_PROMPT_BYTES); a 30 s prompt needs far less")

    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        check_size(len(data), "the uploaded audio")
        return data, None, "the uploaded audio", data[:64]
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise InvalidInputError(f"audio file '{path}' does not exist or is not a regular file")
        check_size(path.stat().st_size, f"'{path.name}'")
        with open(path, "rb") as f:
            return None, path, f"'{path.name}'", f.read(64)
    if hasattr(source, "read"):
        data = source.read() if max_bytes is None else source.read(max_bytes + 1)
        if isinstance(data, str):
            raise InvalidInputError("the audio file object is open in text mode; open it in binary mode ('rb')")
        check_size(len(data), "the uploaded audio")
        return bytes(data), None, "the uploaded audio", bytes(data[:64])
    raise InvalidInputError(
        f"unsupported audio input of type {type(source).__name__}: pass a path, bytes, a binary file object "
        "or an (array, sample_rate) pair")


def _decode_with_soundfile(file: Path | BinaryIO, max_seconds: float | None) -> tuple[np.ndarray, int]:
    with sf.SoundFile(file) as f:
        sample_rate = int(f.samplerate)
        if max_seconds is not None and f.frames > max_seconds * sample_rate:
            raise _too_long(f.frames / sample_rate, max_seconds)
        frames = f.read(dtype="float32", always_2d=True)  # integer PCM is scaled by 1 / 2**(bits-1)
    return np.ascontiguousarray(frames.T), sample_rate


def _decode_with_ffmpeg(data: bytes | None, path: Path | None, fmt: str | None, label: str,
                        max_seconds: float | None) -> tuple[np.ndarray, int]:
    """Let ffmpeg convert to a float32 WAV at the native rate and channel count; we downmix/resample ourselves.

    Both sides go through temporary files: MP4/M4A often keep their index at the end, which a pipe cannot seek.
    Decoding stops one second past ``max_seconds``, enough to tell that a file is too long.
    """
    what = f"{fmt} audio" if fmt else "audio"
    with tempfile.TemporaryDirectory(prefix="cosyvoice-audio-") as tmp:
        src = path
        if src is None:
            src = Path(tmp) / "input"
            src.write_bytes(data or b"")
        out = Path(tmp) / "decoded.wav"
        limit = [] if max_seconds is None else ["-t", f"{max_seconds + 1.0:g}"]
        cmd = ["ffmpeg", "-nostdin", "-hide_banner", "-loglevel", "error", "-i", str(src),
               "-map", "0:a:0", *limit, "-c:a", "pcm_f32le", "-f", "wav", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, timeout=FFMPEG_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise InvalidInputError(f"decoding {what} from {label} with ffmpeg took longer than "
                                    f"{FFMPEG_TIMEOUT_S:.0f} s; upload a shorter WAV or FLAC file") from None
        if proc.returncode != 0 or not out.is_file():
            reason = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no audio stream"]
            if fmt is None:
                raise InvalidInputError(f"{label} is not a recognised audio file; upload a recording (WAV, FLAC, "
                                        "MP3, OGG/Opus, WebM or M4A)")
            raise InvalidInputError(f"cannot decode {what} from {label}: the file seems damaged (ffmpeg: {reason[0]})")
        try:
            samples, sample_rate = _decode_with_soundfile(out, None)
        except (RuntimeError, TypeError) as exc:
            raise InvalidInputError(f"cannot decode {what} from {label}: ffmpeg produced no readable audio "
                                    f"({exc})") from None
    if max_seconds is not None and samples.shape[1] > max_seconds * sample_rate:
        raise _too_long(samples.shape[1] / sample_rate, max_seconds, cut_short=True)
    return samples, sample_rate


def _from_array_pair(pair: tuple) -> tuple[np.ndarray, int]:
    """Accept (array, sample_rate) and also Gradio's (sample_rate, array) order."""
    if len(pair) != 2:
        raise InvalidInputError("an audio tuple must be (array, sample_rate)")
    array, sample_rate = pair
    if isinstance(array, (int, np.integer)) and not isinstance(sample_rate, (int, np.integer)):
        array, sample_rate = sample_rate, array
    if not isinstance(sample_rate, (int, np.integer)) or isinstance(sample_rate, bool) or sample_rate <= 0:
        raise InvalidInputError(f"the sample rate must be a positive integer, got {sample_rate!r}")
    samples = array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
    if samples.ndim == 1:
        samples = samples[None]
    elif samples.ndim == 2:
        if samples.shape[0] > samples.shape[1]:  # [frames, channels] (soundfile order): channels are the short axis
            samples = samples.T
    else:
        raise InvalidInputError(f"audio arrays must be 1-D or 2-D (channels x frames), got shape {samples.shape}")
    return _to_float32(samples), int(sample_rate)


def _to_float32(samples: np.ndarray) -> np.ndarray:
    """Integer PCM -> [-1, 1) like libsndfile (int16 / 32768 etc.); floats are kept as they are."""
    if samples.dtype == np.uint8:
        return ((samples.astype(np.float32) - 128.0) / 128.0).astype(np.float32)
    if np.issubdtype(samples.dtype, np.signedinteger):
        return (samples.astype(np.float64) / float(2 ** (8 * samples.dtype.itemsize - 1))).astype(np.float32)
    if np.issubdtype(samples.dtype, np.floating):
        return np.ascontiguousarray(samples, dtype=np.float32)
    raise InvalidInputError(f"audio samples must be integer PCM or floating point, got dtype {samples.dtype}")


def downmix(samples: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Average the channels of [channels, frames] audio -> float32 tensor [1, frames]."""
    wav = samples if isinstance(samples, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(samples))
    return wav.to(torch.float32).mean(dim=0, keepdim=True)


# ----------------------------------------------------------------------------- resampling


@lru_cache(maxsize=32)
def _sinc_kernel(orig: int, new: int, zero_crossings: int, rolloff: float, device: str,
                 dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Polyphase windowed-sinc filter bank for the reduced ratio ``orig -> new``: [new, 1, 2*width + orig].

    Output phase j (time j/new, in input samples j*orig/new) gets one filter that is a sinc low-pass at
    ``rolloff * min(orig, new)`` (in units of the reduced rate) under a Hann window that spans
    ``zero_crossings`` lobes on each side; ``width`` input samples of context are needed on each side.
    """
    cutoff = min(orig, new) * rolloff
    width = math.ceil(zero_crossings * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64, device=device)[None, None] / orig
    # the phase offsets are formed in float32 before meeting the float64 taps, as in torchaudio
    phases = torch.arange(0, -new, -1, device=device).to(torch.float32)[:, None, None] / new
    t = ((phases + taps) * cutoff).clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones((), dtype=t.dtype, device=device), torch.sin(t) / t)
    kernel = sinc * (window * (cutoff / orig))
    return kernel.to(dtype), width


def resample(wav: torch.Tensor, orig_sr: int, new_sr: int, *, zero_crossings: int = 6,
             rolloff: float = 0.99) -> torch.Tensor:
    """Band-limited resampling of [..., frames] audio, equal to ``torchaudio.transforms.Resample`` defaults.

    Output length is ceil(frames * new_sr / orig_sr); the signal is zero-padded at both ends.
    """
    if orig_sr == new_sr:
        return wav
    g = math.gcd(int(orig_sr), int(new_sr))
    orig, new = int(orig_sr) // g, int(new_sr) // g
    kernel, width = _sinc_kernel(orig, new, zero_crossings, rolloff, str(wav.device), wav.dtype)
    batch_shape, length = wav.shape[:-1], wav.shape[-1]
    flat = F.pad(wav.reshape(-1, 1, length), (width, width + orig))
    out = F.conv1d(flat, kernel, stride=orig)  # [B, new, n_blocks]: phase j of every block
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)
    target = math.ceil(new * length / orig)
    return out[:, :target].reshape(*batch_shape, -1)


# ----------------------------------------------------------------------------- prompt loading and validation


def load_prompt_audio(source: AudioSource, *, min_sample_rate: int = 16000, min_seconds: float = 1.0,
                      max_seconds: float = 30.0, silence_peak: float = 1e-3,
                      max_bytes: int | None = None) -> tuple[torch.Tensor, int]:
    """Decode and check a voice prompt; returns mono float32 [1, frames] at the file's own sample rate.

    Limits: the tokenizer and speaker encoder need >= 16 kHz input, the speech tokenizer refuses more than
    30 s, and under a second of speech gives the model too little of the voice to imitate.
    """
    samples, sample_rate = decode_audio(source, max_seconds=max_seconds, max_bytes=max_bytes)
    wav = downmix(samples)
    validate_prompt(wav, sample_rate, min_sample_rate=min_sample_rate, min_seconds=min_seconds,
                    max_seconds=max_seconds, silence_peak=silence_peak)
    return wav, sample_rate


def validate_prompt(wav: torch.Tensor, sample_rate: int, *, min_sample_rate: int = 16000, min_seconds: float = 1.0,
                    max_seconds: float = 30.0, silence_peak: float = 1e-3) -> None:
    """Raise :class:`InvalidInputError` saying exactly why a mono prompt [1, frames] is unusable."""
    frames = wav.shape[-1]
    if frames == 0:
        raise InvalidInputError("the prompt audio contains no samples (empty recording)")
    if sample_rate < min_sample_rate:
        raise InvalidInputError(
            f"the prompt audio is sampled at {sample_rate} Hz; it must be at least {min_sample_rate / 1000:g} kHz "
            f"({min_sample_rate} Hz). Record or export it at {min_sample_rate / 1000:g} kHz or higher")
    if not bool(torch.isfinite(wav).all()):
        raise InvalidInputError("the prompt audio contains NaN or infinite samples")
    seconds = frames / sample_rate
    if seconds < min_seconds:
        raise InvalidInputError(
            f"the prompt audio is {seconds:.2f} s long; it must be at least {min_seconds:g} s of speech")
    if seconds > max_seconds:
        raise _too_long(seconds, max_seconds)
    peak = float(wav.abs().max())
    if peak <= silence_peak:
        raise InvalidInputError(
            f"the prompt audio is silent (peak amplitude {peak:.2e}); record some speech or raise the input level")


def _too_long(seconds: float, max_seconds: float, cut_short: bool = False) -> InvalidInputError:
    length = f"longer than {max_seconds:g} s" if cut_short else f"{seconds:.2f} s long"
    return InvalidInputError(
        f"the prompt audio is {length}; at most {max_seconds:g} s is supported (the speech tokenizer's limit). "
        "Trim it to a shorter clip")
