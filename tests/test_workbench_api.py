"""The workbench over real loopback HTTP (the REST app with its router, uvicorn in a thread), on the tiny bundle;
behind API keys, on the REST app and on the web UI's app: raters need only their link, everything else the key."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from fastapi import FastAPI
from starlette.testclient import TestClient
from test_rest import Server
from waiting import until

from cosyvoice.context import StudioContext
from cosyvoice.owners import ANONYMOUS, Owners, key_owner
from cosyvoice.server import common
from cosyvoice.server.rest import create_app
from cosyvoice.server.workbench import rater_route, workbench_router
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings, default_data_dir
from cosyvoice.takes.store import TakeStore
from cosyvoice.voices import VoiceLibrary


@pytest.fixture(scope="module")
def app_url(tts, tmp_path_factory: pytest.TempPathFactory, short_prompt_wav: Path) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("workbench-api")
    service = TTSService(tts.model, VoiceLibrary(root / "voices", tts.frontend, model_dir=tts.model_dir),
                         Limits(max_sessions=2, queue_timeout_seconds=60))
    service.create_voice("Narrator", short_prompt_wav.read_bytes(), "A short test prompt.")
    server = Server(create_app(ServerSettings(voice_dir=str(root / "voices")), service))
    yield server.url, root / ".studio"
    server.stop()


def _ended(client: httpx.Client, batch_id: str) -> dict:
    """The batch's status once it is neither queued nor running."""
    return until(lambda: (b := client.get(f"/workbench/api/batches/{batch_id}").json())["state"] not in
                 ("queued", "running") and b, 300, f"the end of batch {batch_id}")


def test_batch_over_http_reports_progress_and_bad_rows(app_url: tuple[str, Path]) -> None:
    url, data_dir = app_url
    rows = [{"text": "Hello there.", "voice": "Narrator", "seed": 3, "label": "sysA"},
            {"text": "Hello there.", "voice": "Narrator", "mode": "cross_lingual", "label": "sysB"},
            {"text": "", "voice": "Narrator", "label": "sysB"}]
    with httpx.Client(base_url=url, timeout=60) as client:
        started = client.post("/workbench/api/batches", json={"rows": rows})
        assert started.status_code == 202 and started.json()["rows"] == 3
        batch = _ended(client, started.json()["id"])
        assert (batch["state"], batch["done"], batch["failed"]) == ("done", 2, 1)
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
        short = TakeStore(data_dir).add_take(
            (0.2 * np.sin(np.arange(12000) / 9)).astype(np.float32), 24000,
            {"voice_id": takes[0]["provenance"]["voice_id"]},
            label="tone", owner=ANONYMOUS)  # this client's: without keys or a browser cookie, "anonymous"
        mos = client.post("/workbench/api/tests", json={"kind": "mos", "items": [{"takes": [short.id]}]}).json()["id"]
        card = client.get(f"/workbench/api/tests/{mos}/scorecard", timeout=300)
        assert card.status_code == 200 and [c["condition"] for c in card.json()["conditions"]] == ["tone"]
        assert -1 <= card.json()["takes"][0]["sim_campplus"] < 1  # against Narrator's recording
        assert "mean nothing" in card.json()["note"]

        for path in ("/workbench/", f"/workbench/rate/{test_id}", f"/workbench/tests/{test_id}"):
            assert "<script" in client.get(path).text
        assert client.get("/workbench/api/tests/test-nope/results").status_code == 404
        bad = client.post("/workbench/api/tests", json={"kind": "abcx", "conditions": ["sysA"]})
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "kind"


