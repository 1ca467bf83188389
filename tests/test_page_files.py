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

ROOT = Path(__file__).resolve().parents[1]


def test_the_pages_handed_out_files_leave_the_temporary_folder_with_their_studio() -> None:
    files = PageFiles()
    root = files.root
    (files.folder() / "take.wav").write_bytes(b"RIFF")
    assert root.is_dir() and len(list(root.rglob("take.wav"))) == 1
    del files
    gc.collect()
    assert not root.exists()


def test_a_web_ui_stopped_by_a_service_manager_removes_its_files(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    """SIGTERM (systemd, docker, a Space stopping) ends ``webui.py`` as Ctrl-C does: it exits 0 and its handed-out
    files' root is gone (a SIGTERM left one in the temporary folder per stop)."""
    port, log = free_port(), tmp_path / "webui.log"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "COSYVOICE_VOICE_DIR": str(tmp_path / "voices")}
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "webui.py", "--model-dir", str(tiny_bundle_dir),
                                   "--port", str(port)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        def serving() -> bool:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                # the routers mount after the page: the app is complete (a stop before that ends the start-up)
                return httpx.get(f"http://127.0.0.1:{port}/workbench/", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        until(serving, 180, "the web UI")
        assert len(list(tmp.glob("cosyvoice-takes-*"))) == 1
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
    assert list(tmp.glob("cosyvoice-takes-*")) == []
