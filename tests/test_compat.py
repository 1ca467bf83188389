"""Drop-in compatibility: text given as a stream, speed while streaming, the global seed, the official
module paths, inference_sft / instruct / vc, tensor prompts (issue 7)."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyvoice.cli.cosyvoice import TextStreamClosedError
from cosyvoice.errors import CosyVoiceError, InvalidInputError
from cosyvoice.frontend.prompts import instruct_text, zero_shot_prompt_text
from cosyvoice.hifigan.speed import MelTimeScale
from cosyvoice.utils.common import set_all_random_seed
from cosyvoice.utils.file_utils import load_wav

TEXT = "Hello there, my friend, how are you today?"
SHORT = "Hi there."  # the tiny random model speaks up to 20 tokens per text token: short text keeps tests fast
PIECES = ["Hello there, ", "my friend, ", "how are you?"]
PROMPT_TEXT = zero_shot_prompt_text("Hello, this is a short prompt for testing.")
INSTRUCTION = instruct_text("Speak slowly and calmly.")


def _cat(outputs) -> torch.Tensor:
    return torch.cat([o["tts_speech"] for o in outputs], dim=1)


def _pieces():
    yield from PIECES


# ----------------------------------------------------------------------------- text given as a stream


@pytest.mark.parametrize("mode", ["zero_shot", "instruct2"])
def test_a_generator_of_text_pieces_streams_audio(tts, short_prompt_wav: Path, mode: str) -> None:
    def run(seed: int) -> list[dict]:
        if mode == "zero_shot":
            return list(tts.inference_zero_shot(_pieces(), PROMPT_TEXT, str(short_prompt_wav), stream=True, seed=seed))
        return list(tts.inference_instruct2(_pieces(), INSTRUCTION, str(short_prompt_wav), stream=True, seed=seed))

    outs = run(3)
    assert len(outs) >= 2, "the text-stream request must stream more than one chunk"
    speech = _cat(outs)
    assert speech.shape[1] % 480 == 0 and speech.shape[1] > 0 and torch.isfinite(speech).all()
    assert torch.equal(speech, _cat(run(3)))  # the schedule does not depend on when the pieces arrive


def test_text_stream_writer_speaks_before_the_text_ends(tts, short_prompt_wav: Path) -> None:
    writer, chunks = tts.synthesize_stream("zero_shot", prompt_text=PROMPT_TEXT, prompt_wav=str(short_prompt_wav),
                                           seed=1)
    watchdog = threading.Timer(120, writer.close, args=(RuntimeError("no audio before the text ended"),))
    watchdog.start()
    try:
        for piece in PIECES * 4:  # enough text for the first chunk; the writer is not closed
            writer.write(piece)
        first = next(chunks)
        assert not writer.closed and first.pcm.numel() > 0 and not first.final and first.index == 0
    finally:
        watchdog.cancel()
    chunks.close()  # the listener goes away while the producer waits for more text
    assert tts.engine.active_sessions == 0
    with pytest.raises(TextStreamClosedError):
        writer.write("anyone there?")


def test_a_failing_generator_fails_the_request_with_its_error(tts, short_prompt_wav: Path) -> None:
    def broken():
        yield "Hello there, "
        raise ConnectionError("chat model went away")

    with pytest.raises(CosyVoiceError, match="chat model went away"):
        list(tts.inference_zero_shot(broken(), PROMPT_TEXT, str(short_prompt_wav), stream=True, seed=0))
    assert tts.engine.active_sessions == 0


def test_text_stream_input_errors(tts, short_prompt_wav: Path) -> None:
    with pytest.raises(InvalidInputError, match="zero_shot and instruct2"):
        tts.inference_cross_lingual(iter(PIECES), str(short_prompt_wav))
    with pytest.raises(InvalidInputError, match="endofprompt"):  # at the call, before any work
        tts.inference_instruct2(iter(PIECES), "Speak slowly.", str(short_prompt_wav))
    with pytest.raises(CosyVoiceError, match="must be strings"):
        list(tts.inference_zero_shot(iter([b"bytes"]), PROMPT_TEXT, str(short_prompt_wav), seed=0))


# ----------------------------------------------------------------------------- speed


@pytest.mark.parametrize("speed", [0.5, 0.8, 1.5, 2.0])
def test_mel_time_scale_streams_the_whole_stretch(speed: float) -> None:
    t = torch.arange(173, dtype=torch.float32)
    mel = torch.stack([torch.sin(t * k / 200) for k in range(1, 81)])[None]  # smooth over frames, like a mel
    whole = torch.nn.functional.interpolate(mel, size=int(173 / speed), mode="linear")
    scale = MelTimeScale(speed)
    cuts = [0, 1, 50, 51, 100, 150, 173]
    streamed = torch.cat([scale(mel[:, :, a:b], finalize=b == 173) for a, b in itertools.pairwise(cuts)], dim=2)
    assert streamed.shape == whole.shape  # exactly the non-streamed frame count
    assert torch.equal(streamed, MelTimeScale(speed)(mel, finalize=True))  # chunk boundaries leave no seam
    # the non-streamed stretch up to the rate's rounding (int(T / speed) frames): its read positions drift by at
    # most `speed` input frames at the very end, times the steepest channel's slope (0.4 per frame)
    assert float((streamed - whole).abs().max()) <= speed * 0.4 + 1e-4
    with pytest.raises(RuntimeError, match="finalised"):
        scale(mel, finalize=True)


@pytest.mark.parametrize("speed", [1.5, 0.5])
def test_streamed_speed_gives_the_non_streamed_length(tts, short_prompt_wav: Path, speed: float) -> None:
    def run(stream: bool) -> list:
        return list(tts.synthesize("zero_shot", TEXT, prompt_text=PROMPT_TEXT, prompt_wav=str(short_prompt_wav),
                                   stream=stream, speed=speed, seed=21))

    whole, streamed = run(False), run(True)
    assert len(streamed) >= 2
    normal = sum(c.pcm.numel() for c in tts.synthesize("zero_shot", TEXT, prompt_text=PROMPT_TEXT,
                                                       prompt_wav=str(short_prompt_wav), seed=21))
    n_whole, n_streamed = sum(c.pcm.numel() for c in whole), sum(c.pcm.numel() for c in streamed)
    assert n_whole == pytest.approx(normal / speed, rel=0.02)
    assert abs(n_streamed - n_whole) <= 480  # one mel frame: the rounding of one chunk boundary at most
    pcm = torch.cat([c.pcm for c in streamed])
    assert torch.isfinite(pcm).all()


@pytest.mark.parametrize("speed", [np.float32(1.25), torch.tensor(1.25), np.float64(1.25), 1, torch.tensor([1.0])])
def test_numeric_scalars_are_speeds(tts, short_prompt_wav: Path, speed) -> None:
    outs = list(tts.inference_zero_shot("Hi.", PROMPT_TEXT, str(short_prompt_wav), speed=speed, seed=0))
    assert _cat(outs).shape[1] > 0


@pytest.mark.parametrize("speed", [3.0, True, "1.0", torch.tensor([1.0, 2.0]), float("nan")])
def test_bad_speeds_are_refused_at_the_call(tts, short_prompt_wav: Path, speed) -> None:
    with pytest.raises(InvalidInputError, match=r"speed must be between 0\.5 and 2"):
        tts.inference_zero_shot(TEXT, PROMPT_TEXT, str(short_prompt_wav), speed=speed)


# ----------------------------------------------------------------------------- global seed


def test_global_seed_makes_unseeded_calls_repeatable(tts, short_prompt_wav: Path) -> None:
    def run() -> torch.Tensor:
        return _cat(tts.inference_zero_shot(SHORT, PROMPT_TEXT, str(short_prompt_wav)))

    torch.manual_seed(7)
    a = run()
    torch.manual_seed(7)
    b = run()
    set_all_random_seed(7)
    c = run()
    set_all_random_seed(8)
    d = run()
    assert torch.equal(a, b) and torch.equal(a, c)
    assert a.shape != d.shape or not torch.equal(a, d)
    torch.manual_seed(7)  # an explicit seed is used as is, whatever the global generator says
    assert torch.equal(_cat(tts.inference_zero_shot(SHORT, PROMPT_TEXT, str(short_prompt_wav), seed=5)),
                       _cat(tts.inference_zero_shot(SHORT, PROMPT_TEXT, str(short_prompt_wav), seed=5)))


def test_set_all_random_seed_seeds_every_generator() -> None:
    import random

    set_all_random_seed(3.0)  # a UI number box gives floats
    first = (random.random(), np.random.rand(), torch.rand(()).item())
    set_all_random_seed(3)
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == first
    with pytest.raises(InvalidInputError):
        set_all_random_seed(1.5)


# ----------------------------------------------------------------------------- official module paths, prompts


def test_load_wav_returns_mono_at_the_target_rate(tmp_path: Path) -> None:
    stereo = np.stack([np.linspace(-0.5, 0.5, 24000), np.zeros(24000)], axis=1).astype(np.float32)
    sf.write(tmp_path / "s.wav", stereo, 24000)
    wav = load_wav(str(tmp_path / "s.wav"), 16000)
    assert wav.shape == (1, 16000) and wav.dtype == torch.float32
    same = load_wav(tmp_path / "s.wav", 24000)
    assert same.shape == (1, 24000) and torch.allclose(same[0], torch.from_numpy(stereo.mean(1)), atol=1e-4)
    with open(tmp_path / "s.wav", "rb") as f:  # the FastAPI server passes UploadFile.file
        assert torch.equal(load_wav(f, 16000), wav)
    sf.write(tmp_path / "low.wav", stereo[:8000], 8000)
    with pytest.raises(InvalidInputError, match="8000 Hz"):
        load_wav(tmp_path / "low.wav", 16000)


def test_prompt_tensors_and_pairs_are_16khz_audio(tts, short_prompt_wav: Path) -> None:
    speech_16k = load_wav(str(short_prompt_wav), 16000)  # [1, N], what both official servers pass

    def run(prompt) -> torch.Tensor:
        return _cat(tts.inference_zero_shot(SHORT, PROMPT_TEXT, prompt, seed=4))

    as_2d = run(speech_16k)
    assert torch.equal(as_2d, run(speech_16k[0]))
    assert torch.equal(as_2d, run((speech_16k[0].numpy(), 16000)))
    with pytest.raises(InvalidInputError, match=r"float samples \[N\] or \[1, N\]"):
        run(torch.zeros(2, 16000))
    with pytest.raises(InvalidInputError, match="float samples"):
        run((speech_16k * 32767).to(torch.int16))


def test_sft_instruct_and_vc(tts, prompt_wav: Path, short_prompt_wav: Path) -> None:
    assert tts.add_zero_shot_spk(PROMPT_TEXT, str(short_prompt_wav), "speaker-a")
    sft = _cat(tts.inference_sft(SHORT, "speaker-a", seed=2))
    assert torch.equal(sft, _cat(tts.inference_zero_shot(SHORT, "", "", zero_shot_spk_id="speaker-a", seed=2)))
    instructed = _cat(tts.inference_instruct(SHORT, "speaker-a", "Speak slowly and calmly.", seed=2))
    same = _cat(tts.inference_instruct2(SHORT, INSTRUCTION, None, zero_shot_spk_id="speaker-a", seed=2))
    assert torch.equal(instructed, same)
    vc = list(tts.inference_vc(str(short_prompt_wav), str(prompt_wav)))
    vc_stream = list(tts.inference_vc(load_wav(str(short_prompt_wav), 16000), str(prompt_wav), stream=True))
    assert len(vc) == 1 and len(vc_stream) >= 1
    n_tokens = tts.frontend.speech_tokenizer(load_wav(str(short_prompt_wav), 16000)).shape[1]
    assert _cat(vc).shape[1] == n_tokens * 2 * 480  # the source's speech tokens, 2 mel frames each
    assert _cat(vc_stream).shape == _cat(vc).shape
    with pytest.raises(InvalidInputError, match="unknown speaker id 'nobody'"):
        tts.inference_sft(SHORT, "nobody")


def test_text_stream_writer_tokenises_pieces_and_enforces_the_text_limit(tts) -> None:
    from cosyvoice.cli.cosyvoice import TextFeed

    writer = TextFeed(tts.frontend, 20, "tokens")
    stream = writer.tokens
    writer.write("Hello there, ")
    writer.write("")  # nothing to say yet: no ids
    assert stream.take() == (tts.frontend.tokenizer.encode("Hello there, "), False)
    with pytest.raises(InvalidInputError, match="exceeds 20 characters"):
        writer.write("and a lot more text")
    assert writer.closed
    with pytest.raises(InvalidInputError, match="exceeds 20 characters"):
        stream.take()  # the LLM side fails with the same error
    with pytest.raises(TextStreamClosedError):
        writer.write("more")
