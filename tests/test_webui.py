"""The web UI on the tiny bundle: handlers called directly as Gradio would, plus one real HTTP smoke test."""

from __future__ import annotations

import io
import logging
import socket
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

gr = pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra: pip install -e '.[ui]'")

from app.ui import Studio, build_ui, launch, load_studio  # noqa: E402
from cosyvoice.frontend.prompts import zero_shot_prompt_text  # noqa: E402
from cosyvoice.voices import VoiceLibrary  # noqa: E402

TEXT = "Hi there."  # short: the random tiny model speaks until its length limit, which grows with the text
TRANSCRIPT = "Hello, this is a short prompt."


@pytest.fixture()
def studio(tts, tmp_path: Path) -> Studio:
    return Studio(tts, VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir), demo=True)


def _run(studio: Studio, mode: str = "zero_shot", text: str = TEXT, prompt: str | None = None,
         transcript: str = TRANSCRIPT, instruction: str = "", saved: str | None = None, save_as: str = "",
         seed: int = 5, speed: float = 1.0, stream: bool = True) -> list[tuple]:
    return list(studio.generate(mode, text, prompt, transcript, instruction, saved, save_as, seed, speed, stream))


def test_page_builds_with_the_demo_banner(studio: Studio) -> None:
    page = build_ui(studio)
    assert isinstance(page, gr.Blocks)
    assert any("demo-banner" in str(getattr(block, "value", "")) for block in page.blocks.values())


def test_zero_shot_streams_int16_wav_chunks_equal_to_the_api(studio: Studio, short_prompt_wav: Path) -> None:
    outs = _run(studio, prompt=str(short_prompt_wav))
    *chunks, last = outs
    assert len(chunks) >= 2, "a text this long must stream in more than one chunk"
    pcm = []
    for chunk_wav, *_ in chunks:
        info = sf.info(io.BytesIO(chunk_wav))
        assert (info.samplerate, info.subtype, info.channels) == (24000, "PCM_16", 1)
        pcm.append(sf.read(io.BytesIO(chunk_wav), dtype="int16")[0])
    sample_rate, full = last[1]
    assert sample_rate == 24000 and full.dtype == np.int16 and np.array_equal(full, np.concatenate(pcm))
    assert chunks[0][1] is None  # the previous result is cleared as soon as audio starts
    assert f"{len(chunks)} chunks" in last[3] and "uploaded recording" in last[3]
    # the adapter changes nothing: the API, given the same voice, text and seed, makes the same samples
    api = studio.tts.synthesize("zero_shot", TEXT, prompt_text=zero_shot_prompt_text(TRANSCRIPT),
                                prompt_wav=short_prompt_wav, stream=True, seed=5)
    assert np.array_equal(full, np.concatenate([c.int16() for c in api]))


def test_saved_voice_serves_every_mode(studio: Studio, prompt_wav: Path, short_prompt_wav: Path) -> None:
    first = _run(studio, prompt=str(short_prompt_wav), save_as="Alice", stream=False)
    [(label, voice_id)] = first[-1][2].choices
    assert label == "Alice" and studio.voices.get("Alice")[0].id == voice_id
    with pytest.warns(UserWarning, match="exists already"):  # a failed save warns; synthesis goes on
        other = _run(studio, "instruct2", prompt=str(prompt_wav), instruction="Whisper.", save_as="Alice ",
                     stream=False)
    assert other[-1][1] is not None
    studio.voices.frontend = SimpleNamespace(limits=studio.tts.limits,
                                             voice=lambda *args: pytest.fail("a saved voice was featurised again"))
    cross = _run(studio, "cross_lingual", "Salut [breath] toi.", saved=voice_id, stream=False, speed=1.5)
    instruct = _run(studio, "instruct2", saved=voice_id, instruction="Speak slowly.")
    assert len(cross) == 2 and len(instruct) >= 2 and cross[-1][1] is not None
    assert cross[-1][2].value == voice_id  # the picked voice stays picked
    assert not [key for key in studio.tts.spk2info if key.startswith("webui-")]  # nothing left in the API's table


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"text": "   "}, "text is empty; type something to say"),
    ({"transcript": " "}, "zero-shot cloning needs the transcript"),
    ({"prompt": None}, "upload or record a prompt voice (1 to 30 s of speech)"),
    ({"mode": "instruct2"}, "instruct mode needs an instruction"),
    ({"mode": "instruct2", "instruction": "Be calm.<|endofprompt|>more"}, "must end at &lt;|endofprompt|&gt;"),
    ({"saved": "nobody"}, "unknown voice &#x27;nobody&#x27;; saved voices: none"),
    ({"stream": False, "speed": 3.0}, "speed must be between 0.5 and 2,"),
])
def test_errors_reach_the_page_with_their_message(studio: Studio, prompt_wav: Path, kwargs: dict,
                                                  message: str) -> None:
    with pytest.raises(gr.Error) as caught:
        _run(studio, **{"prompt": str(prompt_wav), **kwargs})
    assert message in caught.value.message and caught.value.title == "Please check your input"


def test_bad_upload_and_voice_without_transcript(studio: Studio, prompt_wav: Path, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not audio")
    with pytest.raises(gr.Error) as caught:
        _run(studio, prompt=str(notes))
    assert "not a recognised audio file" in caught.value.message
    voice_id, _ = studio.voices.get_or_create(prompt_wav)  # as a cross-lingual upload leaves it
    studio.voices.save("Bob", voice_id)
    with pytest.raises(gr.Error) as caught:
        _run(studio, saved=voice_id)
    assert "this voice has no transcript, which zero-shot cloning needs" in caught.value.message
    assert studio.delete_voice(voice_id).choices == []
    with pytest.raises(gr.Error, match="pick a saved voice"):
        studio.delete_voice(None)


def test_demo_mode_without_a_model(tiny_bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)  # no pretrained_models/Fun-CosyVoice3-0.5B here
    with caplog.at_level(logging.WARNING, logger="app.ui"):
        studio = load_studio(voice_dir=tmp_path / "voices", demo_dir=tiny_bundle_dir, device="cpu")
    assert studio.demo and Path(studio.tts.model_dir) == tiny_bundle_dir
    assert "RANDOMLY INITIALISED" in caplog.text and "modelscope download" in caplog.text


def test_http_smoke(studio: Studio) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    page = launch(studio, host="127.0.0.1", port=port, block=False)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
            assert response.status == 200
            body = response.read().decode()
        assert "demo-banner" in body and "RANDOMLY INITIALISED" in body
    finally:
        page.close()
