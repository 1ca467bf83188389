"""A server whose voice folder and data folder are read-only (voices baked into an image, a read-only mount; issue
20, item 11) starts and serves them read-only: ``/ready`` is ready and says which folders are read-only, the saved
voices speak, stored takes and projects are listed, and every save or job is refused with a message that names
the folder's setting. A real read-only bind mount over real folders, a real server on loopback."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from test_rest import Server
from test_voice_storage import read_only_mount
from waiting import until

from cosyvoice.context import StudioContext
from cosyvoice.owners import ANONYMOUS
from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings, default_data_dir
from cosyvoice.voices import VoiceLibrary

TRANSCRIPT = "Hello, this is a short prompt for testing."


def _refused(answer: httpx.Response, setting: str) -> None:
    assert answer.status_code == 403, (answer.status_code, answer.text[:300])
    message = answer.json()["error"]["message"]
    assert "read-only" in message and setting in message, message


def test_read_only_folders_are_served_read_only(tts, tmp_path: Path, short_prompt_wav: Path) -> None:
    root = tmp_path / "image"
    voices, data = root / "voices", default_data_dir(root / "voices")

    def service() -> TTSService:  # what the server's start-up loads
        return TTSService(tts.model, VoiceLibrary(voices, tts.frontend, model_dir=tts.model_dir),
                          Limits(max_sessions=2, queue_timeout_seconds=60))

    made = service()  # made while writable: a saved voice, a take, a long-form project
    made.create_voice("Narrator", short_prompt_wav.read_bytes(), TRANSCRIPT)
    context = StudioContext(service=made, data_dir=data)
    take = context.takes.add_take(np.zeros(2400, np.float32), 24000, {"text": "kept"}, label="sysA",
                                  owner=ANONYMOUS)
    # the client's
    project = context.studio().editor.create("Kept", "One short sentence.", voice="Narrator", owner=ANONYMOUS)
    context.close()

    with read_only_mount(root) as mounted:
        if not mounted:
            pytest.skip("this process may not mount (a read-only bind mount needs root)")
        server = Server(create_app(ServerSettings(voice_dir=str(voices)), loader=service))
        try:
            with httpx.Client(base_url=server.url, timeout=120) as client:
                ready = until(lambda: (r := client.get("/ready")).json()["status"] != "loading" and r, 60,
                              "the end of the model's load")
                assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
                read_only = ready.json()["read_only"]
                assert "COSYVOICE_VOICE_DIR" in read_only["voices"] and "COSYVOICE_DATA_DIR" in read_only["data"]
                assert client.get("/health").json() == {"status": "ok"}

                # what the folders hold is served
                assert "Narrator" in [v["name"] for v in client.get("/v1/voices").json()["data"]]
                speech = client.post("/v1/audio/speech", json={"input": "Good morning.", "voice": "Narrator",
                                                               "response_format": "wav", "seed": 1})
                assert speech.status_code == 200 and speech.content[:4] == b"RIFF" and len(speech.content) > 1000
                assert take.id in [t["id"] for t in client.get("/workbench/api/takes").json()["takes"]]
                assert client.get(f"/workbench/api/takes/{take.id}/audio").content[:4] == b"RIFF"
                assert [p["id"] for p in client.get("/v1/longform/projects").json()] == [project.id]
                assert client.get(f"/v1/longform/projects/{project.id}").status_code == 200

                # saves and jobs are refused, naming the folder's setting
                _refused(client.post("/v1/voices", data={"name": "Ann", "transcript": TRANSCRIPT},
                                     files={"audio": ("a.wav", short_prompt_wav.read_bytes(), "audio/wav")}),
                         "COSYVOICE_VOICE_DIR")
                _refused(client.delete("/v1/voices/Narrator"), "COSYVOICE_VOICE_DIR")
                _refused(client.post("/workbench/api/batches", json={"rows": [{"text": "Hi.", "voice": "Narrator"}]}),
                         "COSYVOICE_DATA_DIR")
                _refused(client.post("/workbench/api/tests", json={"kind": "mos", "items": [{"takes": [take.id]}]}),
                         "COSYVOICE_DATA_DIR")
                _refused(client.post("/v1/longform/projects", json={"text": "New words.", "voice": "Narrator"}),
                         "COSYVOICE_DATA_DIR")
                _refused(client.post(f"/v1/longform/projects/{project.id}/generate"), "COSYVOICE_DATA_DIR")
                for export in (client.post(f"/v1/longform/projects/{project.id}/exports", json={}),
                               client.get(f"/v1/longform/projects/{project.id}/export")):  # exports are jobs too
                    _refused(export, "COSYVOICE_DATA_DIR")
                assert client.get(f"/v1/longform/projects/{project.id}/progress").json()["running"] is False
        finally:
            server.stop()
