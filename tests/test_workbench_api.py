"""The workbench over real loopback HTTP (the REST app with its router, uvicorn in a thread), on the tiny bundle."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_rest import Server

from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings
from cosyvoice.voices import VoiceLibrary
from cosyvoice.workbench.store import WorkbenchStore


@pytest.fixture(scope="module")
def app_url(tts, tmp_path_factory: pytest.TempPathFactory, short_prompt_wav: Path) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("workbench-api")
    service = TTSService(tts.model, VoiceLibrary(root / "voices", tts.frontend, model_dir=tts.model_dir),
                         Limits(max_sessions=2, queue_timeout_seconds=60))
    service.create_voice("Narrator", short_prompt_wav.read_bytes(), "A short test prompt.")
    server = Server(create_app(ServerSettings(voice_dir=str(root / "voices")), service))
    yield server.url, root / ".studio"
    server.stop()


def test_batch_over_http_reports_progress_and_bad_rows(app_url: tuple[str, Path]) -> None:
    url, data_dir = app_url
    rows = [{"text": "Hello there.", "voice": "Narrator", "seed": 3, "label": "sysA"},
            {"text": "Hello there.", "voice": "Narrator", "mode": "cross_lingual", "label": "sysB"},
            {"text": "", "voice": "Narrator", "label": "sysB"}]
    with httpx.Client(base_url=url, timeout=60) as client:
        started = client.post("/workbench/api/batches", json={"rows": rows})
        assert started.status_code == 202 and started.json()["rows"] == 3
        deadline = time.monotonic() + 300
        while (batch := client.get(f"/workbench/api/batches/{started.json()['id']}").json())["state"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert (batch["state"], batch["done"], batch["failed"]) == ("finished", 2, 1)
        assert batch["errors"] == [{"row": 3, "field": "text", "message": "text is empty; type something to say"}]
        assert batch["eta_seconds"] == 0

        page = client.get("/workbench/api/takes", params={"batch": started.json()["id"]}).json()
        takes = page["takes"]
        assert takes[0]["provenance"]["seed"] == 3 and takes[1]["provenance"]["mode"] == "cross_lingual"
        assert client.get("/workbench/api/takes", params={"after": page["last"]}).json()["takes"] == []
        assert (data_dir / "workbench.sqlite3").is_file()  # beside the voice folder
        audio = client.get(f"/workbench/api/takes/{takes[0]['id']}/audio")
        assert audio.headers["content-type"] == "audio/wav" and audio.content[:4] == b"RIFF"
        table = list(csv.DictReader(io.StringIO(client.get("/workbench/api/takes.csv").text)))
        assert {r["take_id"] for r in table} >= {t["id"] for t in takes}

        # a test over them; its rater sees slots, never take ids, and cannot rate before listening
        made = client.post("/workbench/api/tests", json={"kind": "ab", "conditions": ["sysA", "sysB"]})
        assert made.status_code == 201 and made.json()["items"] == 1
        test_id = made.json()["id"]
        assert "Listen to both samples" in client.get(f"/workbench/api/tests/{test_id}").json()["instructions"]
        rater = client.post(f"/workbench/api/tests/{test_id}/raters", json={"name": "Ann"}).json()["rater"]
        item = client.get(f"/workbench/api/raters/{rater}/next").json()
        assert item["slots"] == [{"slot": "A", "rated": True}, {"slot": "B", "rated": True}]
        sample = client.get(f"/workbench/api/raters/{rater}/audio/0/A")
        assert sample.content[:4] == b"RIFF" and "take" not in str(sample.headers)
        refused = client.post(f"/workbench/api/raters/{rater}/answers", json={"position": 0, "answer": {"choice": "A"}})
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "answer"
        assert "to the end first" in refused.json()["error"]["message"]
        assert client.post(f"/workbench/api/raters/{rater}/events",
                           json={"position": 0, "slot": "C", "event": "play"}).status_code == 400

        # the scorecard of a test over one short take of the Narrator (kept short: DNSMOS and Resemblyzer are slow)
        short = WorkbenchStore(data_dir).add_take(
            (0.2 * np.sin(np.arange(12000) / 9)).astype(np.float32), 24000,
            {"voice_id": takes[0]["provenance"]["voice_id"]},
            label="tone")
        mos = client.post("/workbench/api/tests", json={"kind": "mos", "items": [{"takes": [short.id]}]}).json()["id"]
        card = client.get(f"/workbench/api/tests/{mos}/scorecard", timeout=300)
        assert card.status_code == 200 and [c["condition"] for c in card.json()["conditions"]] == ["tone"]
        assert -1 <= card.json()["takes"][0]["sim_campplus"] < 1  # against Narrator's recording
        assert "mean nothing" in card.json()["note"]

        for path in ("/workbench/", f"/workbench/rate/{test_id}", f"/workbench/tests/{test_id}"):
            assert "<script" in client.get(path).text
        assert client.get("/workbench/api/tests/test-nope/results").status_code == 404
        bad = client.post("/workbench/api/tests", json={"kind": "abx", "conditions": ["sysA"]})
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "kind"


def test_the_web_ui_serves_the_same_workbench(tts, tmp_path: Path) -> None:
    pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
    from test_webui import make_studio, serving

    studio = make_studio(tts, tmp_path)
    store = WorkbenchStore(tmp_path / ".studio")  # beside the studio's voice folder
    take = store.add_take(np.zeros(2400, np.float32), 24000, {"text": "hi"}, label="sysA", owner="browser:x")
    with serving(studio) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert "Listening-test workbench" in client.get("/workbench/").text
        assert [t["id"] for t in client.get("/workbench/api/takes").json()["takes"]] == [take.id]
        # a browser's own history (the page keeps its id in local storage): only its takes, only newer ones
        mine = client.get("/workbench/api/takes", params={"browser": "x"}).json()
        assert [t["id"] for t in mine["takes"]] == [take.id] and mine["last"] == take.seq
        assert client.get("/workbench/api/takes", params={"browser": "y"}).json()["takes"] == []
        assert client.get("/workbench/api/takes", params={"browser": "x", "after": take.seq}).json()["takes"] == []
        missing = client.get("/workbench/api/tests/test-nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
