"""Store faults a server meets in its data folder (issue 31), with real processes on real files: a database whose
write lock another process holds (a backup tool, the ``sqlite3`` shell in a long transaction) makes a write wait
``COSYVOICE_STORE_BUSY_SECONDS``, then a 503 naming the lock and the setting, with nothing changed; reads go on
meanwhile, and once the lock is let go the same write succeeds and nothing was lost. Two server processes
deleting the same things at once delete each once; one killed (``kill -9``) while it writes a delivery leaves the
last one whole. A full or read-only folder: tests/test_jobs.py and
tests/test_read_only_stores.py."""

from __future__ import annotations

import contextlib
import io
import logging
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from test_jobs import files
from test_jobs import two_servers as two_servers  # the fixture, used by name
from test_rest import Server
from waiting import until

from cosyvoice.longform.store import DB_NAME as LONGFORM_DB
from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import STORE_BUSY_SETTING, ServerSettings
from cosyvoice.takes.store import DB_NAME as TAKES_DB
from cosyvoice.takes.store import TakeStore
from cosyvoice.voices import VoiceLibrary

BUSY_SECONDS = 1.0
BYE = {"text": "Bye.", "voice": "Narrator", "name": "Bye"}
HOLD = """import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture()
def served(tts, prompt_wav: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    monkeypatch.setenv("COSYVOICE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv(STORE_BUSY_SETTING, str(BUSY_SECONDS))
    service = TTSService(tts.model, VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir))
    service.create_voice("Narrator", prompt_wav.read_bytes(), "Hello there.")
    server = Server(create_app(ServerSettings(voice_dir=str(tmp_path / "voices")), service))
    yield server.url, tmp_path / "data"
    server.stop()


@contextmanager
def locked(database: Path) -> Iterator[None]:
    """Another process holds ``database``'s write lock (BEGIN EXCLUSIVE) until the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(database)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield
    finally:
        holder.stdin.close()  # it reads to the end of its input, then exits and SQLite lets the lock go
        assert holder.wait(timeout=30) == 0


def _busy(answer: httpx.Response, started: float) -> None:
    assert answer.status_code == 503, (answer.status_code, answer.text[:300])
    message = answer.json()["error"]["message"]
    assert "locked by another process" in message and STORE_BUSY_SETTING in message, message
    assert "nothing was changed" in message
    assert BUSY_SECONDS <= time.monotonic() - started < BUSY_SECONDS + 20  # it waited, and no longer than bounded


