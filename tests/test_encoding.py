"""The one audio-encoding module: every format decodes back to the same length, streamed or whole."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile as sf

from cosyvoice.encoding import FORMATS, AudioEncoder, audio_format, encode_audio, to_pcm16, wav_header
from cosyvoice.errors import InvalidInputError

SR = 24000
# (codec padding in samples each format may add or trim at the ends, at 24 kHz)
SLACK = {"pcm": 0, "wav": 0, "flac": 0, "mp3": 1152 * 2, "aac": 1024 * 2, "opus": 960 * 2}


def _tone(seconds: float = 1.3) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.4 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 1.5 * t)).astype(np.float32)


def _decode(data: bytes, name: str) -> tuple[np.ndarray, int]:
    """Samples and rate of an encoded file, decoded by libsndfile (PCM formats) or FFmpeg (compressed)."""
    if name == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768, SR
    if name == "wav":
        x, sr = sf.read(io.BytesIO(data), dtype="float32")
        return x, sr
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        to_float = av.AudioResampler(format="flt", layout="mono")
        frames = [g.to_ndarray().reshape(-1) for f in container.decode(stream) for g in to_float.resample(f)]
        frames += [g.to_ndarray().reshape(-1) for g in to_float.resample(None)]
        rate = stream.codec_context.sample_rate
    return np.concatenate(frames), rate


@pytest.mark.parametrize("name", list(FORMATS))
def test_streamed_output_decodes_to_the_input_length(name: str) -> None:
    x = _tone()
    encoder = AudioEncoder(name, SR)
    parts = [encoder.encode(x[i:i + 2400]) for i in range(0, x.size, 2400)]
    parts.append(encoder.finish())
    data = b"".join(parts)
    if not FORMATS[name].whole_file:  # bytes leave before the end: the point of streaming
        assert sum(len(p) for p in parts[: len(parts) // 2]) > 0
    decoded, rate = _decode(data, name)
    seconds = decoded.size / rate
    assert abs(seconds - x.size / SR) <= SLACK[name] / SR + 1e-9, (name, seconds)
    assert np.abs(decoded).max() > 0.2  # the tone, not silence


@pytest.mark.parametrize("name", list(FORMATS))
def test_whole_file_decodes(name: str) -> None:
    x = _tone(0.7)
    decoded, rate = _decode(encode_audio(x, name, SR), name)
    assert abs(decoded.size / rate - x.size / SR) <= SLACK[name] / SR + 1e-9


@pytest.mark.parametrize("name", ["pcm", "wav", "flac"])
def test_lossless_formats_are_exact(name: str) -> None:
    x = _tone(0.5)
    decoded, _ = _decode(encode_audio(x, name, SR), name)
    np.testing.assert_array_equal(np.round(decoded * 32768).astype(np.int16), to_pcm16(x))


def test_wav_header_sizes() -> None:
    data = encode_audio(np.zeros(1000, np.float32), "wav", SR)
    assert len(data) == 44 + 2000
    info = sf.info(io.BytesIO(data))
    assert info.frames == 1000 and info.samplerate == SR and info.channels == 1
    assert wav_header(SR, None)[4:8] == b"\xff\xff\xff\xff"


def test_pcm16_uses_the_reference_scaling_and_never_wraps() -> None:
    pcm = to_pcm16(np.array([0.5, -0.5, 0.99, 1.0, -1.0, 1.5, 0.00002], np.float32))
    # x * 2**15 truncated toward zero, as numpy's astype in the reference servers; full scale is clipped
    assert pcm.tolist() == [16384, -16384, 32440, 32767, -32768, 32767, 0]


def test_formats_table_and_unknown_name() -> None:
    assert audio_format("MP3").content_type == "audio/mpeg"
    assert {f.extension for f in FORMATS.values()} == {"pcm", "wav", "mp3", "opus", "flac", "aac"}
    with pytest.raises(InvalidInputError, match="unknown audio format 'ogg'"):
        audio_format("ogg")


def test_closing_an_unfinished_encoder_is_safe() -> None:
    for name in FORMATS:
        with AudioEncoder(name, SR) as encoder:
            encoder.encode(_tone(0.1))
        AudioEncoder(name, SR).close()  # never fed
        with pytest.raises(RuntimeError):
            encoder.encode(_tone(0.1))


# formats libsndfile reads (its MP3 and Ogg Opus support since 1.1); AAC/ADTS only FFmpeg reads
SOUNDFILE_FORMATS = ("wav", "flac", "mp3", "opus")


@pytest.mark.parametrize("name", SOUNDFILE_FORMATS)
def test_soundfile_reads_every_file_it_supports_streamed_or_whole(name: str) -> None:
    """A FLAC's STREAMINFO must hold the total sample count: libsndfile refuses one that says 0 ("array is too
    big"), which a FLAC muxed into a non-seekable stream does."""
    x = _tone()
    encoder = AudioEncoder(name, SR)
    streamed = b"".join(encoder.encode(x[i:i + 2400]) for i in range(0, x.size, 2400)) + encoder.finish()
    for data in (streamed, encode_audio(x, name, SR)):
        info = sf.info(io.BytesIO(data))
        decoded, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == SR and abs(decoded.size - x.size) <= SLACK[name]
        if name in ("wav", "flac"):
            assert info.frames == x.size


def test_flac_comes_whole_at_finish() -> None:
    encoder = AudioEncoder("flac", SR)
    assert encoder.encode(_tone()) == b""  # nothing before the header can be completed
    data = encoder.finish()
    assert sf.info(io.BytesIO(data)).frames == _tone().size
