"""Who owns what (cosyvoice/owners.py), over real servers on loopback with the tiny bundle: a key never reaches
another key's long-form projects, tests, answers or takes; without keys a visitor is its browser and sees only
its own work; a rater's name never resumes a rater."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_rest import Server
from waiting import until

from cosyvoice.errors import ConfigError
from cosyvoice.owners import ANONYMOUS, Owners, key_owner
from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings, default_data_dir
from cosyvoice.takes.store import TakeStore
from cosyvoice.voices import VoiceLibrary

ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"
ANN, BEN = "a" * 32, "b" * 32  # two browsers' cv-browser ids
TONE = (0.2 * np.sin(np.arange(2400) / 5)).astype(np.float32)  # 0.1 s: listen-gating passes at once


@pytest.fixture(scope="module")
def service(tts, tmp_path_factory: pytest.TempPathFactory, short_prompt_wav: Path) -> TTSService:
    root = tmp_path_factory.mktemp("owners")
    svc = TTSService(tts.model, VoiceLibrary(root / "voices", tts.frontend, model_dir=tts.model_dir),
                     Limits(max_sessions=2, queue_timeout_seconds=60))
    svc.create_voice("Narrator", short_prompt_wav.read_bytes(), "A short test prompt.")
    return svc


@pytest.fixture()
def served(service: TTSService, tmp_path: Path) -> Iterator:
    """``serve(**settings)`` -> the URL of a REST server on loopback; every server shares one data folder."""
    servers = []

    def serve(**settings: object) -> str:
        servers.append(Server(create_app(ServerSettings(voice_dir=str(tmp_path / "voices"), **settings), service)))
        return servers[-1].url

    yield serve
    for server in servers:
        server.stop()


def store_of(tmp_path: Path) -> TakeStore:
    return TakeStore(default_data_dir(tmp_path / "voices"))


def client(url: str, key: str | None = None, browser: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"} if key else {},
                        cookies={"cv-browser": browser} if browser else {})


def answer_as_rater(rater_client: httpx.Client, rater: str) -> None:
    for slot in ("A", "B"):
        for event in ("play", "ended"):
            rater_client.post(f"/workbench/api/raters/{rater}/events", json={"position": 0, "slot": slot,
                                                                            "event": event})
    done = rater_client.post(f"/workbench/api/raters/{rater}/answers", json={"position": 0, "answer": {"choice": "A"}})
    assert done.status_code == 200, done.text


def test_who_a_caller_is() -> None:
    keyed = Owners((ALICE,), (ADMIN,))
    assert keyed.identify(f"Bearer {ALICE}").owner == key_owner(ALICE)
    assert keyed.identify(f"bearer  {ADMIN} ").admin and not keyed.identify(f"Bearer {ALICE}").admin
    for refused in ("", f"Basic {ALICE}", "Bearer wrong", "Bearer "):
        assert keyed.identify(refused, {"cv-browser": ANN}) is None  # a browser id is no key
    assert keyed.identify(cookies={"cosyvoice-session": keyed.sign_in(ALICE)}).owner == key_owner(ALICE)
    keyless = Owners()
    assert keyless.identify(f"Bearer {ALICE}", {"cv-browser": ANN}).owner == f"browser:{ANN}"  # keys mean nothing
    assert keyless.identify(cookies={"cv-browser": "not-an-id"}, session="p1").owner == "session:p1"
    assert keyless.identify().owner == ANONYMOUS
    private, team = keyless.identify(cookies={"cv-browser": ANN}), Owners(sharing="team").identify()
    assert private.sees(f"browser:{ANN}") and not private.sees(f"browser:{BEN}") and not private.sees(None)
    assert team.sees(f"browser:{BEN}") and team.sees(None) and not team.owns(f"browser:{BEN}")
    with pytest.raises(ConfigError, match="sharing must be one of auto, private, team"):
        ServerSettings(sharing="public")
    assert ServerSettings.from_env({"COSYVOICE_SHARING": "team"}).owners().sharing == "team"


def test_auto_sharing_shows_a_laptops_own_work_to_its_browsers_and_a_public_servers_to_nobody(tmp_path: Path) -> None:
    """README step 1: on a keyless server bound to loopback, the batch CLI's takes (and a keyless curl's) are the
    visitor's too; browsers stay apart; a server others reach (a Space on 0.0.0.0), one with keys, or an explicit
    ``private`` shows them to no visitor."""
    store = TakeStore(tmp_path)
    cli, curl, ben = (store.add_take(TONE, 24000, {"text": owner or "cli"}, label="x", owner=owner)
                      for owner in (None, ANONYMOUS, f"browser:{BEN}"))
    assert ServerSettings().owners().local and not ServerSettings(host="0.0.0.0").owners().local
    assert not ServerSettings().owners(host="0.0.0.0").local and ServerSettings(host="0.0.0.0").owners("::1").local
    ann = ServerSettings().owners().identify(cookies={"cv-browser": ANN})
    assert ann.sees(None) and ann.sees(ANONYMOUS) and ann.owns(None) and not ann.sees(f"browser:{BEN}")
    assert {t.id for t in store.visible_takes(ann)} == {cli.id, curl.id}
    assert store.take_page(ann)[1] == 2 and store.take_labels(ann) == ["x"]
    assert store.visible_takes(ann, mine=True) == []  # the studio's "This browser" stays the browser's
    assert [t.id for t in store.visible_takes(ServerSettings().owners().identify())] == [cli.id, curl.id]
    for public in (ServerSettings(host="0.0.0.0"), ServerSettings(sharing="private"),
                   ServerSettings(host="localhost", api_keys=(ALICE,))):
        owners = public.owners()
        visitor = owners.identify(f"Bearer {ALICE}" if owners.keyed else "", {"cv-browser": ANN})
        assert not visitor.sees(None) and store.visible_takes(visitor) == [] and store.take_page(visitor)[1] == 0
    assert {t.id for t in store.visible_takes(Owners(sharing="team").identify())} == {cli.id, curl.id, ben.id}


def test_no_key_reaches_another_keys_projects_tests_answers_or_takes(served, tmp_path: Path) -> None:
    url = served(api_keys=(ALICE, BOB), admin_keys=(ADMIN,))
    store = store_of(tmp_path)
    a, b = (store.add_take(TONE, 24000, {"text": f"Alice's line {n}"}, label=f"sys{n}", owner=key_owner(ALICE))
            for n in "AB")
    with client(url, ALICE) as alice, client(url, BOB) as bob, client(url, ADMIN) as admin, client(url) as rater:
        made = alice.post("/v1/longform/projects", json={"name": "Alice's book", "text": "Hi there.",
                                                         "voice": "Narrator"})
        assert made.status_code == 201, made.text
        pid, segment = made.json()["id"], made.json()["segments"][0]["id"]
        test_id = alice.post("/workbench/api/tests", json={"kind": "ab", "title": "Alice's test",
                                                           "items": [{"takes": [a.id, b.id]}]}).json()["id"]
        joined = rater.post(f"/workbench/api/tests/{test_id}/raters", json={"name": "Ann"}).json()
        answer_as_rater(rater, joined["rater"])
        batch = alice.post("/workbench/api/batches", json={"rows": [{"text": "Hi.", "voice": "Narrator"}]}).json()

        _none_of_alices_reaches(bob, pid, segment, test_id, a.id, b.id, batch["id"])

        # Alice has all of it, untouched; an admin key sees everything
        assert alice.get(f"/v1/longform/projects/{pid}").json()["name"] == "Alice's book"
        assert [t["id"] for t in alice.get("/workbench/api/tests").json()["tests"]] == [test_id]
        for who in (alice, admin):
            assert pid in [p["id"] for p in who.get("/v1/longform/projects").json()]
            [row] = csv.DictReader(io.StringIO(who.get(f"/workbench/api/tests/{test_id}/answers.csv").text))
            assert row["rater"] == "Ann"
            assert who.get(f"/workbench/api/takes/{a.id}/audio").content[:4] == b"RIFF"
        until(lambda: alice.get(f"/workbench/api/batches/{batch['id']}").json()["state"] != "running", 300,
              "the batch's end")

    # a team server on the same folder: every key sees (and uses) every project; deleting stays the owner's
    team = served(api_keys=(ALICE, BOB), sharing="team")
    with client(team, BOB) as bob:
        assert pid in [p["id"] for p in bob.get("/v1/longform/projects").json()]
        assert bob.get(f"/workbench/api/tests/{test_id}/results").status_code == 200
        assert bob.delete(f"/v1/longform/projects/{pid}").status_code == 403


def _none_of_alices_reaches(bob, pid: str, segment: str, test_id: str, a: str, b: str, batch: str) -> None:
    """Bob: lists without Alice's project, test, takes and batch, and every one of them is "not found", as if it
    did not exist (nor does any answer name Alice or her rater); he cannot build a test from her takes either."""
    assert bob.get("/v1/longform/projects").json() == []
    assert bob.get("/workbench/api/tests").json()["tests"] == []
    assert bob.get("/workbench/api/takes").json()["takes"] == []
    assert "Alice's line" not in bob.get("/workbench/api/takes.csv").text
    for method, path, body in [
            ("GET", f"/v1/longform/projects/{pid}", None), ("PATCH", f"/v1/longform/projects/{pid}",
                                                            {"name": "Bob's now"}),
            ("PATCH", f"/v1/longform/projects/{pid}/segments/{segment}", {"text": "Mine."}),
            ("POST", f"/v1/longform/projects/{pid}/generate", {}),
            ("GET", f"/v1/longform/projects/{pid}/progress", None),
            ("GET", f"/v1/longform/projects/{pid}/export", None),
            ("POST", f"/v1/longform/projects/{pid}/exports", {}),
            ("GET", f"/v1/longform/projects/{pid}/exports", None),
            ("GET", f"/v1/longform/projects/{pid}/exports/job-1/file", None),
            ("GET", f"/v1/longform/projects/{pid}/subtitles.srt", None),
            ("GET", f"/v1/longform/projects/{pid}/segments.json", None),
            ("DELETE", f"/v1/longform/projects/{pid}", None),
            ("GET", f"/workbench/api/tests/{test_id}/results", None),
            ("GET", f"/workbench/api/tests/{test_id}/answers.csv", None),
            ("GET", f"/workbench/api/tests/{test_id}/scorecard", None),
            ("DELETE", f"/workbench/api/tests/{test_id}", None),
            ("GET", f"/workbench/api/takes/{a}/audio", None), ("DELETE", f"/workbench/api/takes/{a}", None),
            ("GET", f"/workbench/api/batches/{batch}", None)]:
        refused = bob.request(method, path, json=body)
        assert refused.status_code == 404, (method, path, refused.status_code, refused.text)
        assert "Alice" not in refused.text and "Ann" not in refused.text
    stolen = bob.post("/workbench/api/tests", json={"kind": "ab", "items": [{"takes": [a, b]}]})
    assert stolen.status_code == 400 and f"no take {a!r}" in stolen.json()["error"]["message"]


def test_a_raters_name_never_resumes_that_rater(served, tmp_path: Path) -> None:
    url = served(api_keys=(ALICE,))
    store = store_of(tmp_path)
    a, b = (store.add_take(TONE, 24000, {"text": "one"}, label=n, owner=key_owner(ALICE)) for n in "AB")
    with client(url, ALICE) as alice, client(url) as ann, client(url) as impostor:
        test_id = alice.post("/workbench/api/tests", json={"kind": "ab", "items": [{"takes": [a.id, b.id]}]}
                             ).json()["id"]
        rater = ann.post(f"/workbench/api/tests/{test_id}/raters", json={"name": "Ann"}).json()["rater"]
        taken = impostor.post(f"/workbench/api/tests/{test_id}/raters", json={"name": " Ann "})
        assert taken.status_code == 409 and taken.json()["error"]["field"] == "name"
        assert rater not in taken.text and "personal link" in taken.json()["error"]["message"]
        # Ann's own id (kept in her browser, and her personal link) goes on where she was
        answer_as_rater(ann, rater)
        assert ann.get(f"/workbench/api/raters/{rater}/next").json()["done"] is True
        assert impostor.post(f"/workbench/api/tests/{test_id}/raters", json={"name": "Ben"}).status_code == 200


def test_without_keys_a_visitor_sees_and_deletes_only_its_own(served, tmp_path: Path,
                                                               short_prompt_wav: Path) -> None:
    url = served()
    store = store_of(tmp_path)
    take = store.add_take(TONE, 24000, {"text": "Ann's secret words"}, label="sysA", owner=f"browser:{ANN}")
    other = store.add_take(TONE, 24000, {"text": "Ann's other words"}, label="sysB", owner=f"browser:{ANN}")
    with client(url, browser=ANN) as ann, client(url, browser=BEN) as ben, client(url) as anonymous:
        assert {t["id"] for t in ann.get("/workbench/api/takes").json()["takes"]} == {take.id, other.id}
        assert "Ann's secret words" in ann.get("/workbench/api/takes.csv").text
        for visitor in (ben, anonymous):  # "All takes", the audio and takes.csv: nothing of Ann's
            assert visitor.get("/workbench/api/takes").json()["takes"] == []
            assert visitor.get(f"/workbench/api/takes/{take.id}/audio").status_code == 404
            assert "Ann's secret words" not in visitor.get("/workbench/api/takes.csv").text

        # saved voices: everyone may speak with them, only their creator may delete them (and rename: the web UI)
        saved = ann.post("/v1/voices", data={"name": "Ann's voice", "transcript": "Ann reads this aloud."},
                         files={"audio": ("ann.wav", short_prompt_wav.read_bytes(), "audio/wav")})
        assert saved.status_code == 201, saved.text
        assert "Ann's voice" in [v["name"] for v in ben.get("/v1/voices").json()["data"]]
        refused = ben.delete("/v1/voices/Ann's voice")
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_denied"
        assert "Ann's voice" in [v["name"] for v in ann.get("/v1/voices").json()["data"]]

        # deleting: a take a test uses is refused with the reason; tests and takes go, by their owner only
        made = ann.post("/workbench/api/tests", json={"kind": "ab", "title": "Ann's AB",
                                                      "items": [{"takes": [take.id, other.id]}]})
        assert made.status_code == 201, made.text
        test_id = made.json()["id"]
        used = ann.delete(f"/workbench/api/takes/{take.id}")
        assert used.status_code == 409 and "Ann's AB" in used.json()["error"]["message"]
        assert ben.delete(f"/workbench/api/tests/{test_id}").status_code == 404
        assert ann.delete(f"/workbench/api/tests/{test_id}").json() == {"deleted": test_id}
        assert ann.get(f"/workbench/api/tests/{test_id}/results").status_code == 404
        assert ben.delete(f"/workbench/api/takes/{take.id}").status_code == 404
        assert ann.delete(f"/workbench/api/takes/{take.id}").json() == {"deleted": take.id}
        assert not store.audio_path(take).exists()
        assert [t["id"] for t in ann.get("/workbench/api/takes").json()["takes"]] == [other.id]
        assert ann.delete("/v1/voices/Ann's voice").status_code == 200


def test_a_database_from_before_owners_opens_and_its_rows_are_the_local_owners(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / "workbench.sqlite3")
    db.executescript("CREATE TABLE tests (id TEXT PRIMARY KEY, created REAL NOT NULL, kind TEXT NOT NULL, "
                     "title TEXT NOT NULL, instructions TEXT NOT NULL, spec TEXT NOT NULL);"
                     "INSERT INTO tests VALUES ('test-old', 1.0, 'ab', 'Old', '', '{\"items\": []}');")
    db.close()
    store = TakeStore(tmp_path)
    assert store.test("test-old")["owner"] is None  # the local owner's: the CLIs and admins see it
    visitor = Owners().identify(cookies={"cv-browser": ANN})
    assert store.tests(visitor) == [] and store.tests(Owners(sharing="team").identify()) != []


def test_without_keys_a_browser_may_not_rename_or_delete_anothers_saved_voice(tts, tmp_path: Path,
                                                                               short_prompt_wav: Path) -> None:
    gr = pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
    from test_webui import TRANSCRIPT, make_studio

    studio = make_studio(tts, tmp_path)  # the library's default rule: a saved voice is its creator's to change

    def page(browser: str, load: str) -> gr.Request:  # one page load of one browser, as Gradio hands it over
        return gr.Request(session_hash=load, headers={"accept-language": "en-US"}, cookies={"cv-browser": browser})

    saved = studio.save_voice("Ann's voice", str(short_prompt_wav), TRANSCRIPT, page(ANN, "ann-1"))["value"]
    with pytest.warns(UserWarning, match="Not allowed") as warned:
        assert studio.rename_voice(saved, "Ben's now", page(BEN, "ben-1")) == gr.skip()
        studio.delete_voice(saved, page(BEN, "ben-1"))
    assert len(warned) == 2
    # Ann, in a later page load of the same browser, still may
    assert "Ann's own" in [label for label, _ in studio.rename_voice(saved, "Ann's own", page(ANN, "ann-2"))["choices"]]
