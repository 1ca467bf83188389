"""One take store for the studio, the workbench and long-form (issue 20, "Takes"): long-form's takes are workbench
takes with the same provenance, owned by the project's owner, so a listening test can use them and a rater gets their
audio; a take a test uses is never deleted (refused with the test's name, or kept when its project goes); and a data
folder from before, with long-form's takes in its own table and folder, opens with every take and its audio."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from test_rest import Server
from waiting import until

from cosyvoice.bundle import bundle_digest
from cosyvoice.longform.store import ProjectStore
from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings, default_data_dir
from cosyvoice.takes.store import TakeStore
from cosyvoice.voices import VoiceLibrary

ANN, BEN = "a" * 32, "b" * 32  # two browsers' cv-browser ids
SR = 24000

# ----------------------------------------------------------------------------- a data folder from before

# longform.sqlite3 as the studio wrote it before the one take store (with the owner column owners added)
OLD_LONGFORM = """
CREATE TABLE projects (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, kind TEXT NOT NULL, source TEXT NOT NULL,
    settings TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL, owner TEXT);
CREATE TABLE segments (
    id TEXT PRIMARY KEY, project_id TEXT NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
    position INTEGER NOT NULL, text TEXT NOT NULL, voice TEXT NOT NULL, instruction TEXT NOT NULL,
    speed REAL NOT NULL, brk TEXT NOT NULL, pause REAL, chapter TEXT, speaker TEXT, chosen_take TEXT,
    state TEXT NOT NULL, error TEXT);
CREATE TABLE takes (
    id TEXT PRIMARY KEY, project_id TEXT NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
    segment_id TEXT NOT NULL, seed INTEGER NOT NULL, text TEXT NOT NULL, voice TEXT NOT NULL,
    voice_id TEXT NOT NULL, instruction TEXT NOT NULL, speed REAL NOT NULL, samples INTEGER NOT NULL,
    sample_rate INTEGER NOT NULL, flags TEXT NOT NULL, seconds_to_make REAL NOT NULL, created REAL NOT NULL);
"""


def old_data_folder(root: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A data folder as the studio left it before: a workbench take (a 16-bit WAV in takes/) and a long-form
    project of Ann's with three takes (float32 WAVs in longform/<project>/). Returns the long-form takes' samples
    by id and the workbench take's."""
    rng = np.random.default_rng(3)
    workbench = TakeStore(root)  # the workbench's schema; its take written as it was then
    workbench.close()
    old_pcm = (0.1 * rng.standard_normal(2400)).astype(np.float32)
    sf.write(root / "takes" / "take-old.wav", old_pcm, SR, subtype="PCM_16")
    db = sqlite3.connect(root / "workbench.sqlite3")
    db.execute("INSERT INTO takes (id, created, owner, batch, row, label, audio, sample_rate, samples, provenance) "
               "VALUES ('take-old', 1.0, ?, NULL, NULL, 'sysA', 'take-old.wav', ?, 2400, ?)",
               (f"browser:{ANN}", SR, json.dumps({"text": "before", "seed": 4})))
    db.commit()
    db.close()

    db = sqlite3.connect(root / "longform.sqlite3")
    db.executescript(OLD_LONGFORM)
    settings = {"pauses": {"sentence": 0.3}, "preset": None, "margin": 0.1, "speakers": {}, "retries": 0}
    db.execute("INSERT INTO projects VALUES ('p1', 'Old book', 'document', 'Hi. Bye.', ?, 1.0, 2.0, ?)",
               (json.dumps(settings), f"browser:{ANN}"))
    segments = [("s1", 0, "Hi.", "t2"), ("s2", 1, "Bye.", "t3")]
    for sid, position, text, chosen in segments:
        db.execute("INSERT INTO segments VALUES (?, 'p1', ?, ?, 'voice-x', '', 1.0, 'sentence', NULL, NULL, NULL, ?,"
                   " 'idle', NULL)", (sid, position, text, chosen))
    audio = {}
    (root / "longform" / "p1").mkdir(parents=True)
    for n, (tid, sid, text) in enumerate((("t1", "s1", "Hi."), ("t2", "s1", "Hi."), ("t3", "s2", "Bye.")), 1):
        audio[tid] = rng.uniform(-1, 1, 1000 * n).astype(np.float32)
        sf.write(root / "longform" / "p1" / f"{tid}.wav", audio[tid], SR, subtype="FLOAT")
        db.execute("INSERT INTO takes VALUES (?, 'p1', ?, ?, ?, 'voice-x', 'voice-x', '', 1.0, ?, ?, '[]', 0.5, ?)",
                   (tid, sid, 100 + n, text, 1000 * n, SR, 10.0 + n))
    db.commit()
    db.close()
    return audio, old_pcm


