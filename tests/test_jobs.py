"""Long jobs (cosyvoice.jobs) on the tiny bundle, through real servers on loopback and real files: a full disk
(a small tmpfs, mounted as root) ends a batch or a render with the error shown and nothing half-written left;
batches have a row limit, cancel, and constant bookkeeping per row; two servers on one data folder share job
state (progress, cancel, deletion); a server killed with ``kill -9`` leaves its job interrupted, and another
resumes it from its first unfinished row."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_rest import Server
from waiting import free_port, until, until_ready

from cosyvoice.jobs import JobRunner
from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings
from cosyvoice.takes.store import TakeStore
from cosyvoice.voices import VoiceLibrary
from cosyvoice.workbench.batch import Progress, Row, run_batch

ROOT = Path(__file__).resolve().parents[1]
TRANSCRIPT = "A short test prompt."
ACTIVE = ("queued", "running")


@contextlib.contextmanager
def tmpfs(folder: Path, size: str = "256k") -> Iterator[Path]:
    """A small real file system at ``folder`` (needs root; skipped elsewhere)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path) -> None:
    """Write into ``folder`` until its disk is full."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != "filler")


@pytest.fixture()
def service(tts, tmp_path: Path, short_prompt_wav: Path) -> TTSService:
    svc = TTSService(tts.model, VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir),
                     Limits(max_sessions=2, queue_timeout_seconds=60, max_batch_rows=40))
    svc.create_voice("Narrator", short_prompt_wav.read_bytes(), TRANSCRIPT)
    return svc


@pytest.fixture()
def serve(service: TTSService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Start the REST app (workbench and long-form included) over ``data`` on loopback; returns its URL."""
    servers: list[Server] = []

    def start(data: Path) -> str:
        monkeypatch.setenv("COSYVOICE_DATA_DIR", str(data))
        servers.append(Server(create_app(ServerSettings(voice_dir=str(tmp_path / "voices")), service)))
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


def batch_rows(n: int, voice: str = "Narrator") -> list[dict]:
    return [{"text": f"Hello number {i}.", "voice": voice, "seed": i, "label": "a"} for i in range(1, n + 1)]


def finished_batch(client: httpx.Client, batch_id: str, timeout: float = 120.0) -> dict:
    def ended() -> dict | None:
        batch = client.get(f"/workbench/api/batches/{batch_id}").json()
        return None if batch["state"] in ACTIVE else batch

    return until(ended, timeout, f"the end of batch {batch_id}")


# ----------------------------------------------------------------------------- defect 2: a batch that cannot write


