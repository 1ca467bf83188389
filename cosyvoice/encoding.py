"""Audio encoding for every adapter: PCM16, WAV, MP3, Opus, FLAC and AAC, whole or as a stream.

One table (:data:`FORMATS`) names each format's content type and file extension; one encoder class turns
float32 chunks into bytes as they arrive, so a server can send the first MP3 frames while the model is still
speaking. Compressed formats go through PyAV (FFmpeg's libraries, in process): never an ``ffmpeg`` subprocess
per request. Containers are chosen so that a file streamed from its first byte is playable: MP3 frames, Ogg
(Opus), AAC in ADTS frames (what OpenAI's ``aac`` responses are), and WAV with the "unknown length" sizes
that players read to the end of the stream. FLAC is the exception: its STREAMINFO header holds the total
sample count, which libsndfile needs (it refuses a FLAC that says 0 samples), and the muxer writes it by
seeking back when the file ends; so a FLAC answer is produced whole, at ``finish()``, never in pieces.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import BinaryIO

import av
import numpy as np
import torch

from cosyvoice.errors import InvalidInputError

PCM_SCALE = 2 ** 15  # the reference's servers scale float speech by 2**15 before the int16 cast


@dataclass(frozen=True)
class AudioFormat:
    """How one ``response_format`` is produced and labelled."""

    name: str
    content_type: str
    extension: str
    container: str | None = None  # PyAV muxer; None: raw PCM16 or WAV, written here
    codec: str | None = None
    bit_rate: int | None = None
    options: dict[str, str] = field(default_factory=dict)  # muxer options
    pcm16_input: bool = False  # feed the codec our PCM16 samples (lossless formats then equal the PCM bytes)
    whole_file: bool = False  # the muxer seeks back to complete its header: bytes come only at ``finish()``


FORMATS: dict[str, AudioFormat] = {f.name: f for f in (
    AudioFormat("pcm", "audio/pcm", "pcm"),  # raw PCM16LE mono, no header
    AudioFormat("wav", "audio/wav", "wav"),
    AudioFormat("mp3", "audio/mpeg", "mp3", "mp3", "libmp3lame", 64_000),
    # Ogg pages are flushed every 20 ms instead of the muxer's default 1 s, so streamed Opus is not held back
    AudioFormat("opus", "audio/ogg", "opus", "ogg", "libopus", 32_000, {"page_duration": "20000"}),
    AudioFormat("flac", "audio/flac", "flac", "flac", "flac", pcm16_input=True, whole_file=True),
    AudioFormat("aac", "audio/aac", "aac", "adts", "aac", 64_000),
)}


# Whole files only: MP4 muxers seek back to write their index, so these are never streamed. Both carry chapters.
FILE_FORMATS: dict[str, AudioFormat] = {f.name: f for f in (
    AudioFormat("m4b", "audio/mp4", "m4b", "ipod", "aac", 96_000),  # audiobook: iTunes-style MP4
    AudioFormat("mp4", "audio/mp4", "mp4", "mp4", "aac", 96_000),
)}


@dataclass(frozen=True)
class Chapter:
    """A chapter marker of a file: ``title`` from ``start`` to ``end`` seconds."""

    title: str
    start: float
    end: float


def audio_format(name: str) -> AudioFormat:
    """The format called ``name`` (case-insensitive); :class:`InvalidInputError` naming the choices otherwise."""
    fmt = FORMATS.get(name.lower()) if isinstance(name, str) else None
    if fmt is None:
        raise InvalidInputError(f"unknown audio format {name!r}; use one of {', '.join(FORMATS)}")
    return fmt


def to_pcm16(samples: np.ndarray | torch.Tensor) -> np.ndarray:
    """float samples -> int16 with the reference servers' scaling (``x * 2**15`` cast to int16, which truncates
    toward zero). Clipped to the int16 range first: the reference's cast wraps a full-scale 1.0 to -32768."""
    x = _float32(samples) * PCM_SCALE
    return np.clip(x, -32768, 32767).astype(np.int16)