def test_a_batch_naming_another_precision_than_the_server_runs_is_refused(app_url: tuple[str, Path]) -> None:
    """A server runs one model: a row asking for another precision is refused up front, saying which row, what
    it asked for, what runs, and where several precisions run; the running one is accepted."""
    url, _ = app_url
    rows = [{"text": "Hello there.", "voice": "Narrator", "seed": 3, "precision": "fp32"},
            {"text": "Hello there.", "voice": "Narrator", "seed": 3, "precision": "int8"}]
    with httpx.Client(base_url=url, timeout=60) as client:
        running = client.get("/ready").json()["precision"]["label"]
        assert running.startswith("fp32 (")
        refused = client.post("/workbench/api/batches", json={"rows": rows})
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "precision"
        message = refused.json()["error"]["message"]
        assert message.startswith(f"row 2: precision int8 was asked for, but this server runs {running}; ")
        assert "batch CLI (python -m cosyvoice.tools.batch)" in message
        unknown = client.post("/workbench/api/batches", content="text,voice,precision\nHi.,Narrator,fp8\n",
                              headers={"Content-Type": "text/csv"})
        assert unknown.status_code == 400 and "row 1: precision must be one of auto, fp32, bf16, int8" in \
            unknown.json()["error"]["message"]

        started = client.post("/workbench/api/batches", json={"rows": rows[:1]})
        assert started.status_code == 202
        batch_id = started.json()["id"]
        batch = _ended(client, batch_id)
        assert (batch["state"], batch["done"]) == ("done", 1)
        (take,) = client.get("/workbench/api/takes", params={"batch": batch_id}).json()["takes"]
        assert take["provenance"]["precision"] == running