def test_a_database_locked_by_another_process_is_a_503_naming_the_lock(served: tuple[str, Path],
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    url, data = served
    with httpx.Client(base_url=url, timeout=120) as client:
        kept = client.post("/v1/longform/projects", json={"text": "Hi there.", "voice": "Narrator", "name": "Kept"})
        assert kept.status_code == 201, kept.text
        assert client.get("/workbench/api/takes").status_code == 200  # the workbench's store opened (it migrates)
        with locked(data / LONGFORM_DB):
            started = time.monotonic()
            _busy(client.post("/v1/longform/projects", json=BYE), started)
            started = time.monotonic()
            _busy(client.patch(f"/v1/longform/projects/{kept.json()['id']}", json={"name": "Changed"}), started)
            listed = client.get("/v1/longform/projects")  # reads go on while another process writes
            assert listed.status_code == 200 and [p["name"] for p in listed.json()] == ["Kept"], listed.text
        with locked(data / TAKES_DB):
            started = time.monotonic()
            _busy(client.post("/workbench/api/batches", json={"rows": [{"text": "Hi.", "voice": "Narrator"}]}),
                  started)
            assert client.get("/workbench/api/takes").status_code == 200
        made = client.post("/v1/longform/projects", json=BYE)
        assert made.status_code == 201, made.text  # the lock gone, the same write succeeds
        assert client.get(f"/v1/longform/projects/{kept.json()['id']}").json()["name"] == "Kept"
        assert sorted(p["name"] for p in client.get("/v1/longform/projects").json()) == ["Bye", "Kept"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_the_busy_setting_is_checked() -> None:
    from cosyvoice.errors import ConfigError
    from cosyvoice.settings import store_busy_seconds

    assert store_busy_seconds({}) == 30.0 and store_busy_seconds({STORE_BUSY_SETTING: "2.5"}) == 2.5
    for raw in ("soon", "0", "-1", "nan", "1e9"):
        with pytest.raises(ConfigError, match=STORE_BUSY_SETTING):
            store_busy_seconds({STORE_BUSY_SETTING: raw})


def test_two_servers_deleting_the_same_things_at_once(two_servers, tmp_path: Path, short_prompt_wav: Path) -> None:
    """Two server processes on one data folder get the same DELETEs at the same moment (projects with takes,
    takes, saved voices): each thing is deleted once (one 200, one 404, never a 500), nothing else goes, and no
    take file is left without its row or a row without its file."""
    a, b = two_servers()
    with httpx.Client(base_url=a.url, timeout=120) as client:
        kept = client.post("/v1/longform/projects", json={"text": "Kept.\n\nStill kept.", "voice": "Narrator"})
        assert kept.status_code == 201, kept.text
        doomed = []
        for i in range(4):
            made = client.post("/v1/longform/projects", json={"text": f"Gone {i}.\n\nAlso gone.", "voice": "Narrator"})
            assert made.status_code == 201, made.text
            doomed.append(made.json()["id"])
        for pid in (kept.json()["id"], doomed[0], doomed[1]):
            assert client.post(f"/v1/longform/projects/{pid}/generate", json={}).status_code == 200
            until(lambda pid=pid: client.get(f"/v1/longform/projects/{pid}/progress").json()["running"] is False,
                  180, "the takes")
        batch = client.post("/workbench/api/batches", json={"rows": [{"text": f"Hi {i}.", "voice": "Narrator"}
                                                                     for i in range(3)]})
        until(lambda: client.get(f"/workbench/api/batches/{batch.json()['id']}").json()["state"] == "done", 180,
              "the batch")
        takes = [t["id"] for t in client.get("/workbench/api/takes").json()["takes"]
                 if t["batch"] == batch.json()["id"]]
        for name, cut in (("Spare", 2000), ("Other", 4000)):  # two recordings: two voices
            saved = client.post("/v1/voices", data={"name": name, "transcript": "Hello there."},
                                files={"audio": ("a.wav", short_prompt_wav.read_bytes()[:-cut], "audio/wav")})
            assert saved.status_code == 201, saved.text
    paths = [f"/v1/longform/projects/{pid}" for pid in doomed] + [f"/workbench/api/takes/{t}" for t in takes[:2]]
    paths += ["/v1/voices/Spare"]
    with ThreadPoolExecutor(2) as pool:
        for path in paths:
            gate = threading.Barrier(2)

            def delete(url: str, path: str = path, gate: threading.Barrier = gate) -> int:
                gate.wait()
                return httpx.delete(url + path, timeout=120).status_code

            assert sorted(pool.map(delete, (a.url, b.url))) == [200, 404], path
    for server in (a, b):
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert [p["id"] for p in client.get("/v1/longform/projects").json()] == [kept.json()["id"]]
            assert client.get(f"/v1/longform/projects/{kept.json()['id']}/export").status_code == 200
            assert client.get(f"/workbench/api/takes/{takes[2]}/audio").status_code == 200
            assert [v["name"] for v in client.get("/v1/voices").json()["data"] if v["name"] in ("Spare", "Other")] \
                == ["Other"]
    store = TakeStore(tmp_path / "data")
    assert files(store.audio_dir) == sorted(t.audio for t in store.takes())
    for server in (a, b):
        assert "Traceback" not in server.log.read_text(), server.log.read_text()


def test_a_server_killed_during_a_delivery_leaves_the_last_one_whole(two_servers, tmp_path: Path) -> None:
    """``kill -9`` while the ACX delivery of a changed project is being written: the last delivery's ZIP and
    check stay as they were (never half of the new one), another server on the folder serves the project and
    makes the delivery again, and the dead process's part file is cleared then."""
    (a,) = two_servers(1)
    book = "\n\n".join(f"# Chapter {n}\n\nHi there, this is chapter {n}." for n in range(1, 7))
    with httpx.Client(base_url=a.url, timeout=120) as client:
        made = client.post("/v1/longform/projects", json={"text": book, "voice": "Narrator", "preset": "acx"})
        assert made.status_code == 201, made.text
        where = f"/v1/longform/projects/{made.json()['id']}"
        assert client.post(f"{where}/generate", json={}).status_code == 200
        until(lambda: client.get(f"{where}/progress").json()["running"] is False, 300, "the takes")
        first = client.post(f"{where}/acx/delivery")
        assert first.status_code == 200 and len(first.json()["files"]) == 6, first.text
        assert client.patch(where, json={"narrator": "Someone Else"}).status_code == 200
    folder = tmp_path / "data" / "longform" / "delivery"
    zipped, checked = (folder / f"{made.json()['id']}{ext}" for ext in (".zip", ".json"))
    kept = zipped.read_bytes(), checked.read_bytes()

    def remake() -> None:
        with contextlib.suppress(httpx.TransportError):
            httpx.post(f"{a.url}{where}/acx/delivery", timeout=120)

    writer = threading.Thread(target=remake, daemon=True)
    writer.start()
    until(lambda: list(folder.glob(".*.part")), 60, "the new delivery's part file")
    a.process.send_signal(signal.SIGKILL)
    a.process.wait(30)
    writer.join(30)
    assert (zipped.read_bytes(), checked.read_bytes()) == kept  # the last delivery, whole
    assert list(folder.glob(".*.part"))  # what kill -9 left
    (b,) = two_servers(1)
    with httpx.Client(base_url=b.url, timeout=120) as client:
        report = client.get(f"{where}/acx/delivery").json()
        assert report["current"] is False and report["files"] == first.json()["files"], report
        again = client.post(f"{where}/acx/delivery")
        assert again.status_code == 200 and again.json()["current"], again.text
        with zipfile.ZipFile(io.BytesIO(client.get(f"{where}/acx/delivery.zip").content)) as z:
            assert z.testzip() is None and len(z.namelist()) == 6
    assert not list(folder.glob(".*.part"))  # the dead process's part cleared
    assert "Traceback" not in b.log.read_text(), b.log.read_text()
