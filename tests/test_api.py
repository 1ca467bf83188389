"""The official-compatible API on the generated tiny bundle: every mode, streaming and not, bad input."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyvoice.errors import InvalidInputError, ModelBundleError
from cosyvoice.frontend.prompts import cross_lingual_text, instruct_text, zero_shot_prompt_text
from cosyvoice.pipeline import text_plan
from cosyvoice.spkinfo import read_spkinfo

TEXT = "Hello there, my friend, how are you today?"
PROMPT_TEXT = zero_shot_prompt_text("Hello, this is a short prompt for testing.")


def _speech(outputs: list[dict]) -> torch.Tensor:
    for out in outputs:
        assert set(out) == {"tts_speech"}
        assert out["tts_speech"].dtype == torch.float32 and out["tts_speech"].dim() == 2
        assert out["tts_speech"].shape[0] == 1
    return torch.cat([o["tts_speech"] for o in outputs], dim=1)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct2"])
def test_every_mode_produces_24khz_audio(tts, prompt_wav: Path, mode: str, stream: bool) -> None:
    if mode == "zero_shot":
        outs = list(tts.inference_zero_shot(TEXT, PROMPT_TEXT, str(prompt_wav), stream=stream, seed=3))
    elif mode == "cross_lingual":
        outs = list(tts.inference_cross_lingual(cross_lingual_text(TEXT), str(prompt_wav), stream=stream, seed=3))
    else:
        outs = list(tts.inference_instruct2(TEXT, instruct_text("Speak slowly and calmly."), str(prompt_wav),
                                            stream=stream, seed=3))
    assert tts.sample_rate == 24000
    speech = _speech(outs)
    assert speech.shape[1] > 0 and speech.shape[1] % 480 == 0  # whole mel frames of 480 samples at 24 kHz
    assert float(speech.abs().max()) <= 0.99 + 1e-6
    assert torch.isfinite(speech).all()
    if stream:
        assert len(outs) >= 2, "a text this long must stream in more than one chunk"
    else:
        assert len(outs) == 1


def test_streaming_chunks_carry_consistent_metadata(tts, prompt_wav: Path) -> None:
    chunks = list(tts.synthesize("zero_shot", TEXT, prompt_text=PROMPT_TEXT, prompt_wav=prompt_wav, stream=True,
                                 seed=11))
    assert [c.index for c in chunks] == list(range(len(chunks)))
    offset = 0
    for c in chunks:
        assert c.sample_offset == offset and c.sample_rate == 24000
        offset += c.pcm.numel()
        assert c.token_end >= c.token_start and c.seconds_to_produce >= 0
    assert chunks[-1].final
    assert all(a.token_end == b.token_start for a, b in itertools.pairwise(chunks) if not a.final)
    assert chunks[0].int16().dtype == np.int16


def test_same_seed_same_samples_other_seed_differs(tts, prompt_wav: Path) -> None:
    def run(seed: int) -> torch.Tensor:
        return _speech(list(tts.inference_zero_shot(TEXT, PROMPT_TEXT, prompt_wav, seed=seed)))

    a, b, c = run(5), run(5), run(6)
    assert torch.equal(a, b)
    assert a.shape != c.shape or not torch.equal(a, c)


def test_prompt_wav_accepts_path_filelike_and_array(tts, prompt_wav: Path) -> None:
    data, sr = sf.read(prompt_wav, dtype="float32")
    ref = _speech(list(tts.inference_zero_shot(TEXT, PROMPT_TEXT, str(prompt_wav), seed=2)))
    from_file = _speech(list(tts.inference_zero_shot(TEXT, PROMPT_TEXT, io.BytesIO(prompt_wav.read_bytes()), seed=2)))
    from_array = _speech(list(tts.inference_zero_shot(TEXT, PROMPT_TEXT, (data, sr), seed=2)))
    assert torch.equal(ref, from_file)
    assert torch.allclose(ref, from_array, atol=1e-4) and ref.shape == from_array.shape


def test_speed_changes_duration_streamed_or_not(tts, prompt_wav: Path) -> None:
    normal = _speech(list(tts.inference_zero_shot(TEXT, PROMPT_TEXT, prompt_wav, seed=4)))
    fast = _speech(list(tts.inference_zero_shot(TEXT, PROMPT_TEXT, prompt_wav, seed=4, speed=1.5)))
    assert fast.shape[1] == pytest.approx(normal.shape[1] / 1.5, rel=0.02)
    streamed = _speech(list(tts.inference_zero_shot(TEXT, PROMPT_TEXT, prompt_wav, stream=True, seed=4, speed=1.5)))
    assert abs(streamed.shape[1] - fast.shape[1]) <= 480  # see tests/test_compat.py for 0.5 and 1.5
    with pytest.raises(InvalidInputError, match=r"between 0\.5 and 2"):
        tts.inference_zero_shot(TEXT, PROMPT_TEXT, prompt_wav, speed=7)


def test_saved_voice_matches_prompt_and_round_trips(tts, prompt_wav: Path, tmp_path: Path) -> None:
    assert tts.add_zero_shot_spk(PROMPT_TEXT, prompt_wav, "alice")
    assert "alice" in tts.list_available_spks()
    direct = _speech(list(tts.inference_zero_shot(TEXT, PROMPT_TEXT, prompt_wav, seed=9, text_frontend=True)))
    saved = _speech(list(tts.inference_zero_shot(TEXT, "", None, zero_shot_spk_id="alice", seed=9)))
    assert torch.equal(direct, saved)
    tts.save_spkinfo()
    stored = torch.load(Path(tts.model_dir) / "spk2info.pt", weights_only=True)
    assert set(stored["alice"]) >= {"prompt_text", "llm_prompt_speech_token", "flow_prompt_speech_token",
                                    "prompt_speech_feat", "flow_embedding"}
    reloaded = read_spkinfo(Path(tts.model_dir) / "spk2info.pt")
    assert torch.equal(reloaded.voices["alice"].features.speech_feat, tts.spk2info["alice"].features.speech_feat)


def test_auto_model_and_package_exports(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    import cosyvoice
    from cosyvoice.cli.cosyvoice import AutoModel, CosyVoice3

    assert cosyvoice.CosyVoice3 is CosyVoice3
    model = AutoModel(model_dir=str(tiny_bundle_dir), device="cpu")
    assert isinstance(model, CosyVoice3) and model.sample_rate == 24000
    (tmp_path / "cosyvoice2.yaml").write_text("sample_rate: 24000\n")
    with pytest.raises(ModelBundleError, match="CosyVoice3"):
        AutoModel(model_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------- bad input


def _write(path: Path, samples: np.ndarray, sr: int) -> Path:
    sf.write(path, samples.astype(np.float32), sr)
    return path


def _tone(seconds: float, sr: int) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return 0.3 * np.sin(2 * np.pi * 200 * t)


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_empty_text_is_refused(tts, prompt_wav: Path, text: str) -> None:
    with pytest.raises(InvalidInputError, match="empty"):
        tts.inference_zero_shot(text, PROMPT_TEXT, prompt_wav)


def test_text_over_the_limit_is_refused(tts, prompt_wav: Path) -> None:
    too_long = "word " * (tts.limits.max_text_chars // 5 + 1)
    with pytest.raises(InvalidInputError, match=r"at most \d+ are allowed"):
        tts.inference_zero_shot(too_long, PROMPT_TEXT, prompt_wav)


def test_prompt_that_is_not_audio(tts, tmp_path: Path) -> None:
    junk = tmp_path / "notes.wav"
    junk.write_bytes(np.random.default_rng(0).bytes(4000))
    with pytest.raises(InvalidInputError, match=r"(?i)audio"):
        tts.inference_zero_shot(TEXT, PROMPT_TEXT, junk)


def test_silent_prompt(tts, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="silent"):
        tts.inference_zero_shot(TEXT, PROMPT_TEXT, _write(tmp_path / "s.wav", np.zeros(48000), 24000))


def test_too_short_prompt(tts, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="at least 1 s"):
        tts.inference_cross_lingual(TEXT, _write(tmp_path / "short.wav", _tone(0.5, 24000), 24000))


def test_too_long_prompt(tts, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="at most 30 s"):
        tts.inference_cross_lingual(TEXT, _write(tmp_path / "long.wav", _tone(31, 16000), 16000))


def test_low_sample_rate_prompt(tts, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="16 kHz"):
        tts.inference_cross_lingual(TEXT, _write(tmp_path / "phone.wav", _tone(2, 8000), 8000))


@pytest.mark.parametrize("prompt_text", ["", "  "])
def test_zero_shot_without_prompt_text(tts, prompt_wav: Path, prompt_text: str) -> None:
    with pytest.raises(InvalidInputError, match="transcript"):
        tts.inference_zero_shot(TEXT, prompt_text, prompt_wav)


def test_unknown_speaker_id(tts) -> None:
    with pytest.raises(InvalidInputError, match="unknown speaker id 'nobody'"):
        tts.inference_zero_shot(TEXT, "", None, zero_shot_spk_id="nobody")


def test_missing_prompt_audio(tts) -> None:
    with pytest.raises(InvalidInputError, match="prompt recording"):
        tts.inference_cross_lingual(TEXT, None)


def test_precision_choice(tiny_bundle_dir: Path) -> None:
    from cosyvoice.cli.cosyvoice import CosyVoice3

    with pytest.raises(InvalidInputError, match="dtype must be one of"):
        CosyVoice3(tiny_bundle_dir, device="cpu", dtype="int8")
    cpu = CosyVoice3(tiny_bundle_dir, device="cpu", dtype="bf16")  # half precision is CUDA-only, as the reference
    assert cpu.engine.llm.speech_embedding.weight.dtype == torch.float32 and not cpu.fp16


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "7"])
def test_bad_seed(tts, prompt_wav: Path, seed) -> None:
    with pytest.raises(InvalidInputError, match="seed must be an integer"):
        tts.inference_zero_shot(TEXT, PROMPT_TEXT, prompt_wav, seed=seed)


def test_missing_end_of_prompt_is_reported_at_the_call(tts, prompt_wav: Path) -> None:
    with pytest.raises(InvalidInputError, match="endofprompt"):
        tts.inference_cross_lingual(TEXT, prompt_wav)  # plain text: the official API takes text as given
    with pytest.raises(InvalidInputError, match="endofprompt"):
        tts.inference_instruct2(TEXT, "Speak slowly.", prompt_wav)
    with pytest.raises(InvalidInputError, match="endofprompt"):
        tts.inference_zero_shot(TEXT, "Hello, this is a short prompt for testing.", prompt_wav)


def test_split_prefixed_speaks_long_cross_lingual_text_sentence_by_sentence(tts) -> None:
    text = cross_lingual_text(" ".join(["This sentence is one of many in a long paragraph."] * 12))
    head, pieces = text_plan(tts.frontend, "zero_shot", text, split_prefixed=False)
    assert pieces == [text] and not head.numel()  # the reference's rule: prefixed text is one segment
    head, pieces = text_plan(tts.frontend, "zero_shot", text, split_prefixed=True)
    assert len(pieces) > 1 and not any("<|endofprompt|>" in p for p in pieces)
    assert tts.frontend.tokenizer.decode(head[0].tolist(), skip_special_tokens=False) == \
        "You are a helpful assistant.<|endofprompt|>"  # the head's ids go before every piece's ids


def test_oversized_upload_is_refused_before_decoding(prompt_wav: Path) -> None:
    from cosyvoice.frontend.audio import load_prompt_audio

    data = prompt_wav.read_bytes()
    for source in (data, io.BytesIO(data), prompt_wav):
        with pytest.raises(InvalidInputError, match="upload limit"):
            load_prompt_audio(source, max_bytes=len(data) - 1)
    assert load_prompt_audio(data, max_bytes=len(data))[1] == 24000
