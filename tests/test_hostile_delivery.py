"""The ACX check, the delivery and the exports on their edge cases (issue 31), against a real REST server on
loopback over the tiny bundle: a project with no finished segment, one of a single segment, takes that are all
silence, takes whose samples are NaN or infinite (a model fault or a damaged file), and a check while the
segments are still being made. Each is a clear 4xx naming what is missing or damaged, or a report saying what ACX
would refuse, never a 500 and never a file made of garbage; the server answers a normal request afterwards."""

from __future__ import annotations

import io
import logging
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from test_rest import Server
from waiting import until

from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import ServerSettings
from cosyvoice.voices import VoiceLibrary

PROJECTS = "/v1/longform/projects"
TWO = "Hi there.\n\nGood day to you."  # two paragraphs: two segments


@pytest.fixture(scope="module")
def served(tts, prompt_wav, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("hostile-delivery")
    service = TTSService(tts.model, VoiceLibrary(root / "voices", tts.frontend, model_dir=tts.model_dir))
    service.create_voice("Narrator", prompt_wav.read_bytes(), "Hello there.")
    server = Server(create_app(ServerSettings(voice_dir=str(root / "voices")), service))
    yield server.url, root
    server.stop()


def _made(client: httpx.Client, text: str, *, generate: bool = True) -> dict:
    """A project narrated by the tiny bundle, mastered for ACX; with ``generate``, every segment made."""
    made = client.post(PROJECTS, json={"text": text, "voice": "Narrator", "preset": "acx", "name": text[:20]})
    assert made.status_code == 201, made.text
    where = f"{PROJECTS}/{made.json()['id']}"
    if generate:
        assert client.post(f"{where}/generate", json={}).status_code == 200
        until(lambda: not client.get(f"{where}/progress").json()["running"], 300, "the render's end")
        progress = client.get(f"{where}/progress").json()
        assert progress["done"] == progress["total"], progress
    return client.get(where).json()


def _overwrite_takes(root: Path, project: dict, value: float) -> list[str]:
    """Every current take's file rewritten with ``value`` in every sample (as a model fault or damage would)."""
    ids = [s["take"] for s in project["segments"]]
    for take in ids:
        [path] = root.rglob(f"{take}.wav")
        x, sr = sf.read(path, dtype="float32")
        sf.write(path, np.full_like(x, value), sr, subtype="FLOAT")
    return ids


def _error(answer: httpx.Response, status: int, *words: str) -> str:
    assert answer.status_code == status, (answer.status_code, answer.text[:300])
    message = answer.json()["error"]["message"]
    assert all(w in message for w in words), message
    return message


def test_no_finished_segment_is_a_400_naming_the_segments(served: tuple[str, Path]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=120) as client:
        project = _made(client, TWO, generate=False)
        where = f"{PROJECTS}/{project['id']}"
        for method, path in (("GET", "/acx"), ("POST", "/acx/delivery"), ("GET", "/export?format=mp3"),
                             ("GET", "/export?format=m4b"), ("GET", "/segments.json"), ("GET", "/subtitles.srt")):
            _error(client.request(method, where + path), 400, "2 segment(s) have no audio yet (1, 2)")
        _error(client.get(f"{where}/acx/delivery"), 404, "no ACX delivery made yet")
        _error(client.get(f"{where}/acx/delivery.zip"), 404, "no ACX delivery made yet")


def test_a_one_segment_project_is_delivered_as_one_passing_file(served: tuple[str, Path]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=120) as client:
        where = f"{PROJECTS}/{_made(client, 'Hi there, how are you today?')['id']}"
        check = client.get(f"{where}/acx")
        assert check.status_code == 200 and check.json()["book"]["seconds"] > 0, check.text
        delivery = client.post(f"{where}/acx/delivery")
        assert delivery.status_code == 200, delivery.text
        [file] = delivery.json()["files"]
        assert delivery.json()["passed"] and file["passed"], file
        with zipfile.ZipFile(io.BytesIO(client.get(f"{where}/acx/delivery.zip").content)) as z:
            assert z.namelist() == [file["file"]]


def test_all_silent_takes_are_reported_as_silence(served: tuple[str, Path]) -> None:
    url, root = served
    with httpx.Client(base_url=url, timeout=120) as client:
        project = _made(client, TWO)
        where = f"{PROJECTS}/{project['id']}"
        _overwrite_takes(root, project, 0.0)
        book = client.get(f"{where}/acx").json()["book"]
        assert not book["passed"] and book["rms_db"] is None, book
        assert book["problems"][0].startswith("silent: every sample is zero"), book
        delivery = client.post(f"{where}/acx/delivery")
        assert delivery.status_code == 200, delivery.text
        [file] = delivery.json()["files"]
        assert not delivery.json()["passed"] and "no speech" in file["problems"][0], file
        assert not any("room tone at the" in p for p in file["problems"]), file  # one problem, said as it is
        assert client.get(f"{where}/export?format=m4b").status_code == 200


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_damaged_take_is_a_409_naming_it_and_nothing_is_made_of_it(served: tuple[str, Path], value: float,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    url, root = served
    with httpx.Client(base_url=url, timeout=120) as client:
        project = _made(client, TWO)
        where = f"{PROJECTS}/{project['id']}"
        made = client.post(f"{where}/acx/delivery")  # a delivery of the sound takes: kept, then refused as stale
        assert made.status_code == 200, made.text
        first = _overwrite_takes(root, project, value)[0]
        for method, path in (("GET", "/acx"), ("POST", "/acx/delivery"), ("GET", "/export?format=m4b"),
                             ("GET", "/export?format=mp3"), ("GET", "/export?format=wav"),
                             ("GET", f"/takes/{first}.wav")):
            _error(client.request(method, where + path), 409, f"take {first} is damaged", "not numbers")
        assert client.get(f"{where}/acx/delivery").json()["files"] == made.json()["files"]  # the last one stands
        assert not list(root.rglob("*.part")) and client.get(f"{where}/acx/delivery.zip").status_code == 200
        spoken = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "Narrator", "seed": 1,
                                                          "response_format": "wav"})
        assert spoken.status_code == 200 and spoken.content[:4] == b"RIFF"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_check_while_generating_names_the_segments_not_yet_made(served: tuple[str, Path]) -> None:
    url, _ = served
    text = " ".join(f"Sentence number {n} is here, and it goes on for a while." for n in range(8))
    with httpx.Client(base_url=url, timeout=120) as client:
        project = _made(client, text, generate=False)
        where = f"{PROJECTS}/{project['id']}"
        assert client.post(f"{where}/generate", json={}).status_code == 200
        before = client.get(f"{where}/progress").json()
        check = client.get(f"{where}/acx")
        assert before["done"] < before["total"], before  # the tiny model takes seconds for eight segments
        _error(check, 400, "have no audio yet", "generate them first")
        _error(client.post(f"{where}/acx/delivery"), 400, "have no audio yet")
        assert client.post(f"{where}/cancel").status_code == 200


def test_audio_that_is_not_numbers_is_never_kept(tmp_path: Path) -> None:
    """A model fault (an overflow in a fast path) is refused where takes are stored: no row, no file."""
    from cosyvoice.errors import InvalidInputError
    from cosyvoice.takes.store import TakeStore

    store = TakeStore(tmp_path)
    pcm = np.full(2400, 0.1, np.float32)
    pcm[7] = np.nan
    with pytest.raises(InvalidInputError, match="not numbers") as refused:
        store.add_take(pcm, 24000, {"text": "Hi."})
    assert refused.value.field == "audio"
    assert store.takes() == [] and not [p for p in tmp_path.rglob("*.wav")]
    assert store.add_take(np.nan_to_num(pcm), 24000, {"text": "Hi."}).samples == 2400