def wav_header(sample_rate: int, num_samples: int | None, channels: int = 1) -> bytes:
    """A 44-byte PCM16 WAV header; ``num_samples=None`` writes the "unknown length" sizes used for streaming."""
    block = 2 * channels
    data = 0xFFFFFFFF if num_samples is None else num_samples * block
    riff = 0xFFFFFFFF if num_samples is None else 36 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate,
                                                                          sample_rate * block, block, 16)
            + b"data" + struct.pack("<I", data))


class AudioEncoder:
    """A streaming encoder for one response: ``encode(chunk)`` returns the bytes ready so far, ``finish()``
    the rest. ``close()`` (or leaving a ``with`` block) releases an encoder that will not be finished."""

    def __init__(self, fmt: str | AudioFormat, sample_rate: int) -> None:
        self.format = fmt if isinstance(fmt, AudioFormat) else audio_format(fmt)
        self.sample_rate = sample_rate
        self.samples = 0  # samples fed so far
        self._header_sent = False
        self._finished = False
        self._sink: _Sink | io.BytesIO = io.BytesIO() if self.format.whole_file else _Sink()
        self._container: av.container.OutputContainer | None = None
        self._stream = None
        if self.format.container is not None:
            self._container = av.open(self._sink, mode="w", format=self.format.container,
                                      options=dict(self.format.options))
            self._stream = self._container.add_stream(self.format.codec, rate=sample_rate, layout="mono")
            if self.format.bit_rate:
                self._stream.bit_rate = self.format.bit_rate

    def encode(self, samples: np.ndarray | torch.Tensor) -> bytes:
        """Encode float samples in [-1, 1]; returns whatever bytes the format can emit now (may be empty)."""
        if self._finished:
            raise RuntimeError("encoder already finished")
        x = _float32(samples)
        self.samples += x.size
        if self._container is None:
            return self._raw(x)
        if x.size:
            for packet in self._stream.encode(_frame(x, self.format, self.sample_rate)):
                self._container.mux(packet)
        return b"" if self.format.whole_file else self._sink.take()

    def finish(self) -> bytes:
        """Flush the codec and close the container; the returned bytes complete the file."""
        if self._finished:
            return b""
        self._finished = True
        if self._container is None:
            return self._raw(np.zeros(0, np.float32))
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        self._container = None
        return self._sink.getvalue() if isinstance(self._sink, io.BytesIO) else self._sink.take()

    def close(self) -> None:
        """Drop the encoder without completing the file (a cancelled stream)."""
        self._finished = True
        if self._container is not None:
            self._container.close()
            self._container = None
        self._sink = _Sink()  # drops what was written

    def __enter__(self) -> AudioEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raw(self, x: np.ndarray) -> bytes:
        head = b""
        if self.format.name == "wav" and not self._header_sent:
            head = wav_header(self.sample_rate, None)
        self._header_sent = True
        return head + to_pcm16(x).tobytes()


def encode_audio(samples: np.ndarray | torch.Tensor, fmt: str | AudioFormat, sample_rate: int) -> bytes:
    """A whole waveform as one file; a WAV gets its exact sizes in the header."""
    fmt = fmt if isinstance(fmt, AudioFormat) else audio_format(fmt)
    x = _float32(samples)
    if fmt.name == "wav":
        return wav_header(sample_rate, x.size) + to_pcm16(x).tobytes()
    with AudioEncoder(fmt, sample_rate) as encoder:
        return encoder.encode(x) + encoder.finish()