def test_a_data_folder_from_before_opens_with_every_take_and_its_audio(tmp_path: Path) -> None:
    audio, old_pcm = old_data_folder(tmp_path)
    projects = ProjectStore(TakeStore(tmp_path))
    takes = projects.takes("p1")
    assert {sid: [t.id for t in found] for sid, found in takes.items()} == {"s1": ["t1", "t2"], "s2": ["t3"]}
    for found in takes.values():
        for take in found:  # the samples exactly as made: the book's mix is what it was
            assert np.array_equal(projects.take_audio(take), audio[take.id])
    assert [s.chosen_take for s in projects.segments("p1")] == ["t2", "t3"]
    assert all(t.matches(s) for s in projects.segments("p1") for t in takes[s.id])

    # every take is the take store's: the workbench's as it was, long-form's owned by the project's owner
    store = projects.take_store
    assert store.take("take-old").provenance == {"text": "before", "seed": 4}
    assert np.abs(store.read_audio(store.take("take-old")) - old_pcm).max() <= 1 / 2**15  # a 16-bit take, read
    adopted = [t for t in store.takes() if t.longform is not None]
    assert [(t.id, t.owner, t.label, t.source) for t in adopted] == [
        (tid, f"browser:{ANN}", "Old book", "long-form") for tid in ("t1", "t2", "t3")]
    assert [(t.provenance["seed"], t.provenance["text"], t.longform) for t in adopted] == [
        (101, "Hi.", {"project": "p1", "segment": "s1"}), (102, "Hi.", {"project": "p1", "segment": "s1"}),
        (103, "Bye.", {"project": "p1", "segment": "s2"})]
    assert all(np.array_equal(store.read_audio(t), audio[t.id]) for t in adopted)
    projects.close()

    # an adoption cut short before it was marked done runs again and changes nothing
    db = sqlite3.connect(tmp_path / "longform.sqlite3")
    db.execute("PRAGMA user_version = 0")
    db.close()
    again = ProjectStore(TakeStore(tmp_path))
    assert [t.id for t in again.take_store.takes()] == ["take-old", "t1", "t2", "t3"]
    assert {sid: [t.id for t in found] for sid, found in again.takes("p1").items()} == {"s1": ["t1", "t2"],
                                                                                       "s2": ["t3"]}

    # deleting the project keeps the take a test uses (in the workbench) and removes the others with their files
    again.take_store.add_test("ab", "Old AB", "", {"items": [{"takes": ["t1", "take-old"]}]})
    project, kept = again.delete_project("p1")
    assert project.name == "Old book" and kept == {"t1": ["Old AB"]}
    assert [t.id for t in again.take_store.takes()] == ["take-old", "t1"]
    assert np.array_equal(again.take_store.read_audio(again.take_store.take("t1")), audio["t1"])
    assert sorted(p.name for p in (tmp_path / "longform" / "p1").iterdir()) == ["t1.wav"]
    again.close()


# ----------------------------------------------------------------------------- long-form takes in the workbench


@pytest.fixture()
def served(tts, tmp_path: Path, short_prompt_wav: Path) -> Iterator[tuple[str, Path]]:
    """A REST server on loopback (workbench and long-form) and its data folder."""
    voices = tmp_path / "voices"
    service = TTSService(tts.model, VoiceLibrary(voices, tts.frontend, model_dir=tts.model_dir),
                         Limits(max_sessions=2, queue_timeout_seconds=60))
    service.create_voice("Narrator", short_prompt_wav.read_bytes(), "A short test prompt.")
    server = Server(create_app(ServerSettings(voice_dir=str(voices)), service))
    yield server.url, default_data_dir(voices)
    server.stop()


def rendered(client: httpx.Client, pid: str) -> dict:
    until(lambda: not client.get(f"/v1/longform/projects/{pid}/progress").json()["running"], 120, "the render's end")
    return client.get(f"/v1/longform/projects/{pid}").json()


