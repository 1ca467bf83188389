"""Audio/prompt frontend: golden parity, decoding of every input kind, validation messages, resampling."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyvoice.errors import InvalidInputError, ModelBundleError
from cosyvoice.frontend.audio import decode_audio, downmix, load_prompt_audio, resample
from cosyvoice.frontend.features import MelParams, prompt_mel, slaney_mel_filterbank
from cosyvoice.frontend.onnx_models import CampPlus, SpeechTokenizer
from cosyvoice.frontend.prompt import PromptFeatures, extract_prompt_features
from cosyvoice.tools.parity.common import Golden, Result
from cosyvoice.tools.parity.frontend import check

REPO = Path(__file__).resolve().parents[1]


def _speechlike(seconds: float, sample_rate: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A few harmonics with a slow envelope, [frames, channels] float in [-0.5, 0.5]."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    rng = np.random.default_rng(seed)
    cols = []
    for c in range(channels):
        f0 = 120.0 + 40.0 * c
        tone = sum(np.sin(2 * np.pi * f0 * h * t + rng.uniform(0, np.pi)) / h for h in range(1, 6))
        cols.append(0.25 * tone * (0.6 + 0.4 * np.sin(2 * np.pi * 3.0 * t)))
    return np.stack(cols, axis=1)


def _wav_bytes(data: np.ndarray, sample_rate: int, fmt: str = "WAV", subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, data, sample_rate, format=fmt, subtype=subtype)
    return buf.getvalue()


# ----------------------------------------------------------------------------- golden parity


def _parity_results(golden: Golden) -> list[Result]:
    """The fixtures follow MKL's CPU-independent FFT path, chosen by MKL_CBWR before torch loads; if this
    process was started without it, run the check in a child process that has it."""
    if os.environ.get("MKL_CBWR"):
        return check(golden)
    code = ("import dataclasses, json, sys\n"
            "from cosyvoice.tools.parity.common import Golden\n"
            "from cosyvoice.tools.parity.frontend import check\n"
            "print(json.dumps([dataclasses.asdict(r) for r in check(Golden(sys.argv[1]))]))\n")
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code, str(golden.root)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [Result(**row) for row in json.loads(proc.stdout.strip().splitlines()[-1])]


def test_frontend_parity(golden: Golden) -> None:
    results = _parity_results(golden)
    names = {r.name for r in results}
    assert {"wav_16k", "speech_feat_mel80", "whisper_logmel128", "speech_tokens", "kaldi_fbank80_raw",
            "campplus_embedding", "zs_prompt_speech_feat", "zs_llm_embedding"} <= names
    failing = [r.row() for r in results if not r.passed]
    assert not failing, "\n".join(failing)


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("fmt,subtype,exact", [("WAV", "PCM_16", True), ("FLAC", "PCM_16", True),
                                               ("OGG", "VORBIS", False), ("MP3", "MPEG_LAYER_III", False)])
def test_decode_formats(tmp_path: Path, fmt: str, subtype: str, exact: bool) -> None:
    if subtype not in sf.available_subtypes(fmt):
        pytest.skip(f"this libsndfile build cannot write {fmt}/{subtype}")
    data = _speechlike(1.5, 24000)
    pcm = (data * 32767).astype(np.int16)
    path = tmp_path / f"prompt.{fmt.lower()}"
    sf.write(path, pcm if exact else data, 24000, format=fmt, subtype=subtype)
    samples, sample_rate = decode_audio(path)
    assert sample_rate == 24000 and samples.dtype == np.float32 and samples.shape[0] == 1
    if exact:  # int16 PCM reads back as int16 / 32768
        np.testing.assert_array_equal(samples[0], pcm[:, 0] / np.float32(32768.0))
    else:
        assert abs(samples.shape[1] - data.shape[0]) <= 1024
        n = min(samples.shape[1], data.shape[0])
        assert np.corrcoef(samples[0, :n], data[:n, 0])[0, 1] > 0.95


def test_int16_semantics_and_input_kinds(tmp_path: Path) -> None:
    pcm = (_speechlike(1.2, 16000)[:, 0] * 32767).astype(np.int16)
    raw = _wav_bytes(pcm, 16000)
    (tmp_path / "a.wav").write_bytes(raw)
    expected = pcm.astype(np.float32) / 32768.0
    decoded = [
        decode_audio(tmp_path / "a.wav"),
        decode_audio(str(tmp_path / "a.wav")),
        decode_audio(raw),
        decode_audio(io.BytesIO(raw)),
        decode_audio(memoryview(raw)),
        decode_audio((pcm, 16000)),
        decode_audio((16000, pcm)),  # Gradio's (sample_rate, array) order
        decode_audio((torch.from_numpy(expected), 16000)),
    ]
    with open(tmp_path / "a.wav", "rb") as f:
        decoded.append(decode_audio(f))
    for samples, sample_rate in decoded:
        assert sample_rate == 16000
        np.testing.assert_array_equal(samples[0], expected)


def test_stereo_downmix(tmp_path: Path) -> None:
    data = _speechlike(1.2, 22050, channels=2)
    path = tmp_path / "stereo.wav"
    sf.write(path, data, 22050, subtype="FLOAT")
    wav, sample_rate = load_prompt_audio(path)
    assert sample_rate == 22050 and wav.shape == (1, data.shape[0])
    np.testing.assert_allclose(wav[0].numpy(), data.astype(np.float32).mean(axis=1), atol=1e-7)
    # arrays: [frames, channels] and [channels, frames] mean the same thing
    a, _ = decode_audio((data, 22050))
    b, _ = decode_audio((data.T.copy(), 22050))
    np.testing.assert_array_equal(a, b)
    assert downmix(a).shape == (1, data.shape[0])


# ----------------------------------------------------------------------------- validation messages


def _rejects(source: object, match: str, **limits: float) -> None:
    with pytest.raises(InvalidInputError, match=match):
        load_prompt_audio(source, **limits)


def test_rejects_low_sample_rate() -> None:
    _rejects((_speechlike(2.0, 8000)[:, 0], 8000), r"8000 Hz; it must be at least 16 kHz")


def test_rejects_too_short() -> None:
    _rejects(_wav_bytes(_speechlike(0.5, 16000), 16000), r"0\.50 s long; it must be at least 1 s")


def test_rejects_too_long(tmp_path: Path) -> None:
    path = tmp_path / "long.wav"
    sf.write(path, _speechlike(31.0, 16000), 16000)
    _rejects(path, r"31\.00 s long; at most 30 s")
    _rejects((_speechlike(31.0, 16000)[:, 0], 16000), r"31\.00 s long; at most 30 s")
    _rejects((_speechlike(12.0, 16000)[:, 0], 16000), r"12\.00 s long; at most 10 s", max_seconds=10.0)


def test_rejects_silence_and_garbage() -> None:
    _rejects(_wav_bytes(np.zeros(32000), 16000), r"silent \(peak amplitude 0\.00e\+00\)")
    _rejects(b"junk" + np.random.default_rng(0).bytes(4096), r"not a recognised audio file")
    _rejects(np.random.default_rng(0).bytes(4096), r"not a recognised audio file")
    _rejects(b"", r"empty \(0 bytes\)")
    _rejects(Path("/nonexistent/prompt.wav"), r"does not exist")
    _rejects((np.full(32000, np.nan), 16000), r"NaN or infinite")
    _rejects(12345, r"unsupported audio input of type int")


# ----------------------------------------------------------------------------- ffmpeg fallback


_WEBM_MAGIC = b"\x1a\x45\xdf\xa3"


def test_browser_format_without_ffmpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    _rejects(_WEBM_MAGIC + b"\x00" * 512, r"cannot decode WebM/Matroska audio .* no 'ffmpeg' binary is on PATH")


def test_ffmpeg_fallback_plumbing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in ``ffmpeg`` that understands '<webm magic> + int16 PCM at 16 kHz' checks the subprocess path."""
    script = tmp_path / "ffmpeg"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, numpy as np, soundfile as sf\n"
        "args = sys.argv[1:]\n"
        "data = open(args[args.index('-i') + 1], 'rb').read()\n"
        f"if not data.startswith({_WEBM_MAGIC!r}):\n"
        "    sys.stderr.write('Invalid data found when processing input\\n'); sys.exit(1)\n"
        "pcm = np.frombuffer(data[4:], dtype=np.int16)\n"
        "if '-t' in args:\n"
        "    pcm = pcm[:int(float(args[args.index('-t') + 1]) * 16000)]\n"
        "sf.write(args[-1], np.stack([pcm, pcm], 1) / 32768.0, 16000, subtype='FLOAT', format='WAV')\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    pcm = (_speechlike(1.5, 16000)[:, 0] * 32767).astype(np.int16)
    wav, sample_rate = load_prompt_audio(_WEBM_MAGIC + pcm.tobytes())
    assert sample_rate == 16000
    np.testing.assert_array_equal(wav[0].numpy(), pcm / np.float32(32768.0))
    _rejects(b"junk" + np.random.default_rng(1).bytes(4096), r"not a recognised audio file; upload a recording \(WAV")
    long_pcm = np.tile(pcm, 30)  # 45 s; decoding stops at 31 s
    _rejects(_WEBM_MAGIC + long_pcm.tobytes(), r"longer than 30 s; at most 30 s is supported")