def float_wav(samples: np.ndarray | torch.Tensor, sample_rate: int) -> bytes:
    """The stored take's format: a 32-bit float WAV, the samples exactly as made, so a mix of stored takes
    (long-form) is bit-identical however often it is made; answers are encoded from it as asked. Written here,
    not by libsndfile, whose PEAK chunk holds the time of writing: the same samples give the same bytes."""
    data = _float32(samples).astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHHH", 3, 1, sample_rate, sample_rate * 4, 4, 32, 0)  # IEEE float, mono, cbSize 0
    body = (b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"fact" + struct.pack("<II", 4, len(data) // 4)
            + b"data" + struct.pack("<I", len(data)) + data)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def file_format(name: str) -> AudioFormat:
    """A format for whole files: any of :data:`FORMATS` or :data:`FILE_FORMATS`, by name (case-insensitive)."""
    fmt = (FORMATS | FILE_FORMATS).get(name.lower()) if isinstance(name, str) else None
    if fmt is None:
        raise InvalidInputError(f"unknown audio format {name!r}; use one of {', '.join(FORMATS | FILE_FORMATS)}",
                                "format")
    return fmt


def encode_file(samples: np.ndarray | torch.Tensor, fmt: str | AudioFormat, sample_rate: int,
                chapters: Sequence[Chapter] = ()) -> bytes:
    """A whole waveform as one complete file of any :func:`file_format` (headers with the final sizes, which a
    stream cannot have); MP4 formats get ``chapters`` as markers (the others have none and ignore them)."""
    buffer = io.BytesIO()
    write_file(buffer, [samples], fmt, sample_rate, lambda: chapters)
    return buffer.getvalue()


def write_file(out: BinaryIO, pieces: Iterable[np.ndarray | torch.Tensor], fmt: str | AudioFormat,
               sample_rate: int, chapters: Callable[[], Sequence[Chapter]] | None = None) -> int:
    """Encode float ``pieces`` one after another into the seekable file ``out`` (so a long mix never has to
    be in memory at once); returns the samples written. ``chapters`` is asked for once every piece is written
    (a mix knows its chapter times only then). Headers get their final sizes: muxers seek back to patch them
    (MP4's index, FLAC's length), and a WAV header is rewritten at the end."""
    fmt = fmt if isinstance(fmt, AudioFormat) else file_format(fmt)
    total = 0
    if fmt.container is None:
        start = out.tell()
        if fmt.name == "wav":
            out.write(wav_header(sample_rate, 0))
        for piece in pieces:
            x = _float32(piece)
            total += x.size
            out.write(to_pcm16(x).tobytes())
        if fmt.name == "wav":
            end = out.seek(0, io.SEEK_CUR)
            out.seek(start)
            out.write(wav_header(sample_rate, total))
            out.seek(end)
        return total
    with av.open(out, mode="w", format=fmt.container, options=dict(fmt.options)) as container:
        stream = container.add_stream(fmt.codec, rate=sample_rate, layout="mono")
        if fmt.bit_rate:
            stream.bit_rate = fmt.bit_rate
        for piece in pieces:
            x = _float32(piece)
            if x.size:
                total += x.size
                for packet in stream.encode(_frame(x, fmt, sample_rate)):
                    container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
        marks = chapters() if chapters is not None else ()
        if marks:
            millis = Fraction(1, 1000)
            container.set_chapters([{"id": i + 1, "start": round(c.start * 1000), "end": round(c.end * 1000),
                                     "time_base": millis, "metadata": {"title": c.title}}
                                    for i, c in enumerate(marks)])
    return total


def _frame(x: np.ndarray, fmt: AudioFormat, sample_rate: int) -> av.AudioFrame:
    if fmt.pcm16_input:
        frame = av.AudioFrame.from_ndarray(to_pcm16(x).reshape(1, -1), format="s16", layout="mono")
    else:
        frame = av.AudioFrame.from_ndarray(x.reshape(1, -1), format="flt", layout="mono")
    frame.sample_rate = sample_rate
    return frame


def _float32(samples: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(samples, dtype=np.float32).reshape(-1))


class _Sink:
    """A write-only, non-seekable file for PyAV: what the muxer writes is collected until taken."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out