def _workbench_takes(owner: httpx.Client, other: httpx.Client, pid: str, made: tuple[str, str],
                     model_id: str) -> dict[str, dict]:
    """The project's takes in the workbench, the owner's: labelled with the project, with the same provenance as
    every take; another visitor sees none of them."""
    seeds = {s["take"]: s["seed"] for s in owner.get(f"/v1/longform/projects/{pid}/segments.json").json()["segments"]}
    takes = {t["id"]: t for t in owner.get("/workbench/api/takes").json()["takes"]}
    assert set(takes) == set(made)
    for take_id, take in takes.items():
        p = take["provenance"]
        assert (take["label"], take["source"], p["longform"]["project"]) == ("Book", "long-form", pid)
        assert p["seed"] == seeds[take_id] and p["model_id"] == model_id
        assert p["precision"] and p["software"].startswith("cosyvoice3-studio") and p["steps"] is not None
    assert takes[made[0]]["provenance"]["text"] == "Hi there."
    assert other.get("/workbench/api/takes").json()["takes"] == []
    return takes


def test_long_form_takes_are_workbench_takes_a_listening_test_uses(served, tiny_bundle_dir: Path) -> None:
    url, data = served
    with (httpx.Client(base_url=url, timeout=60, cookies={"cv-browser": ANN}) as ann,
          httpx.Client(base_url=url, timeout=60, cookies={"cv-browser": BEN}) as ben,
          httpx.Client(base_url=url, timeout=60) as rater_page):
        made = ann.post("/v1/longform/projects", json={"name": "Book", "text": "Hi there.\n\nBye now.",
                                                       "voice": "Narrator"})
        assert made.status_code == 201, made.text
        pid = made.json()["id"]
        assert ann.post(f"/v1/longform/projects/{pid}/generate").status_code == 200
        first, second = rendered(ann, pid)["segments"]
        assert (first["status"], second["status"]) == ("done", "done")
        takes = _workbench_takes(ann, ben, pid, (first["take"], second["take"]), bundle_digest(tiny_bundle_dir))

        # an A/B test of the two, and a rater with only the link gets their audio
        made = ann.post("/workbench/api/tests", json={"kind": "ab", "title": "Book AB",
                                                      "items": [{"takes": [first["take"], second["take"]]}]})
        assert made.status_code == 201, made.text
        test_id = made.json()["id"]
        rater = rater_page.post(f"/workbench/api/tests/{test_id}/raters", json={"name": "Rita"}).json()["rater"]
        assert rater_page.get(f"/workbench/api/raters/{rater}/next").json()["done"] is False
        stored = {ann.get(f"/workbench/api/takes/{t}/audio").content for t in takes}
        heard = {rater_page.get(f"/workbench/api/raters/{rater}/audio/0/{slot}").content for slot in "AB"}
        assert heard == stored and all(a[:4] == b"RIFF" and len(a) > 1000 for a in heard)

        # a take the test uses is not deleted; a chosen take no test uses is, and its segment says so
        used = ann.delete(f"/workbench/api/takes/{first['take']}")
        assert used.status_code == 409 and "Book AB" in used.json()["error"]["message"], used.text
        assert ann.post(f"/v1/longform/projects/{pid}/segments/{second['id']}/regenerate").status_code == 200
        newer = rendered(ann, pid)["segments"][1]
        assert newer["take"] not in (None, second["take"])
        gone = ann.delete(f"/workbench/api/takes/{newer['take']}")
        assert gone.status_code == 200 and "generated again" in gone.json()["note"], gone.text
        after = rendered(ann, pid)["segments"][1]
        assert after["status"] == "pending" and [t["id"] for t in after["takes"]] == [second["take"]]

        # deleting the project keeps the takes the test uses, in the workbench, and says so
        assert ben.delete(f"/v1/longform/projects/{pid}").status_code == 404
        deleted = ann.delete(f"/v1/longform/projects/{pid}")
        assert deleted.status_code == 200, deleted.text
        assert sorted(deleted.json()["kept_takes"], key=lambda k: k["take"]) == sorted(
            [{"take": first["take"], "tests": ["Book AB"]}, {"take": second["take"], "tests": ["Book AB"]}],
            key=lambda k: k["take"])
        assert ann.get(f"/v1/longform/projects/{pid}").status_code == 404
        assert set(t["id"] for t in ann.get("/workbench/api/takes").json()["takes"]) == set(takes)
        assert {rater_page.get(f"/workbench/api/raters/{rater}/audio/0/{slot}").content for slot in "AB"} == stored

        # once the test is gone, its takes can be deleted too, files and all
        assert ann.delete(f"/workbench/api/tests/{test_id}").status_code == 200
        for take_id in takes:
            assert ann.delete(f"/workbench/api/takes/{take_id}").status_code == 200
        assert ann.get("/workbench/api/takes").json()["takes"] == []
    assert [p.name for p in (data / "takes").iterdir()] == []
