"""Prompt audio: decode whatever a user uploads, downmix, resample and validate it.

Decoding goes through libsndfile (``soundfile``: WAV, FLAC, OGG Vorbis/Opus, MP3, AIFF, ...) and, for what it
cannot open (browser recordings: WebM/Opus, M4A/AAC), through PyAV (FFmpeg's libraries, in process).
Integer PCM becomes float32 as ``int / 2**(bits-1)``, the semantics of torchaudio's soundfile backend that the
official frontend used. Downmixing is the channel mean. Resampling reimplements torchaudio's default
``Resample`` (Hann-windowed sinc, 6 zero crossings, roll-off 0.99) so features match the reference.

Decoding is bounded (a few hundred KB of 255-channel Ogg decode to gigabytes): channels, sample rate and
duration are checked from the header before any sample is decoded, then samples are decoded block by block,
each block downmixed at once when a mono result is asked for, with the duration re-checked as they come (for
containers whose header does not say it). Memory per decode: the encoded input (a path is read in place;
bytes are the caller's) + at most ``max_sample_rate * (max_seconds + 1)`` float32 samples per output channel
(twice while PyAV's blocks are joined) + one block (``BLOCK_BYTES``). Error messages name a file by its base
name only: a server's temporary paths never reach a user.
"""

from __future__ import annotations

import io
import logging
import math
import os
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

import av
import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F

from cosyvoice.errors import InvalidInputError
from cosyvoice.settings import Limits

logger = logging.getLogger(__name__)

AudioSource = str | os.PathLike | bytes | bytearray | memoryview | BinaryIO | tuple
"""A path, raw file bytes, a binary file-like object, or an ``(array, sample_rate)`` pair."""

DECODE_TIMEOUT_S = 60.0  # wall-clock bound of one PyAV decode (its input is already bounded in size)
BLOCK_BYTES = 4 * 2**20  # one libsndfile read: a block of all the file's channels (float32), then downmixed
ACCEPTED_FORMATS = "WAV, FLAC, MP3, OGG (Vorbis or Opus), WebM or M4A"

# Magic numbers, only used to name the format in error messages.
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


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds checked while decoding; ``None`` leaves one open (trusted local files, the parity tool)."""

    max_seconds: float | None = None
    max_bytes: int | None = None  # the encoded input
    max_channels: int | None = None
    max_sample_rate: int | None = None


@dataclass
class _Input:
    """An encoded input: where libsndfile/PyAV read it from, what to call it in messages, its size."""

    file: Path | io.BytesIO
    label: str
    size: int  # bytes (for a truncated stream: what was read)
    head: bytes
    truncated: bool = False  # a stream longer than max_bytes: only max_bytes + 1 bytes were read

    def reader(self) -> str | io.BytesIO:
        if isinstance(self.file, Path):
            return str(self.file)
        self.file.seek(0)
        return self.file


def decode_audio(source: AudioSource, *, max_seconds: float | None = None, max_bytes: int | None = None,
                 max_channels: int | None = None, max_sample_rate: int | None = None,
                 mono: bool = False) -> tuple[np.ndarray, int]:
    """Decode ``source`` to float32 samples [channels, frames] (``[1, frames]``, the channel mean, when
    ``mono``) and its sample rate.

    The limits are checked from the header first (channels, sample rate, duration), then the encoded size, and
    the duration again while decoding; raises :class:`InvalidInputError` saying which, or that ``source`` is not
    decodable audio. A header-described problem wins over the size: a 5-minute WAV hears that it is too long,
    which says what to do, rather than that it is too big.
    """
    limits = DecodeLimits(max_seconds, max_bytes, max_channels, max_sample_rate)
    if isinstance(source, tuple):
        samples, sample_rate = _from_array_pair(source)
        _check_header(samples.shape[0], sample_rate, samples.shape[1], limits, "the audio")
        return (_mean_channels(samples) if mono else samples), sample_rate
    inp = _open_source(source, max_bytes)
    if inp.size == 0:
        raise InvalidInputError(f"{inp.label} is empty (0 bytes): no audio to read")
    try:
        handle = sf.SoundFile(inp.reader())
    except (RuntimeError, TypeError):  # libsndfile cannot open or parse it (sf.LibsndfileError is a RuntimeError)
        return _decode_with_pyav(inp, limits, mono)
    with handle:
        return _decode_with_soundfile(handle, inp, limits, mono)


def _open_source(source: AudioSource, max_bytes: int | None) -> _Input:
    """The input as a path (read in place) or bytes; a file object is read up to ``max_bytes + 1`` bytes."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return _Input(io.BytesIO(data), "the uploaded audio", len(data), data[:64])
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise InvalidInputError(f"audio file '{path.name}' does not exist or is not a regular file")
        with open(path, "rb") as f:
            head = f.read(64)
        return _Input(path, f"'{path.name}'", path.stat().st_size, head)
    if hasattr(source, "read"):
        data = source.read() if max_bytes is None else source.read(max_bytes + 1)
        if isinstance(data, str):
            raise InvalidInputError("the audio file object is open in text mode; open it in binary mode ('rb')")
        data = bytes(data)
        truncated = max_bytes is not None and len(data) > max_bytes
        return _Input(io.BytesIO(data), "the uploaded audio", len(data), data[:64], truncated)
    raise InvalidInputError(
        f"unsupported audio input of type {type(source).__name__}: pass a path, bytes, a binary file object "
        "or an (array, sample_rate) pair")


