"""The README's `bash scripts/webui.sh` on a venv that it alone installed: the workbench and long-form pages
answer, and a take's sound reaches the page over the live-audio WebSocket, in chromium.

The dev extra brings more than the web UI's own (`ui`), so the other web UI tests cannot see a package that
only `ui` users lack (websockets once: the live audio's WebSocket answered 404 and nothing played). Here the
server runs from its own venv, `.venv-webui` in the repository, made by webui.sh (scripts/setup.sh with the ui
extra) and made again from nothing whenever setup.sh would reinstall (pyproject.toml or setup.sh changed), so
that a package dropped from `ui` is gone from it too; Playwright drives chromium from the test's venv.
scripts/test.sh makes it with `scripts/webui.sh --install` before the tests, beside the other builds; where it
did not, the build happens here and its time goes to ``test-artifacts/webui-install.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import FLAGS, require_browser
from waiting import free_port

sync_api, CHROMIUM = require_browser()

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-webui"
ARTIFACTS = ROOT / "test-artifacts"
INSTALL_SECONDS = 1200  # a first build: torch and gradio with their dependencies


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COSYVOICE_EXTRAS", "VIRTUAL_ENV", "PYTHONPATH")}
    # the machine's own Python, as a person's shell has it (not the test's venv)
    return {**env, "COSYVOICE_VENV": str(VENV), "PYTHON": str(Path(sys.base_prefix) / "bin" / "python3"),
            "COSYVOICE_DATA_DIR": str(tmp / "data")}


@pytest.fixture(scope="module")
def webui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``bash scripts/webui.sh`` on a free loopback port (no model here: the demo model); yields its URL."""
    tmp = tmp_path_factory.mktemp("webui-install")
    env = _env(tmp)
    check = subprocess.run(["bash", "scripts/setup.sh", "--check"], cwd=ROOT, env={**env, "COSYVOICE_EXTRAS": "ui"},
                           capture_output=True, text=True, timeout=120)
    fresh = check.returncode != 0
    if fresh and VENV.exists():
        shutil.rmtree(VENV)  # not upgraded in place: what `ui` no longer declares must be gone
    port = free_port()
    log_path = tmp / "webui.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        server = subprocess.Popen(["bash", "scripts/webui.sh", "--port", str(port), "--demo-dir", str(tmp / "demo"),
                                   "--voice-dir", str(tmp / "voices")], cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        installed = None
        while True:
            assert server.poll() is None, log_path.read_text()[-5000:]
            said = log_path.read_text()
            if installed is None and ("[setup] done" in said or "no pip call" in said):
                installed = time.monotonic() - started
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(b"GET /workbench/ HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    if b" 200 " in s.recv(64):  # the routers mount after the page: the app is complete
                        break
            except OSError:
                pass
            assert time.monotonic() - started < INSTALL_SECONDS, log_path.read_text()[-5000:]
            time.sleep(1)
        if fresh:
            ARTIFACTS.mkdir(exist_ok=True)
            (ARTIFACTS / "webui-install.json").write_text(json.dumps({
                "fresh_venv_install_seconds": round(installed or 0, 1),
                "start_to_serving_seconds": round(time.monotonic() - started, 1),
                "load_average": os.getloadavg()}, indent=2))
        yield f"http://127.0.0.1:{port}/"
    finally:
        os.killpg(server.pid, 15)  # bash's exec left webui.py as the session's leader
        server.wait(60)


def test_a_take_plays_over_the_live_channel_on_the_ui_venv(webui: str, tmp_path: Path) -> None:
    # the long-form page's router imports what it needs too (the fixture has waited for the workbench's 200)
    with urllib.request.urlopen(webui + "studio/longform", timeout=30) as answer:
        assert answer.status == 200
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True, args=FLAGS, locale="en-US",
            viewport={"width": 1280, "height": 1000})
        try:
            page = context.new_page()
            page.goto(webui)
            page.wait_for_function("() => window.cvStudio !== undefined")
            page.click("#voice input")
            page.get_by_role("option", name="en-allison").click()
            page.fill("#text textarea", "Hello there, this take is streamed to you.")
            page.fill("#seed input", "2")
            page.click("#generate")
            page.wait_for_function("() => { const t = Object.values(window.cvStudio.takes).at(-1);"
                                   " return t && (t.firstSoundAt !== null || t.endAt !== null) }", timeout=120000)
            take = page.evaluate("() => window.cvStudio.summary(Object.keys(window.cvStudio.takes).at(-1))")
            # the first sound came over the live WebSocket while the take was made
            assert take["state"] == "playing" and take["firstByteAt"] is not None and take["samples"] > 0, take
            sync_api.expect(page.locator("#live-player")).to_have_attribute("data-state", "playing")
            page.click("#stop")
            sync_api.expect(page.locator("#generate")).to_be_enabled(timeout=30000)
        finally:
            context.close()
