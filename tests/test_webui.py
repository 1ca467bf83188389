"""The web UI on the tiny bundle: handlers called as Gradio calls them, and the named API through a real
gradio_client against a server on loopback. The real-browser tests are in test_webui_browser.py."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

gr = pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra: pip install -e '.[ui]'")

from waiting import free_port  # noqa: E402

from app import ui  # noqa: E402
from app.ui import Studio, build_ui, launch, load_studio  # noqa: E402
from cosyvoice import bundle  # noqa: E402
from cosyvoice.context import StudioContext  # noqa: E402
from cosyvoice.frontend.prompts import zero_shot_prompt_text  # noqa: E402
from cosyvoice.service import TTSService  # noqa: E402
from cosyvoice.settings import ServerSettings, VoicePolicy  # noqa: E402
from cosyvoice.voices import VoiceLibrary  # noqa: E402

TEXT = "Hi there."  # short: the random tiny model speaks until its length limit, which grows with the text
TRANSCRIPT = "Hello, this is a short prompt."


def studio_over(service: TTSService, api_keys: tuple[str, ...] = ()) -> Studio:
    """A demo studio serving ``service``, its data folder beside the voices (as ``load_studio`` places it); with
    ``api_keys``, nothing answers without one."""
    settings = ServerSettings(voice_dir=str(service.voices.dir.parent), api_keys=api_keys)
    return Studio(StudioContext(settings, service=service), demo=True)


def make_studio(tts, root: Path, builtin_prompt: Path | None = None, api_keys: tuple[str, ...] = ()) -> Studio:
    """A studio on ``root`` (voices under it); with ``builtin_prompt``, one built-in voice 'Narrator'; with
    ``api_keys``, nothing answers without one."""
    builtin = None
    if builtin_prompt is not None:
        builtin = root / "builtin"
        builtin.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(builtin_prompt, builtin / "Narrator.wav")
        (builtin / "Narrator.txt").write_text(TRANSCRIPT + "\n")
    library = VoiceLibrary(root / "voices", tts.frontend, model_dir=tts.model_dir, builtin_dir=builtin)
    return studio_over(TTSService(tts.model, library), api_keys)


@contextlib.contextmanager
def serving(studio: Studio) -> Iterator[str]:
    """The app on a free loopback port, as ``webui.py`` serves it; yields its URL."""
    port = free_port()
    page = launch(studio, host="127.0.0.1", port=port, block=False)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        page.close()


@pytest.fixture()
def studio(tts, tmp_path: Path) -> Studio:
    return make_studio(tts, tmp_path)


def _generate(studio: Studio, mode: str = "zero_shot", text: str = TEXT, prompt: str | None = None,
              transcript: str = TRANSCRIPT, instruction: str = "", voice: str | None = None, seed: int = 5,
              speed: float = 1.0, stream: bool = True, fmt: str = "wav", take_id: str = "take-0001") -> list[tuple]:
    return list(studio.generate(take_id, mode, text, prompt, transcript, instruction, voice, seed, speed, stream, fmt))


def test_page_builds_with_the_demo_banner(studio: Studio) -> None:
    page = build_ui(studio)
    assert isinstance(page, gr.Blocks)
    assert any(getattr(block, "elem_id", None) == "demo-banner" for block in page.blocks.values())


def test_a_take_streams_live_pcm_and_is_kept_in_the_history(tts, studio: Studio, short_prompt_wav: Path) -> None:
    channel = studio.live.channel("take-0001")  # the page's player subscribes before (or after) the take runs
    *progress, last = _generate(studio, prompt=str(short_prompt_wav))
    assert len(progress) >= 2 and all(p[0].startswith("Generating… ") for p in progress)
    status, download, count, generate, stop = last
    [take] = studio.history(None)
    assert count == 1
    assert generate["interactive"] is True and stop["interactive"] is False
    assert take["seed"] == 5 and take["mode"] == "zero_shot" and take["text"] == TEXT and "seed 5" in status
    assert Path(download["value"]).name == "take-1-seed5.wav" and take["number"] == 1
    kept, rate = sf.read(take["file"], dtype="float32")  # kept in the take store, exactly as made
    kept = ui.to_pcm16(kept)  # and as downloaded
    assert np.array_equal(sf.read(download["value"], dtype="int16")[0], kept)
    live = np.frombuffer(b"".join(channel._pending[:-1]), np.int16)
    assert rate == 24000 and channel._pending[-1] is None and np.array_equal(kept, live)
    # the adapter changes nothing: the API, given the same voice, text and seed, makes the same samples
    api = tts.synthesize("zero_shot", TEXT, prompt_text=zero_shot_prompt_text(TRANSCRIPT),
                                prompt_wav=short_prompt_wav, stream=True, seed=5)
    assert np.array_equal(kept, np.concatenate([ui.to_pcm16(c.pcm) for c in api]))
    times = studio.times["take-0001"]
    assert times.start <= times.first_chunk <= times.finished


def test_random_seed_is_shown_and_formats_are_named(studio: Studio, short_prompt_wav: Path) -> None:
    *_, (status, download, _, _, _) = _generate(studio, "cross_lingual", prompt=str(short_prompt_wav), seed=-1,
                                                stream=False, fmt="opus")
    [take] = studio.history(None)
    assert 0 <= take["seed"] < 2**53 and f"seed {take['seed']}" in status and take["format"] == "opus"
    assert Path(download["value"]).name == f"take-1-seed{take['seed']}.opus"
    import av

    with av.open(download["value"]) as container:
        assert container.streams.audio[0].codec_context.name == "opus"
    for n, fmt in enumerate(ui.DOWNLOAD_FORMATS, start=2):
        kept = studio._download(n, np.zeros(24000, np.float32), fmt, 7)
        assert kept.name == f"take-{n}-seed7.{fmt}"
        if fmt != "opus":
            assert sf.info(kept).samplerate == 24000


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"text": "   "}, "text is empty; type something to say"),
    ({"text": "x" * 6000}, "text has 6000 characters; at most 5000"),
    ({"transcript": " "}, "zero-shot cloning needs the transcript"),
    ({"prompt": None}, "upload or record a prompt voice (1 to 30 s of speech)"),
    ({"mode": "instruct2"}, "instruct mode needs an instruction"),
    ({"mode": "instruct2", "instruction": "Be calm.<|endofprompt|>more"}, "must end at &lt;|endofprompt|&gt;"),
    ({"voice": "nobody"}, "unknown voice &#x27;nobody&#x27;"),
    ({"stream": False, "speed": 3.0}, "speed must be between 0.5 and 2, got 3.0"),
    ({"prompt": "/tmp/gradio/0123/expired.wav"}, "the uploaded recording is no longer on the server"),
])
def test_invalid_input_is_a_warning_that_leaves_the_page_usable(studio: Studio, prompt_wav: Path, kwargs: dict,
                                                                message: str) -> None:
    with pytest.warns(UserWarning) as warned:
        [(_, download, _, generate, stop)] = _generate(studio, **{"prompt": str(prompt_wav), **kwargs})
    assert any(message in str(w.message) for w in warned), [str(w.message) for w in warned]
    assert not any("/tmp/" in str(w.message) for w in warned)  # never a server path
    assert generate["interactive"] is True and stop["interactive"] is False  # never left locked
    assert download is gr.skip() or download == gr.skip()


def test_uploads_are_checked_on_upload(studio: Studio, prompt_wav: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.wav"
    sf.write(short, np.zeros(4000, np.float32), 16000)
    with pytest.warns(UserWarning, match=r"cannot be used: the prompt audio is 0\.25 s long; it must be at least 1 s"):
        assert studio.check_upload(str(short)) is None
    assert studio.check_upload(str(prompt_wav)) == gr.skip()


def test_voice_library_controls(studio: Studio, prompt_wav: Path, tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="type a name"):
        studio.save_voice("", str(prompt_wav), TRANSCRIPT)
    picked = studio.save_voice("Alice", str(prompt_wav), TRANSCRIPT)
    assert picked["choices"][0][0] == "Alice"
    voice_id = picked["value"]
    assert studio.preview(voice_id)[0] == 24000
    assert studio.rename_voice(voice_id, "Alice Smith")["choices"][0][0] == "Alice Smith"
    exported = studio.export_voice(voice_id)
    assert exported.endswith("Alice_Smith.voice.safetensors")
    row, question = studio.ask_delete(voice_id)
    assert row["visible"] is True and "Alice Smith" in question
    dropdown, row, _ = studio.delete_voice(voice_id)
    assert dropdown["choices"] == [] and row["visible"] is False
    dropdown, *_ = studio.import_voice(exported)
    assert dropdown["choices"][0][0] == "Alice Smith"
    with pytest.warns(UserWarning, match="saved already as &#x27;Alice Smith&#x27;"):  # no other name asked for
        _, _, import_name, import_again = studio.import_voice(exported)
    assert import_name["visible"] is False and import_again["visible"] is False
    _generate(studio, voice="Alice Smith", stream=False)
    assert studio.history(None)[0]["voice"] == "Alice Smith"


def test_paths_resolve_from_the_repository(tiny_bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)  # started from another folder: the defaults still point into the repository
    repo = Path(__file__).resolve().parents[1]
    for path in (bundle.DEFAULT_MODEL_DIR, ui.DEMO_MODEL_DIR, ui.BUILTIN_VOICE_DIR):
        assert path.is_absolute() and path.is_relative_to(repo)
    monkeypatch.setattr(bundle, "DEFAULT_MODEL_DIR", tmp_path / "absent")
    monkeypatch.setenv("COSYVOICE_VOICE_DIR", str(tmp_path / "shared-voices"))  # the servers' voice folder
    with caplog.at_level(logging.WARNING, logger="cosyvoice.bundle"):
        studio = load_studio(demo_dir=tiny_bundle_dir, device="cpu")
    assert studio.demo and Path(studio.service.model_dir) == tiny_bundle_dir
    assert studio.service.voices.dir.is_relative_to(tmp_path / "shared-voices")
    assert "RANDOMLY INITIALISED" in caplog.text and "modelscope download" in caplog.text


# ----------------------------------------------------------------------------- the named API (gradio_client)


@pytest.fixture(scope="module")
def api_server(tts, tmp_path_factory: pytest.TempPathFactory, short_prompt_wav: Path) -> Iterator[tuple]:
    studio = make_studio(tts, tmp_path_factory.mktemp("api"), builtin_prompt=short_prompt_wav)
    with serving(studio) as url:
        yield studio, url


def test_each_mode_through_one_named_endpoint(api_server: tuple, short_prompt_wav: Path) -> None:
    from gradio_client import Client, handle_file

    _, url = api_server
    client = Client(url, verbose=False)
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert set(endpoints) == {"/synthesize", "/voices", "/save_voice"}  # the page's own events stay private
    for mode, extra in (("zero_shot", {"prompt_text": TRANSCRIPT}), ("cross_lingual", {}),
                        ("instruct2", {"instruction": "Speak slowly."})):
        path = client.predict(text=TEXT, mode=mode, voice="", prompt_audio=handle_file(str(short_prompt_wav)),
                              seed=3, speed=1.0, format="wav", api_name="/synthesize", **extra)
        info = sf.info(path)
        assert (info.samplerate, info.channels) == (24000, 1) and info.frames > 0, mode
    flac = client.predict(text=TEXT, mode="zero_shot", voice="Narrator", format="flac", api_name="/synthesize")
    assert flac.endswith(".flac") and sf.info(flac).samplerate == 24000  # a built-in voice by name


def test_the_named_endpoint_takes_the_chunk_schedule(api_server: tuple) -> None:
    """``final`` and ``first_hop`` through gradio_client are the take's schedule, in its provenance; empty: the
    reference's; a bad one is refused by name."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    studio, url = api_server
    client = Client(url, verbose=False)
    client.predict(text=TEXT, mode="zero_shot", voice="Narrator", seed=4, final="chunked", first_hop=9,
                   api_name="/synthesize")
    take = studio.store.takes(owner=None, any_owner=True)[-1].provenance
    assert (take["final"], take["first_hop"], take["seed"]) == ("chunked", 9, 4)
    client.predict(text=TEXT, mode="zero_shot", voice="Narrator", seed=4, api_name="/synthesize")
    take = studio.store.takes(owner=None, any_owner=True)[-1].provenance
    assert (take["final"], take["first_hop"]) == ("full", None)
    with pytest.raises(AppError) as caught:
        client.predict(text=TEXT, mode="zero_shot", voice="Narrator", first_hop=0, api_name="/synthesize")
    assert "first_hop must be a whole number of speech tokens from 1 to 25, got 0" in str(caught.value)