# ----------------------------------------------------------------------------- resampling


@pytest.mark.parametrize("orig_sr", [44100, 48000, 22050])
def test_resample_sine(orig_sr: int) -> None:
    for freq in (440.0, 3000.0):
        n = 2 * orig_sr
        x = torch.from_numpy((0.5 * np.sin(2 * np.pi * freq * np.arange(n) / orig_sr)).astype(np.float32))
        y = resample(x[None], orig_sr, 16000)[0].numpy()
        assert y.shape[0] == math.ceil(n * 16000 / orig_sr)
        ref = 0.5 * np.sin(2 * np.pi * freq * np.arange(y.shape[0]) / 16000)
        inner = slice(200, -200)  # away from the zero-padded ends
        assert np.abs(y[inner] - ref[inner]).max() < 1e-3
        assert abs(np.sqrt(np.mean(y[inner] ** 2)) / np.sqrt(np.mean(ref[inner] ** 2)) - 1.0) < 1e-3
        spectrum = np.abs(np.fft.rfft(y[inner] * np.hanning(y[inner].shape[0])))
        assert abs(np.argmax(spectrum) * 16000 / y[inner].shape[0] - freq) < 1.0
    # a tone above the new Nyquist frequency is mostly removed, not folded back
    x = torch.from_numpy((0.5 * np.sin(2 * np.pi * 9000.0 * np.arange(orig_sr) / orig_sr)).astype(np.float32))
    assert resample(x, orig_sr, 16000)[200:-200].pow(2).mean().sqrt() < 0.2 * 0.5 / math.sqrt(2)