def _check_header(channels: int, sample_rate: int, frames: int | None, limits: DecodeLimits, label: str,
                  truncated: bool = False) -> None:
    """Refuse what the header already says is out of bounds, before a sample is decoded (``frames`` of a
    ``truncated`` input are a lower bound)."""
    if channels <= 0:
        raise InvalidInputError(f"{label} has no audio channels")
    if limits.max_channels is not None and channels > limits.max_channels:
        raise InvalidInputError(f"{label} has {channels} audio channels; at most {limits.max_channels} are "
                                "supported (a mono or stereo recording is best)")
    if sample_rate <= 0:
        raise InvalidInputError(f"{label} has an invalid sample rate ({sample_rate} Hz)")
    if limits.max_sample_rate is not None and sample_rate > limits.max_sample_rate:
        raise InvalidInputError(f"{label} is sampled at {sample_rate} Hz; at most {limits.max_sample_rate} Hz is "
                                "supported. Export it at 48 kHz or lower")
    if limits.max_seconds is not None and frames is not None and frames > limits.max_seconds * sample_rate:
        raise _too_long(frames / sample_rate, limits.max_seconds, cut_short=truncated)


def _check_size(inp: _Input, limits: DecodeLimits) -> None:
    if limits.max_bytes is not None and (inp.truncated or inp.size > limits.max_bytes):
        seconds = f" of up to {limits.max_seconds:g} s" if limits.max_seconds is not None else ""
        raise InvalidInputError(f"{inp.label} is larger than {limits.max_bytes / 2**20:.0f} MiB, the upload limit; "
                                f"a voice prompt{seconds} needs far less (30 s of 48 kHz WAV: under 6 MiB)")


def _frame_budget(sample_rate: int, limits: DecodeLimits) -> int | None:
    """Frames to decode at most: one second past the duration limit is enough to tell a file is too long."""
    return None if limits.max_seconds is None else int((limits.max_seconds + 1.0) * sample_rate)