def test_a_voice_saved_after_connecting_is_usable_by_name_and_errors_are_plain(api_server: tuple,
                                                                                 prompt_wav: Path) -> None:
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    studio, url = api_server
    client = Client(url, verbose=False)
    studio.service.create_voice("Late Voice", prompt_wav, TRANSCRIPT)  # by someone else, after we connected
    assert "Late Voice" in [v["name"] for v in client.predict(api_name="/voices")]
    path = client.predict(text=TEXT, mode="instruct2", voice="Late Voice", instruction="Whisper.", seed=1,
                          api_name="/synthesize")
    assert sf.info(path).samplerate == 24000
    with pytest.raises(AppError) as caught:
        client.predict(text=TEXT, mode="zero_shot", voice="nobody's voice", api_name="/synthesize")
    assert "unknown voice \"nobody's voice\"" in str(caught.value) and "&#" not in str(caught.value)
    with pytest.raises(AppError) as caught:
        client.predict(text=TEXT, mode="instruct2", voice="Late Voice", api_name="/synthesize")
    assert "instruct mode needs an instruction, e.g. 'Speak slowly and calmly.'" in str(caught.value)


def test_a_take_the_store_cannot_keep_is_still_downloadable(tts, tmp_path: Path, short_prompt_wav: Path) -> None:
    studio = make_studio(tts, tmp_path)
    shutil.rmtree(studio.store.audio_dir)  # the store's audio folder is gone, a file in its place: writes fail
    studio.store.audio_dir.write_text("a file where the takes' folder should be")
    with pytest.warns(UserWarning, match="could not be kept in the history"):
        *_, (status, download, count, generate, _) = _generate(studio, "cross_lingual", prompt=str(short_prompt_wav))
    assert status.startswith("Take ?:") and count == gr.skip() and generate["interactive"] is True
    samples, rate = sf.read(download["value"], dtype="int16")
    assert Path(download["value"]).name == "take-seed5.wav" and rate == 24000 and samples.size > 0