def test_resample_matches_windowed_sinc_formula() -> None:
    """Each output sample is sum_i x[i] * h(t_i): Hann-windowed sinc, cutoff 0.99 * min rate, 6 zero crossings."""
    orig_sr, new_sr = 44100, 16000
    x = np.random.default_rng(0).standard_normal(4000)
    y = resample(torch.from_numpy(x.astype(np.float32)), orig_sr, new_sr).numpy()
    g = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // g, new_sr // g
    cutoff = 0.99 * min(orig, new)
    for k in (0, 7, 500, 1001, y.shape[0] - 1):
        t = np.clip((np.arange(x.shape[0]) / orig - k / new) * cutoff, -6, 6)
        h = np.sinc(t) * np.cos(np.pi * t / 12) ** 2 * cutoff / orig
        assert abs(y[k] - np.dot(x, h)) < 1e-5
    assert resample(torch.ones(3, 2, 100), 16000, 16000).shape == (3, 2, 100)
    assert resample(torch.ones(3, 2, 441), 44100, 16000).shape == (3, 2, 160)


# ----------------------------------------------------------------------------- features and prompt


def test_mel_cache_is_keyed_by_all_parameters() -> None:
    wav = torch.from_numpy(_speechlike(1.0, 24000)[:, 0].astype(np.float32))[None]
    assert prompt_mel(wav).shape[1] == 80
    assert prompt_mel(wav, MelParams(num_mels=40)).shape[1] == 40  # same fmax, different basis
    assert not np.array_equal(slaney_mel_filterbank(24000, 1920, 80)[:40], slaney_mel_filterbank(24000, 1920, 40))
    basis = slaney_mel_filterbank(16000, 400, 128)
    assert basis.shape == (128, 201) and not basis.flags.writeable


@pytest.fixture(scope="module")
def onnx_models(golden: Golden) -> tuple[SpeechTokenizer, CampPlus]:
    return SpeechTokenizer.from_model_dir(golden.bundle_dir), CampPlus.from_model_dir(golden.bundle_dir)


def test_extract_prompt_features(onnx_models: tuple[SpeechTokenizer, CampPlus]) -> None:
    tokenizer, campplus = onnx_models
    for seconds, sample_rate in ((1.37, 44100), (2.0, 16000)):
        wav = torch.from_numpy(_speechlike(seconds, sample_rate)[:, 0].astype(np.float32))
        feats = extract_prompt_features(wav, sample_rate, tokenizer, campplus)
        n_tok = feats.speech_token.shape[1]
        assert feats.speech_feat.shape == (1, 2 * n_tok, 80) and feats.speech_feat.dtype == torch.float32
        assert feats.speech_token.dtype == torch.int32 and n_tok >= int(seconds * 25) - 1
        assert feats.embedding.shape == (1, 192)
        assert PromptFeatures.from_tensors(feats.tensors()).speech_token.equal(feats.speech_token)
    with pytest.raises(InvalidInputError, match="lack"):
        PromptFeatures.from_tensors({"speech_feat": feats.speech_feat})


def test_tokenizer_limit_and_threads(onnx_models: tuple[SpeechTokenizer, CampPlus]) -> None:
    tokenizer, campplus = onnx_models
    with pytest.raises(InvalidInputError, match=r"at most 30 s of audio, got 31\.00 s"):
        tokenizer(torch.zeros(1, 31 * 16000))
    wavs = [torch.from_numpy(_speechlike(1.0 + 0.1 * i, 16000, seed=i)[:, 0].astype(np.float32))[None]
            for i in range(4)]
    expected = [(tokenizer(w), campplus(w)) for w in wavs]
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, (tokenizer(wavs[i]), campplus(wavs[i]))))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert got[i][0].equal(expected[i][0]) and got[i][1].equal(expected[i][1])


def test_missing_onnx_file(tmp_path: Path) -> None:
    with pytest.raises(ModelBundleError, match=r"campplus\.onnx is missing"):
        CampPlus.from_model_dir(tmp_path)
    (tmp_path / "speech_tokenizer_v3.onnx").write_bytes(b"not onnx")
    with pytest.raises(ModelBundleError, match="not a loadable ONNX model"):
        SpeechTokenizer.from_model_dir(tmp_path)
