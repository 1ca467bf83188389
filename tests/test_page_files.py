"""The web UI's handed-out files (takes, exports, ZIPs) live in one temporary root per studio, which goes with the
studio: a server start or a test run must not leave one behind for good."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from waiting import free_port, until

from app.files import PageFiles
from cosyvoice.jobs import STOPPED_WHILE_RUNNING, JobRunner, JobState

ROOT = Path(__file__).resolve().parents[1]


def test_the_pages_handed_out_files_leave_the_temporary_folder_with_their_studio() -> None:
    files = PageFiles()
    root = files.root
    (files.folder() / "take.wav").write_bytes(b"RIFF")
    assert root.is_dir() and len(list(root.rglob("take.wav"))) == 1
    del files
    gc.collect()
    assert not root.exists()


def _start_web_ui(bundle: Path, tmp_path: Path, **env: str) -> tuple[subprocess.Popen, str, Path]:
    """``webui.py`` serving ``bundle`` (its temporary folder ``tmp_path/tmp``), once its routers answer."""
    port, log = free_port(), tmp_path / "webui.log"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "COSYVOICE_VOICE_DIR": str(tmp_path / "voices"), **env}
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "webui.py", "--model-dir", str(bundle), "--port", str(port)],
                                  cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            # the routers mount after the page: the app is complete (a stop before that ends the start-up)
            return httpx.get(f"{url}/workbench/", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        until(serving, 180, "the web UI")
    except BaseException:
        server.kill()
        raise
    return server, url, log


def test_a_web_ui_stopped_by_a_service_manager_removes_its_files(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    """SIGTERM (systemd, docker, a Space stopping) ends ``webui.py`` as Ctrl-C does: it exits 0 and its handed-out
    files' root is gone (a SIGTERM left one in the temporary folder per stop)."""
    server, _, log = _start_web_ui(tiny_bundle_dir, tmp_path)
    tmp = tmp_path / "tmp"
    try:
        assert len(list(tmp.glob("cosyvoice-takes-*"))) == 1
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
    assert list(tmp.glob("cosyvoice-takes-*")) == []


def test_a_web_ui_stopped_mid_batch_drains_the_engine_before_it_exits(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    """SIGTERM while a batch row is being made: the web UI drains as the servers do (the grace, then the cancel)
    and exits once the engine computes for nobody, not while its threads still compute (the servers' crash)."""
    server, url, log = _start_web_ui(tiny_bundle_dir, tmp_path, COSYVOICE_SHUTDOWN_GRACE_SECONDS="0",
                                     COSYVOICE_DATA_DIR=str(tmp_path / "data"))
    try:
        rows = [{"text": "Hello there, my friend. " * 20, "voice": "en-allison", "seed": i} for i in (1, 2)]
        batch = httpx.post(f"{url}/workbench/api/batches", json={"rows": rows}, timeout=60)
        assert batch.status_code == 202, batch.text
        until(lambda: httpx.get(f"{url}/workbench/api/batches/{batch.json()['id']}").json()["state"] == "running",
              60, "the batch running")
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
    said = log.read_text()
    assert "shutting down: running takes and jobs may finish within 0 s" in said, said[-3000:]
    assert "still computes" not in said and "Traceback" not in said, said[-3000:]
    job = JobRunner(tmp_path / "data").job(batch.json()["id"])
    assert (job.state, job.done, job.failed) == (JobState.INTERRUPTED, 0, 0), job  # resumable, nothing cut short kept
    assert job.error == STOPPED_WHILE_RUNNING and job.finished is not None  # ended by the process, not found dead