def test_the_session_history_downloads_as_one_zip(studio: Studio, short_prompt_wav: Path) -> None:
    import json
    import zipfile

    assert studio.history_zip() is None  # no takes yet: nothing to download
    _generate(studio, "cross_lingual", prompt=str(short_prompt_wav), stream=False, fmt="mp3")
    _generate(studio, "cross_lingual", prompt=str(short_prompt_wav), seed=9, stream=False, fmt="flac",
              take_id="take-0002")
    with zipfile.ZipFile(studio.history_zip()) as archive:
        takes = json.loads(archive.read("takes.json"))
        assert sorted(archive.namelist()) == sorted(["takes.json", "take-1-seed5.mp3", "take-2-seed9.flac"])
    assert [(t["number"], t["seed"], t["mode"], t["text"], t["format"]) for t in takes] == [
        (2, 9, "cross_lingual", TEXT, "flac"), (1, 5, "cross_lingual", TEXT, "mp3")]
    from cosyvoice.bundle import bundle_digest

    made = takes[0]["provenance"]  # how each take was made, as a batch take records it
    assert made["model_id"] == bundle_digest(studio.service.status().model_dir) and made["voice_id"]
    assert made["precision"] == studio.service.model.plan.label == "fp32 (LLM fp32, flow fp32, vocoder fp32; fp32)"
    assert made["segments"] and made["timings"]["synthesis_seconds"] > 0 and made["settings"]["stream"] is False
    assert {"instruction", "prompt_text", "software", "engine_mode"} <= set(made)