def test_the_web_ui_serves_the_same_workbench(tts, tmp_path: Path) -> None:
    pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
    from test_webui import make_studio, serving

    studio = make_studio(tts, tmp_path)
    store = TakeStore(tmp_path / ".studio")  # beside the studio's voice folder
    owner = f"browser:{'a' * 32}"
    pcm = (0.5 * np.sin(np.arange(2400) / 7)).astype(np.float32)
    take = store.add_take(pcm, 24000, {"text": "hi", "seed": 9}, label="sysA", owner=owner)
    batch = store.start_batch("http", 1, owner=owner)
    in_batch = store.add_take(pcm, 24000, {"text": "row"}, owner=owner, batch=batch, row=1)
    in_book = store.add_take(pcm, 24000, {"text": "segment", "longform": {"project": "p", "segment": "s"}},
                             owner=owner)
    with (serving(studio) as url, httpx.Client(base_url=url, timeout=30, cookies={"cv-browser": "a" * 32}) as client,
          httpx.Client(base_url=url, timeout=30, cookies={"cv-browser": "b" * 32}) as other):
        assert "Listening-test workbench" in client.get("/workbench/").text
        every = [t["id"] for t in client.get("/workbench/api/takes").json()["takes"]]
        assert every == [take.id, in_batch.id, in_book.id]
        # a browser's own history (its id in the cv-browser cookie): only the takes it made one at a time (not its
        # batches' rows nor its books' segments, which "All takes" lists), only newer ones
        mine = client.get("/workbench/api/takes", params={"mine": True}).json()
        assert [t["id"] for t in mine["takes"]] == [take.id] and mine["last"] == take.seq
        assert store.count_takes(owner) == 1
        # players get the stored float32 samples; a download is 16-bit, named as the studio's Download box names it
        assert sf.info(io.BytesIO(client.get(f"/workbench/api/takes/{take.id}/audio").content)).subtype == "FLOAT"
        download = client.get(f"/workbench/api/takes/{take.id}/audio", params={"format": "wav"})
        assert sf.info(io.BytesIO(download.content)).subtype == "PCM_16"
        assert f'filename="take-seed9-{take.id}.wav"' in download.headers["content-disposition"]
        assert other.get("/workbench/api/takes").json()["takes"] == []
        assert client.get("/workbench/api/takes", params={"mine": True, "after": take.seq}).json()["takes"] == []
        missing = client.get("/workbench/api/tests/test-nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"


# ----------------------------------------------------------------------------- behind API keys: the rater's link

KEY = "owner-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
RATER_ROUTES = {("GET", "/workbench/rate/{test_id}"), ("GET", "/workbench/api/tests/{test_id}"),
                ("POST", "/workbench/api/tests/{test_id}/raters"), ("GET", "/workbench/api/raters/{rater_id}/next"),
                ("POST", "/workbench/api/raters/{rater_id}/events"),
                ("POST", "/workbench/api/raters/{rater_id}/answers"),
                ("GET", "/workbench/api/raters/{rater_id}/audio/{position}/{slot}"),
                ("GET", "/workbench/api/tests/{test_id}/training/{n}"),
                ("POST", "/workbench/api/raters/{rater_id}/questionnaire")}


def test_rater_route_opens_exactly_the_rate_page_and_the_rater_api(tmp_path: Path) -> None:
    router = workbench_router(StudioContext(data_dir=tmp_path))
    opened = {(method, route.path) for route in router.routes for method in route.methods
              if rater_route(method, re.sub(r"{[^}]+}", "x", route.path))}
    assert opened == RATER_ROUTES  # every other route of the router (owner, results, exports, takes) stays gated
    assert rater_route("GET", "/workbench/static/common.js") and rater_route("GET", "/workbench/static/workbench.css")
    for method, path in [("GET", "/workbench/static/owner.html"), ("POST", "/workbench/rate/x"),
                         ("DELETE", "/workbench/api/tests/x"), ("GET", "/workbench/api/tests"),
                         ("GET", "/workbench/api/tests/"), ("GET", "/workbench/api/tests/x/results"),
                         ("GET", "/workbench/rate/x/extra"), ("GET", "/workbench/api/raters/x/audio/0"),
                         ("GET", "/other/workbench/rate/x"), ("GET", "/workbench/rate/"),
                         ("GET", "/workbench/api/tests/x/raters.csv")]:
        assert not rater_route(method, path), (method, path)


@pytest.mark.parametrize("gate", ["rest", "webui"])
def test_both_gates_let_a_rater_through_behind_a_proxy_prefix(gate: str, tmp_path: Path) -> None:
    app = FastAPI()
    app.include_router(workbench_router(StudioContext(data_dir=tmp_path)))  # no service: raters need none
    if gate == "rest":
        app.add_middleware(common.ApiKeys, owners=Owners((KEY,)), public=rater_route)
    else:
        pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
        from app.auth import KeyGate
        app.add_middleware(KeyGate, owners=Owners((KEY,)), public=rater_route)
    with TestClient(app, root_path="/proxy") as client:
        missing = client.get("/proxy/workbench/api/tests/test-nope")  # reached the router: no such test
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
        assert client.get("/proxy/workbench/api/tests").status_code == 401
        assert client.get("/proxy/workbench/api/tests", headers=BEARER).status_code == 200


@pytest.fixture(scope="module", params=["rest", "webui"])
def keyed(request: pytest.FixtureRequest, tts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(url, data folder, whether it is the web UI) of an app with API keys."""
    root = tmp_path_factory.mktemp(f"keyed-{request.param}")
    if request.param == "rest":
        service = TTSService(tts.model, VoiceLibrary(root / "voices", tts.frontend, model_dir=tts.model_dir))
        server = Server(create_app(ServerSettings(voice_dir=str(root / "voices"), api_keys=(KEY,)), service))
        yield server.url, default_data_dir(root / "voices"), False
        server.stop()
    else:
        pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
        from test_webui import make_studio, serving

        studio = make_studio(tts, root, api_keys=(KEY,))
        with serving(studio) as url:
            yield url.rstrip("/"), default_data_dir(studio.service.voices.dir.parent), True


def _rate_without_a_key(anon: httpx.Client, made: dict, take_ids: tuple[str, str]) -> None:
    """Ann rates the test's A/B item without a key: page, assets, the test's rater view (no take ids), join,
    the item, its audio, play events and the answer."""
    test_id = made["id"]
    page = anon.get(made["rate_url"], headers={"accept": "text/html"})
    assert page.status_code == 200 and "<script" in page.text
    for asset in ("common.js", "workbench.css"):
        assert anon.get(f"/workbench/static/{asset}").status_code == 200
    view = anon.get(f"/workbench/api/tests/{test_id}")
    assert view.status_code == 200 and not any(take_id in view.text for take_id in take_ids)
    joined = anon.post(f"/workbench/api/tests/{test_id}/raters", json={"name": "Ann"}).json()
    rater = joined["rater"]
    assert re.fullmatch(r"rater-[0-9a-f]{32}", rater)
    item = anon.get(f"/workbench/api/raters/{rater}/next").json()
    assert item["done"] is False and [s["slot"] for s in item["slots"]] == ["A", "B"]
    for slot in ("A", "B"):
        assert anon.get(f"/workbench/api/raters/{rater}/audio/0/{slot}").content[:4] == b"RIFF"
        for event in ("play", "ended"):
            sent = anon.post(f"/workbench/api/raters/{rater}/events",
                             json={"position": 0, "slot": slot, "event": event})
            assert sent.status_code == 204
    done = anon.post(f"/workbench/api/raters/{rater}/answers", json={"position": 0, "answer": {"choice": "A"}})
    assert done.status_code == 200 and done.json()["done"] is True


def test_a_rater_needs_only_the_link_and_everything_else_needs_the_key(keyed: tuple) -> None:
    url, data_dir, webui = keyed
    store = TakeStore(data_dir)
    tone = (0.2 * np.sin(np.arange(2400) / 5)).astype(np.float32)  # 0.1 s: listen-gating passes at once
    a, b = (store.add_take(tone, 24000, {"text": "one"}, label=label, owner=key_owner(KEY))
            for label in ("sysA", "sysB"))
    with (httpx.Client(base_url=url, timeout=30, headers=BEARER) as owner,
          httpx.Client(base_url=url, timeout=30) as anon):
        spec = {"kind": "ab", "items": [{"takes": [a.id, b.id]}]}
        assert anon.post("/workbench/api/tests", json=spec).status_code == 401
        made = owner.post("/workbench/api/tests", json=spec).json()
        test_id = made["id"]
        assert re.fullmatch(r"test-[0-9a-f]{32}", test_id)  # the link is the secret: 128 random bits

        _rate_without_a_key(anon, made, (a.id, b.id))

        # everything else needs the key
        for method, path in [("GET", "/workbench/api/tests"), ("GET", f"/workbench/api/tests/{test_id}/results"),
                             ("GET", f"/workbench/api/tests/{test_id}/answers.csv"),
                             ("GET", f"/workbench/api/tests/{test_id}/scorecard"),
                             ("GET", f"/workbench/api/tests/{test_id}/scorecard.csv"),
                             ("GET", "/workbench/api/takes"), ("GET", "/workbench/api/takes.csv"),
                             ("GET", f"/workbench/api/takes/{a.id}/audio"), ("POST", "/workbench/api/batches"),
                             ("GET", "/workbench/api/batches/batch-x"), ("GET", "/workbench/"),
                             ("GET", f"/workbench/tests/{test_id}")]:
            refused = anon.request(method, path, json={})
            assert refused.status_code == 401, (method, path, refused.status_code)
            assert a.id not in refused.text and "Ann" not in refused.text
        for path in ("/workbench/", f"/workbench/tests/{test_id}"):  # the owner's pages, as a browser asks
            refused = anon.get(path, headers={"accept": "text/html"})
            if webui:
                assert refused.status_code == 303 and refused.headers["location"].endswith("studio/login")
            else:
                assert refused.status_code == 401

        # with the key they all answer
        results = owner.get(f"/workbench/api/tests/{test_id}/results").json()
        assert [(p["rater"], p["answered"]) for p in results["progress"]] == [("Ann", 1)]
        [row] = csv.DictReader(io.StringIO(owner.get(f"/workbench/api/tests/{test_id}/answers.csv").text))
        assert row["rater"] == "Ann" and row["answer"] == "A" and sorted(row["take_ids"].split(";")) == sorted(
            [a.id, b.id])
        assert test_id in [t["id"] for t in owner.get("/workbench/api/tests").json()["tests"]]
        assert {a.id, b.id} <= {t["id"] for t in owner.get("/workbench/api/takes").json()["takes"]}
        assert owner.get(f"/workbench/api/takes/{a.id}/audio").content[:4] == b"RIFF"
        for path in ("/workbench/", f"/workbench/tests/{test_id}"):
            assert "<script" in owner.get(path, headers={"accept": "text/html"}).text