def test_a_batch_on_a_full_disk_fails_with_the_error_shown(serve, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with tmpfs(data / "takes") as takes:
        fill(takes)
        url = serve(data)
        with httpx.Client(base_url=url, timeout=60) as client:
            started = client.post("/workbench/api/batches", json={"rows": batch_rows(3)})
            assert started.status_code == 202, started.text
            batch = finished_batch(client, started.json()["id"], 60)
        assert batch["state"] == "failed" and batch["error"].startswith("disk full"), batch
        assert batch["eta_seconds"] == 0 and batch["done"] == 0
        assert batch["errors"][0]["row"] == 1 and batch["errors"][0]["message"].startswith("disk full")
        assert files(takes) == []  # no half-written take, no temporary file


def test_a_batch_whose_model_crashes_on_a_row_shows_a_model_error_and_goes_on(
        serve, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An error that is not ours (here the token-to-wave worker raising on the second row, as a driver or kernel
    fault would) fails that row with a message a user understands, its traceback in the server's log; the other
    rows are made, and the batch ends with no ETA left, so the page polling it stops."""
    from cosyvoice.engine.t2w import Token2Wav

    calls, chunks = [], Token2Wav.chunks

    def crashing(worker, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("illegal memory access (injected)")
        return chunks(worker, *args, **kwargs)

    monkeypatch.setattr(Token2Wav, "chunks", crashing)
    url = serve(tmp_path / "data")
    with httpx.Client(base_url=url, timeout=60) as client:
        started = client.post("/workbench/api/batches", json={"rows": batch_rows(3)})
        assert started.status_code == 202, started.text
        batch = finished_batch(client, started.json()["id"], 60)
        takes = client.get("/workbench/api/takes", params={"batch": started.json()["id"]}).json()["takes"]
    assert batch["done"] == 2 and batch["failed"] == 1 and batch["eta_seconds"] == 0, batch
    assert [(e["row"], e["message"]) for e in batch["errors"]] == [(2, "model error, see server log")], batch
    assert sorted(t["row"] for t in takes) == [1, 3]
    assert any("illegal memory access (injected)" in r.getMessage() or (r.exc_info and "injected" in str(r.exc_info[1]))
               for r in caplog.records), "the traceback is in the server's log"


# ----------------------------------------------------------------------------- defect 3: long-form on a full disk


def test_long_form_on_a_full_audio_disk_shows_the_error_and_leaves_no_part_file(serve, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with tmpfs(data / "takes") as audio:  # the take store's audio: long-form's takes are kept there
        fill(audio)
        url = serve(data)
        with httpx.Client(base_url=url + "/v1/longform", timeout=60) as client:
            r = client.post("/projects", json={"text": "Hi there.\n\nBye now.", "voice": "Narrator"})
            assert r.status_code == 201, r.text
            pid = r.json()["id"]
            assert client.post(f"/projects/{pid}/generate").status_code == 200
            progress = until(lambda: (p := client.get(f"/projects/{pid}/progress").json())["running"] is False
                             and p, 60, "the end of the render")
            assert progress["state"] == "failed" and progress["error"].startswith("disk full"), progress
            segments = client.get(f"/projects/{pid}").json()["segments"]
            assert segments[0]["status"] == "failed" and segments[0]["error"].startswith("disk full")
            r = client.get(f"/projects/{pid}/export")
            assert r.status_code == 400 and "no audio yet" in r.json()["error"]["message"]
        assert files(audio) == []  # no .part, no temporary, no orphan take


def test_a_full_data_folder_refuses_new_projects_with_507_and_exports_say_no_audio_yet(serve, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "data", "4m") as data:
        url = serve(data)
        with httpx.Client(base_url=url + "/v1/longform", timeout=60) as client:
            r = client.post("/projects", json={"text": "Hi there.\n\nBye now.", "voice": "Narrator"})
            assert r.status_code == 201, r.text
            pid = r.json()["id"]
            before = files(data)
            fill(data)
            r = client.get(f"/projects/{pid}/export", params={"format": "mp3"})
            assert r.status_code == 400 and "no audio yet" in r.json()["error"]["message"], r.text
            r = client.post("/projects", json={"text": "Another text. " * 200, "voice": "Narrator"})
            assert r.status_code == 507 and r.json()["error"]["message"].startswith("disk full"), r.text
            assert [p["id"] for p in client.get("/projects").json()] == [pid]
        assert files(data) == before  # no .export, no .part left behind


# ----------------------------------------------------------------------------- defect 7: big batches


def test_a_batch_over_the_row_limit_is_refused_naming_the_limit(serve, tmp_path: Path) -> None:
    with httpx.Client(base_url=serve(tmp_path / "data"), timeout=60) as client:
        r = client.post("/workbench/api/batches", json={"rows": batch_rows(41)})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["field"] == "input" and "more than 40 rows" in error["message"]
        assert "COSYVOICE_MAX_BATCH_ROWS" in error["message"]


def test_a_running_batch_can_be_cancelled_and_keeps_its_takes(serve, tmp_path: Path) -> None:
    with httpx.Client(base_url=serve(tmp_path / "data"), timeout=60) as client:
        batch_id = client.post("/workbench/api/batches", json={"rows": batch_rows(40)}).json()["id"]
        until(lambda: client.get(f"/workbench/api/batches/{batch_id}").json()["done"] >= 2, 120, "two takes")
        r = client.post(f"/workbench/api/batches/{batch_id}/cancel")
        assert r.status_code == 200, r.text
        batch = finished_batch(client, batch_id, 30)
        assert batch["state"] == "cancelled" and 2 <= batch["done"] < 40 and batch["failed"] == 0
        takes = client.get("/workbench/api/takes", params={"batch": batch_id}).json()["takes"]
        assert sorted(t["row"] for t in takes) == list(range(1, batch["done"] + 1))


def test_a_batch_the_servers_shutdown_stops_is_interrupted_and_keeps_no_cut_short_take(
        serve, service: TTSService, tmp_path: Path) -> None:
    """The drain cancels the row being made: the batch ends ``interrupted`` (resumable), its finished rows kept,
    and the cut-short row is no take (its session's iteration raises instead of ending as if whole)."""
    import asyncio

    rows = [{"text": "Hello there, my friend. " * 20, "voice": "Narrator", "seed": i} for i in range(1, 4)]
    with httpx.Client(base_url=serve(tmp_path / "data"), timeout=60) as client:
        batch_id = client.post("/workbench/api/batches", json={"rows": rows}).json()["id"]
        until(lambda: service.active_sessions == 1, 60, "the first row being made")
        asyncio.run(service.drain(grace_seconds=0))
        batch = finished_batch(client, batch_id, 30)
        assert (batch["state"], batch["done"], batch["failed"]) == ("interrupted", 0, 0), batch
        assert batch["error"] == "the server stopped while it ran; resume it"
        assert client.get("/workbench/api/takes", params={"batch": batch_id}).json()["takes"] == []


def _written_bytes() -> int:
    """Bytes this process has passed to write() (Linux): every thread's, the job worker's included."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def test_a_batch_does_the_same_bookkeeping_for_its_last_row_as_for_its_first(service: TTSService,
                                                                             tmp_path: Path) -> None:
    """100,000 rows slowed to a quarter of their first speed when every failed row rewrote the whole error
    list; now each row writes the same few bytes, however many failed before it."""
    store = TakeStore(tmp_path / "data")
    rows = [Row(i, {"text": "Hi.", "voice": "Narrator", "seed": "not a number"}) for i in range(1, 1501)]
    written: list[int] = []
    ending: list[Progress] = []

    def progress(p: Progress) -> None:
        written.append(_written_bytes())
        ending[:] = [p]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(service, "limits", Limits(max_batch_rows=2000))
        result = run_batch(service, store, rows, on_progress=progress)
    assert len(result.errors) == 1500 and result.errors[0].field == "seed" and ending[0].eta_seconds == 0
    first, last = written[100] - written[0], written[-1] - written[-101]
    assert last < 1.5 * first, (first, last)
    store.close()


# ----------------------------------------------------------------------------- defect 10: one data folder, two servers


class RestProcess:
    """``python -m cosyvoice.server.rest`` on a free loopback port over a data folder, its log in a file."""

    def __init__(self, bundle: Path, voices: Path, data: Path, log: Path) -> None:
        port = free_port()
        env = {**os.environ, "COSYVOICE_DEVICE": "cpu", "COSYVOICE_DATA_DIR": str(data), "PYTHONPATH": str(ROOT)}
        self.log = log
        self.process = subprocess.Popen([sys.executable, "-m", "cosyvoice.server.rest", "--model-dir", str(bundle),
                                         "--port", str(port), "--voice-dir", str(voices), "--log-level", "info"],
                                        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        until_ready(self.process, self.url, log=log)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)


@pytest.fixture()
def two_servers(tiny_bundle_dir: Path, tmp_path: Path, short_prompt_wav: Path):
    """Start REST servers (as processes) on one voice folder and one data folder."""
    started: list[RestProcess] = []

    def start(n: int = 2) -> list[RestProcess]:
        for _ in range(n):
            started.append(RestProcess(tiny_bundle_dir, tmp_path / "voices", tmp_path / "data",
                                       tmp_path / f"server{len(started)}.log"))
        voice = httpx.post(f"{started[-n].url}/v1/voices", data={"name": "Narrator", "transcript": TRANSCRIPT},
                           files={"audio": ("a.wav", short_prompt_wav.read_bytes(), "audio/wav")}, timeout=60)
        assert voice.status_code in (201, 409), voice.text
        return started[-n:]

    yield start
    for server in started:
        server.stop()


def _project(url: str, segments: int) -> str:
    text = "\n\n".join(f"Paragraph number {i} is here." for i in range(segments))
    r = httpx.post(f"{url}/v1/longform/projects", json={"text": text, "voice": "Narrator"}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_progress_and_cancel_reach_a_render_from_another_server_on_the_data_folder(two_servers) -> None:
    a, b = two_servers()
    pid = _project(a.url, 30)
    assert httpx.post(f"{a.url}/v1/longform/projects/{pid}/generate", timeout=60).status_code == 200
    progress = f"/v1/longform/projects/{pid}/progress"
    seen = until(lambda: (p := httpx.get(b.url + progress).json())["done"] >= 1 and p, 120, "a take seen from B")
    assert seen["running"] and seen["current"] is not None and seen["queued"] >= 1
    cancelled = httpx.post(f"{b.url}/v1/longform/projects/{pid}/cancel", timeout=60)
    assert cancelled.status_code == 200, cancelled.text
    ended = until(lambda: (p := httpx.get(a.url + progress).json())["running"] is False and p, 10, "the stop")
    assert ended["state"] == "cancelled" and ended["done"] < 30
    until(lambda: httpx.get(f"{a.url}/ready").json()["active_sessions"] == 0, 60, "the end of A's last take")
    assert httpx.get(a.url + progress).json()["done"] == ended["done"]  # nothing more was made


def test_deleting_a_project_on_one_server_ends_its_render_on_the_other_cleanly(two_servers, tmp_path: Path) -> None:
    a, b = two_servers()
    pid = _project(a.url, 30)
    assert httpx.post(f"{a.url}/v1/longform/projects/{pid}/generate", timeout=60).status_code == 200
    until(lambda: httpx.get(f"{b.url}/v1/longform/projects/{pid}/progress").json()["done"] >= 1, 120, "a take")
    assert httpx.delete(f"{b.url}/v1/longform/projects/{pid}", timeout=60).status_code == 200
    until(lambda: httpx.get(f"{a.url}/v1/longform/projects/{pid}/progress").status_code == 404, 30, "the delete")
    records = JobRunner(tmp_path / "data")  # the job's final state is written after its last take's files
    until(lambda: not records.jobs(pid, active=True), 60, "the end of A's render")
    records.close()
    store = TakeStore(tmp_path / "data")
    assert [t.id for t in store.takes() if t.longform["project"] == pid] == []  # the project's takes went with it
    assert files(store.audio_dir) == sorted(t.audio for t in store.takes())  # and no orphan take file
    for server in (a, b):
        assert "Traceback" not in server.log.read_text(), server.log.read_text()


def test_a_batch_killed_with_its_server_is_interrupted_and_resumed_by_another(two_servers) -> None:
    (a,) = two_servers(1)
    with httpx.Client(base_url=a.url, timeout=60) as client:
        batch_id = client.post("/workbench/api/batches", json={"rows": batch_rows(12)}).json()["id"]
        until(lambda: client.get(f"/workbench/api/batches/{batch_id}").json()["done"] >= 3, 120, "three takes")
    a.process.send_signal(signal.SIGKILL)
    a.process.wait(30)
    (b,) = two_servers(1)
    with httpx.Client(base_url=b.url, timeout=60) as client:
        batch = client.get(f"/workbench/api/batches/{batch_id}").json()
        assert batch["state"] == "interrupted" and 3 <= batch["done"] < 12, batch
        r = client.post(f"/workbench/api/batches/{batch_id}/resume")
        assert r.status_code == 200, r.text
        batch = finished_batch(client, batch_id, 180)
        assert batch["state"] == "done" and batch["failed"] == 0, batch
        takes = client.get("/workbench/api/takes", params={"batch": batch_id}).json()["takes"]
        assert sorted(t["row"] for t in takes) == list(range(1, 13))  # each row once: none lost, none made twice
        r = client.post(f"/workbench/api/batches/{batch_id}/resume")
        assert r.status_code == 400 and "interrupted" in r.json()["error"]["message"]