def test_stop_before_the_first_chunk_and_while_queued(studio: Studio, short_prompt_wav: Path) -> None:
    studio.stop("take-queued")  # Stop clicked while the take still waited in Gradio's queue
    [(status, _, count, generate, _)] = _generate(studio, prompt=str(short_prompt_wav), take_id="take-queued")
    assert status == "Stopped before it started." and count == gr.skip() and generate["interactive"] is True
    takes = studio.generate("take-running", "cross_lingual", TEXT * 4, str(short_prompt_wav), "", "", None, 5, 1.0,
                            True, "wav")
    assert next(takes)[0].startswith("Generating… ")  # the first chunk is out
    studio.stop("take-running")
    *_, (status, _, _, generate, _) = list(takes)  # the handler ends at once, keeping what was made
    [take] = studio.history(None)
    assert take["stopped"] and "stopped" in status and generate["interactive"] is True
    deadline = time.time() + 10
    while (studio.service.status().active_sessions or studio._running) and time.time() < deadline:
        time.sleep(0.02)  # the engine stops within one LLM step, then frees the session
    assert studio.service.status().active_sessions == 0 and not studio._stopped_early and not studio._running


def test_speed_applies_while_streaming(studio: Studio, short_prompt_wav: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "plays when it is complete" fallback: the engine streams at speed
        outs = _generate(studio, "cross_lingual", prompt=str(short_prompt_wav), speed=1.5, stream=True)
    *progress, _ = outs
    [take] = studio.history(None)
    assert len(progress) >= 2 and take["speed"] == 1.5 and take["stream"] is True


def visitor(session: str, username: str | None = None, language: str = "en-US") -> gr.Request:
    """A page's request as Gradio hands it to a handler: its session (one per page load) and, behind API keys,
    the key's owner as ``username``."""
    return gr.Request(username=username, session_hash=session, headers={"accept-language": language})


def test_a_visitors_uploads_are_theirs_alone(studio: Studio, short_prompt_wav: Path) -> None:
    alice, bob = visitor("alice-page"), visitor("bob-page")
    list(studio.generate("take-a", "zero_shot", TEXT, str(short_prompt_wav), "Alice's secret words.", "", None, 1, 1.0,
                         False, "wav", alice))
    choices = studio.voice_dropdown(None, alice)["choices"]
    [upload] = [label for label, _ in choices if label.startswith("recent upload")]
    assert "Alice's secret words" in upload
    assert not [c for c in studio.voice_dropdown(None, bob)["choices"] if c[0].startswith("recent upload")]
    upload_id = next(v for label, v in studio.voice_dropdown(None, alice)["choices"] if label == upload)
    for attempt in (lambda: studio.preview(upload_id, bob), lambda: studio.export_voice(upload_id, bob),
                    lambda: studio.delete_voice(upload_id, bob)):
        with pytest.warns(UserWarning, match="unknown voice"):  # as if it did not exist
            attempt()
    assert studio.preview(upload_id, alice)[0] == 16000  # still there, still Alice's
    # behind API keys a key's holder is one owner across pages; the creator policy guards saved voices
    studio.service.voices.policy = VoicePolicy("creator")
    key_a, key_b = visitor("p1", "key:aaaaaaaaaaaa"), visitor("p2", "key:bbbbbbbbbbbb", "zh-CN")
    saved = studio.save_voice("Keyed", str(short_prompt_wav), TRANSCRIPT, key_a)["value"]
    with pytest.warns(UserWarning, match="无权操作") as warned:  # in the visitor's language
        assert studio.rename_voice(saved, "Taken over", key_b) == gr.skip()
        assert studio.ask_delete(saved, key_b) == (gr.skip(), gr.skip())  # refused at once, never "delete it?"
        studio.delete_voice(saved, key_b)
    assert len(warned) == 3 and all("只有保存它的人可以" in str(w.message) for w in warned), warned
    assert studio.rename_voice(saved, "Renamed", visitor("p3", "key:aaaaaaaaaaaa"))["choices"]


def test_a_finished_take_is_not_reported_as_abandoned(studio: Studio, short_prompt_wav: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="app.ui"):
        *_, (status, *_) = _generate(studio, "cross_lingual", prompt=str(short_prompt_wav))
    assert status.startswith("Take 1:") and "went away" not in caplog.text
    takes = studio.generate("take-left", "cross_lingual", TEXT * 4, str(short_prompt_wav), "", "", None, 5, 1.0, True,
                            "wav")
    next(takes)
    with caplog.at_level(logging.INFO, logger="app.ui"):
        takes.close()  # Gradio drops the handler of a closed page: that is reported, and the work stops
    assert "the page went away; stopping it" in caplog.text


def test_page_messages_name_no_server_setting(studio: Studio, short_prompt_wav: Path) -> None:
    with pytest.warns(UserWarning) as warned:
        _generate(studio, text="x" * 6000, prompt=str(short_prompt_wav))
    [message] = [str(w.message) for w in warned]
    assert "at most 5000" in message and "COSYVOICE_" not in message


def test_an_overlong_upload_gets_the_duration_message_not_a_size_error(studio: Studio, tmp_path: Path) -> None:
    big = tmp_path / "interview.wav"  # 150 s of 48 kHz stereo float: 57.6 MB, over the 50 MiB upload limit
    sf.write(big, np.zeros((150 * 48000, 2), np.float32), 48000, subtype="FLOAT")
    assert big.stat().st_size > studio.service.limits.max_prompt_bytes
    with pytest.warns(UserWarning, match=r"150\.00 s long; at most 30 s is supported") as warned:
        assert studio.check_upload(str(big)) is None
    assert not any("MiB" in str(w.message) for w in warned)


@pytest.mark.parametrize("kwargs", [
    {"text": "   "}, {"text": "x" * 6000}, {"transcript": " "}, {"mode": "instruct2"}, {"voice": "nobody"},
    {"stream": False, "speed": 3.0}, {"seed": 10**20}, {"prompt": "short"}, {"prompt": "long"},
    {"prompt": "junk"}, {"prompt": "silent"}, {"prompt": None},
], ids=lambda kwargs: next(iter(kwargs.items()))[0] + "-" + str(next(iter(kwargs.values())))[:8])
def test_the_chinese_page_says_the_common_refusals_in_chinese(studio: Studio, short_prompt_wav: Path,
                                                               tmp_path: Path, kwargs: dict) -> None:
    """A Chinese browser gets the service's most common refusals in Chinese (real errors of the real service):
    no English word left in the message, the numbers kept."""
    prompts = {"short": (np.sin(np.arange(7200) / 9), 24000), "long": (np.sin(np.arange(31 * 16000) / 9), 16000),
               "silent": (np.zeros(48000), 24000)}
    if kwargs.get("prompt") in prompts:
        samples, rate = prompts[kwargs["prompt"]]
        sf.write(tmp_path / "p.wav", (0.3 * samples).astype(np.float32), rate)
        kwargs = {**kwargs, "prompt": str(tmp_path / "p.wav")}
    elif kwargs.get("prompt") == "junk":
        (tmp_path / "p.wav").write_bytes(b"not audio at all" * 64)
        kwargs = {**kwargs, "prompt": str(tmp_path / "p.wav")}
    zh = gr.Request(headers={"accept-language": "zh-CN,zh;q=0.9"})
    args = {"mode": "zero_shot", "text": TEXT, "prompt": str(short_prompt_wav), "transcript": TRANSCRIPT,
            "instruction": "", "voice": None, "seed": 5, "speed": 1.0, "stream": True, "fmt": "wav", **kwargs}
    with pytest.warns(UserWarning) as warned:
        list(studio.generate("take-zh", *args.values(), request=zh))
    [message] = [str(w.message) for w in warned]
    assert re.search(r"[\u4e00-\u9fff]", message), message
    assert not re.findall(r"(?<!&#x27;)\b[A-Za-z]{3,}\b(?!&#x27;)", message.replace("nobody", "")) or \
        set(re.findall(r"\b[A-Za-z]{3,}\b", message)) <= {"WAV", "FLAC", "MP3", "OGG", "WebM", "M4A"}, message