def _decode_with_soundfile(f: sf.SoundFile, inp: _Input, limits: DecodeLimits,
                           mono: bool) -> tuple[np.ndarray, int]:
    sample_rate, channels = int(f.samplerate), int(f.channels)
    frames = int(f.frames) if f.frames > 0 else None
    _check_header(channels, sample_rate, frames, limits, inp.label, inp.truncated)
    _check_size(inp, limits)
    budget = _frame_budget(sample_rate, limits)
    block_frames = max(1024, BLOCK_BYTES // (4 * channels))
    capacity = min(x for x in (frames, budget) if x is not None) if (frames or budget) else block_frames
    out = np.empty((1 if mono else channels, capacity), dtype=np.float32)  # the only full-length buffer
    filled = 0
    try:
        # integer PCM is scaled by 1 / 2**(bits-1); each block [n, channels] is downmixed before the next
        for block in f.blocks(blocksize=block_frames, dtype="float32", always_2d=True):
            n = block.shape[0]
            if filled + n > out.shape[1]:
                if budget is not None and filled + n > budget:
                    raise _too_long(0.0, limits.max_seconds, cut_short=True)
                out = np.concatenate([out[:, :filled], np.empty((out.shape[0], max(n, filled)), np.float32)], 1)
            out[:, filled:filled + n] = _mean_channels(block.T) if mono else block.T
            filled += n
    except sf.LibsndfileError:
        logger.debug("libsndfile failed while decoding %s", inp.label, exc_info=True)
        raise _damaged(inp) from None
    return out[:, :filled], sample_rate


def _decode_with_pyav(inp: _Input, limits: DecodeLimits, mono: bool) -> tuple[np.ndarray, int]:
    """Containers libsndfile cannot open: header facts from the container, then a decode with running limits."""
    try:
        container = av.open(inp.reader(), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError):  # PyAV's messages quote the file's path: never shown
        logger.debug("PyAV cannot open %s", inp.label, exc_info=True)
        raise _unreadable(inp) from None
    with container:
        if not container.streams.audio:
            raise _unreadable(inp, "no audio track found")
        stream = container.streams.audio[0]
        sample_rate, channels = int(stream.codec_context.sample_rate or 0), int(stream.codec_context.channels or 0)
        seconds = (float(stream.duration * stream.time_base) if stream.duration
                   else container.duration / av.time_base if container.duration else None)
        _check_header(channels, sample_rate, None if seconds is None else round(seconds * sample_rate), limits,
                      inp.label, inp.truncated)
        _check_size(inp, limits)
        budget = _frame_budget(sample_rate, limits)
        blocks: list[np.ndarray] = []
        decoded = 0
        deadline = time.monotonic() + DECODE_TIMEOUT_S
        try:
            for frame in container.decode(stream):
                if frame.sample_rate != sample_rate or frame.layout.nb_channels != channels:
                    raise InvalidInputError(f"{inp.label} changes its sample rate or channel count midway; "
                                            "export it as one WAV or FLAC file")
                block = _pcm_to_float32(frame)
                blocks.append(_mean_channels(block) if mono else block)
                decoded += block.shape[1]
                if budget is not None and decoded > budget:
                    raise _too_long(0.0, limits.max_seconds, cut_short=True)
                if time.monotonic() > deadline:
                    raise InvalidInputError(f"decoding {inp.label} took longer than {DECODE_TIMEOUT_S:.0f} s; "
                                            "upload a shorter WAV or FLAC file")
        except av.FFmpegError:
            logger.debug("PyAV failed while decoding %s", inp.label, exc_info=True)
            raise _damaged(inp) from None
    if not blocks:
        return np.zeros((1 if mono else channels, 0), np.float32), sample_rate
    return np.concatenate(blocks, axis=1), sample_rate


def _pcm_to_float32(frame: av.AudioFrame) -> np.ndarray:
    """One decoded frame -> float32 [channels, samples] with libsndfile's integer scaling."""
    array = frame.to_ndarray()
    if not frame.format.is_planar:  # packed: [1, samples * channels], interleaved
        array = array.reshape(-1, frame.layout.nb_channels).T
    return _to_float32(array)


def _mean_channels(samples: np.ndarray) -> np.ndarray:
    """[channels, frames] float32 -> [1, frames], the channel mean in float32 as :func:`downmix` takes it."""
    if samples.shape[0] == 1:
        return samples
    return torch.from_numpy(np.ascontiguousarray(samples)).mean(dim=0, keepdim=True).numpy()


def _unreadable(inp: _Input, why: str = "") -> InvalidInputError:
    fmt = sniff_format(inp.head)
    if fmt is not None and not why:
        return _damaged(inp)
    return InvalidInputError(f"{inp.label} is not an audio file we can read{f' ({why})' if why else ''}. "
                             f"Upload {ACCEPTED_FORMATS}")


def _damaged(inp: _Input) -> InvalidInputError:
    what = sniff_format(inp.head) or "audio"
    return InvalidInputError(f"cannot decode {inp.label}: it looks like {what} but seems damaged or cut short. "
                             f"Export it again, or upload {ACCEPTED_FORMATS}")


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


def load_prompt_audio(source: AudioSource, *, min_sample_rate: int = Limits.min_prompt_sample_rate,
                      min_seconds: float = Limits.min_prompt_seconds, max_seconds: float = Limits.max_prompt_seconds,
                      silence_peak: float = 1e-3, max_bytes: int | None = None,
                      max_channels: int = Limits.max_prompt_channels,
                      max_sample_rate: int = Limits.max_prompt_sample_rate) -> tuple[torch.Tensor, int]:
    """Decode and check a voice prompt; returns mono float32 [1, frames] at the file's own sample rate.

    Limits: the tokenizer and speaker encoder need >= 16 kHz input, the speech tokenizer refuses more than
    30 s, and under a second of speech gives the model too little of the voice to imitate. Decoding is
    bounded by ``max_channels``, ``max_sample_rate``, ``max_seconds`` and ``max_bytes`` (module docstring).
    """
    samples, sample_rate = decode_audio(source, max_seconds=max_seconds, max_bytes=max_bytes,
                                        max_channels=max_channels, max_sample_rate=max_sample_rate, mono=True)
    wav = torch.from_numpy(samples)
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
