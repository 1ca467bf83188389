"""The composition root (cosyvoice/context.py): each entry point builds one context, so a process opens its take
store once, however many features use it (the web UI's history, the workbench, long-form, batches), and no store is
opened behind a request. Real entry points on the tiny bundle: the REST app loading its model after start, the web
UI's loader and page, the batch and long-form command lines in process."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from test_rest import Server

from cosyvoice.context import StudioContext
from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings, default_data_dir
from cosyvoice.takes.store import TakeStore
from cosyvoice.tools import batch, longform
from cosyvoice.voices import BUILTIN_VOICE_DIR, VoiceLibrary


@pytest.fixture()
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folder of every take store opened from now on (the real store opens; its opening is recorded)."""
    folders: list[Path] = []
    real = TakeStore.__init__

    def recording(self: TakeStore, root: str | Path, *args: object) -> None:
        folders.append(Path(root))
        real(self, root, *args)

    monkeypatch.setattr(TakeStore, "__init__", recording)
    return folders


def _use_every_feature(client: httpx.Client, context: StudioContext) -> None:
    """A take listed, a long-form project made and generated, a batch run: every store of the data folder used
    (waiting on the jobs' own ends, not polling)."""
    assert client.get("/workbench/api/takes").status_code == 200
    made = client.post("/v1/longform/projects", json={"name": "Book", "text": "Hi there.", "voice": "en-allison"})
    assert made.status_code == 201, made.text
    project = made.json()["id"]
    assert client.post(f"/v1/longform/projects/{project}/generate").status_code in (200, 202)
    batch_id = client.post("/workbench/api/batches", json={"rows": [{"text": "Hi.", "voice": "en-allison",
                                                                    "seed": 1}]}).json()["id"]
    context.jobs.wait(batch_id, 120)
    assert client.get(f"/workbench/api/batches/{batch_id}").json()["done"] == 1
    assert context.studio().renders.wait(project, 120)["done"] == 1
    takes = client.get("/workbench/api/takes").json()["takes"]
    assert {"batch", "long-form"} <= {t["source"] for t in takes}, takes


def test_the_rest_server_opens_the_take_store_once(tts, tmp_path: Path, opened: list[Path]) -> None:
    voices = tmp_path / "voices"

    def load() -> TTSService:  # what the server's start-up loads, after it answers /health
        return TTSService(tts.model, VoiceLibrary(voices, tts.frontend, model_dir=tts.model_dir,
                                                  builtin_dir=BUILTIN_VOICE_DIR),
                          Limits(max_sessions=2, queue_timeout_seconds=60))

    app = create_app(ServerSettings(voice_dir=str(voices)), loader=load)
    server = Server(app)
    try:
        for loading in [t for t in threading.enumerate() if t.name == "cosyvoice-load"]:
            loading.join(120)  # the model's load, started with the server
        with httpx.Client(base_url=server.url, timeout=120) as client:
            assert client.get("/ready").json()["status"] == "ready"
            _use_every_feature(client, app.state.server.context)
    finally:
        server.stop()
    assert opened == [default_data_dir(voices)]


def test_the_web_ui_opens_the_take_store_once(tiny_bundle_dir: Path, tmp_path: Path, short_prompt_wav: Path,
                                              opened: list[Path]) -> None:
    pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
    from test_webui import TRANSCRIPT, serving

    from app.ui import load_studio

    studio = load_studio(tiny_bundle_dir, voice_dir=tmp_path / "voices", device="cpu")
    list(studio.generate("take-0001", "zero_shot", "Hi there.", str(short_prompt_wav), TRANSCRIPT, "", None, 5, 1.0,
                         False, "wav"))  # the page's Generate: a take in the history
    assert len(studio.store.takes()) == 1
    with serving(studio) as url, httpx.Client(base_url=url.rstrip("/"), timeout=120) as client:
        _use_every_feature(client, studio.context)
    studio.service.close()
    assert opened == [default_data_dir(tmp_path / "voices")]


def test_the_command_lines_open_the_take_store_once(tiny_bundle_dir: Path, tmp_path: Path,
                                                   opened: list[Path]) -> None:
    cli_dirs = {"voices": tmp_path / "voices", "data": tmp_path / "data", "out": tmp_path / "out"}
    rows, article = tmp_path / "rows.csv", tmp_path / "article.txt"
    rows.write_text("text,voice,seed\nHi there.,en-allison,3\nBye now.,en-allison,4\n", encoding="utf-8")
    article.write_text("Hi there.\n\nBye now.\n", encoding="utf-8")
    common = ["--model-dir", str(tiny_bundle_dir), "--voice-dir", str(cli_dirs["voices"]), "--data-dir",
              str(cli_dirs["data"]), "--device", "cpu"]
    assert batch.main([str(rows), "--out", str(cli_dirs["out"] / "batch"), *common]) == 0
    assert opened == [cli_dirs["data"]]
    assert longform.main([str(article), "--voice", "en-allison", "--out", str(cli_dirs["out"] / "book"),
                          *common]) == 0
    assert opened == [cli_dirs["data"]] * 2  # two processes' worth: one each
