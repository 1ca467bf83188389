"""Hostile inputs over real loopback HTTP (issue 20, defects 1, 4 and 6), on the REST server and on the web UI's
app (which mounts the same routers without the REST server's error handlers): every malformed body is a 400 that
names the problem, never a 500 with a traceback; the workbench's bounds come from :class:`Limits` and are named
in their errors; every CSV export neutralises cells a spreadsheet would run as a formula."""

from __future__ import annotations

import csv
import io
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_rest import Server

from cosyvoice.owners import ANONYMOUS
from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import CSV_FIELD_LIMIT, Limits, ServerSettings, default_data_dir
from cosyvoice.takes.export import write_csv
from cosyvoice.takes.store import TakeStore
from cosyvoice.voices import VoiceLibrary

LIMITS = Limits(max_sessions=2, queue_timeout_seconds=60, max_batch_rows=3, max_batch_field_chars=1000,
                max_test_title_chars=40, max_test_instructions_chars=300, max_test_items=5)
FORMULAS = ("=HYPERLINK(\"http://evil.example\",\"click\")", "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)",
            "\tindented", "\rreturn")


@pytest.fixture(scope="module", params=["rest", "webui"])
def served(request: pytest.FixtureRequest, tts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(url, data folder, which) of the REST server or the web UI, both with :data:`LIMITS`."""
    root = tmp_path_factory.mktemp(f"bounds-{request.param}")
    service = TTSService(tts.model, VoiceLibrary(root / "voices", tts.frontend, model_dir=tts.model_dir), LIMITS)
    if request.param == "rest":
        server = Server(create_app(ServerSettings(voice_dir=str(root / "voices")), service))
        yield server.url, default_data_dir(root / "voices"), request.param
        server.stop()
    else:
        pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
        from test_webui import serving, studio_over

        studio = studio_over(service)
        with serving(studio) as url:
            yield url.rstrip("/"), studio.context.data_dir, request.param


def _refused(answer: httpx.Response, *words: str) -> str:
    assert answer.status_code == 400, (answer.status_code, answer.text[:300])
    message = answer.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


def test_malformed_bodies_are_400s_naming_the_problem(served: tuple, caplog: pytest.LogCaptureFixture) -> None:
    url, _, which = served
    caplog.set_level(logging.ERROR)
    csv_body = {"headers": {"content-type": "text/csv"}}
    with httpx.Client(base_url=url, timeout=60) as client:
        batches = "/workbench/api/batches"
        _refused(client.post(batches, content="text,voice\ncafé,Narrator\n".encode("latin-1"), **csv_body),
                 "not UTF-8", "0xe9")
        _refused(client.post(batches, content=b'{"rows": [', headers={"content-type": "application/json"}),
                 "not JSON")
        _refused(client.post(batches, content=b"\xff\xfe{}", headers={"content-type": "application/json"}),
                 "not UTF-8")
        for length in (CSV_FIELD_LIMIT + 1, LIMITS.max_batch_field_chars + 1):  # beyond csv's own limit, and ours
            _refused(client.post(batches, content=f"text,voice\n{'a' * length},Narrator\n".encode(), **csv_body),
                     "row 1", f"longer than {LIMITS.max_batch_field_chars} characters",
                     "COSYVOICE_MAX_BATCH_FIELD_CHARS")
        _refused(client.post(batches, json={"rows": [{"text": "Hi.", "voice": "Narrator"}] * 4}),
                 "more than 3 rows", "COSYVOICE_MAX_BATCH_ROWS")
        _refused(client.post(batches, json={"rows": [{"text": "x" * 1001}]}), "row 1", "longer than 1000")
        _refused(client.post(batches, json={"rows": ["Hi."]}), "row 1 must be a JSON object")

        tests = "/workbench/api/tests"
        _refused(client.post(tests, content=b'{"kind": "ab", "title": "\xff"}',
                             headers={"content-type": "application/json"}), "not UTF-8")
        _refused(client.post(tests, content=b'{"kind": "ab", ', headers={"content-type": "application/json"}),
                 "not valid JSON")
        projects = "/v1/longform/projects"
        _refused(client.post(projects, content=b'{"text": ', headers={"content-type": "application/json"}),
                 "not valid JSON")
        _refused(client.post(projects, content=b'{"text": "caf\xe9"}', headers={"content-type": "application/json"}),
                 "not UTF-8", "0xe9")
        _refused(client.post(f"{projects}/upload", content=b"--x\r\nbroken", headers={
            "content-type": "multipart/form-data; boundary=x"}))
        if which == "rest":  # a server path where no folder is allowed: the answer names the setting that allows one
            _refused(client.post("/synthesize", json={"text": "Hi.", "prompt_audio": "/etc/hosts"}),
                     "COSYVOICE_ALLOWED_AUDIO_DIR", "--allowed-audio-dir")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_tests_title_instructions_and_items_are_bounded(served: tuple) -> None:
    url, data_dir, _ = served
    store = TakeStore(data_dir)
    a, b = (store.add_take(np.zeros(2400, np.float32), 24000, {"text": "one"}, label=label, owner=ANONYMOUS)
            for label in "AB")  # the keyless client's own takes (a private server: cosyvoice.owners)
    spec = {"kind": "ab", "items": [{"takes": [a.id, b.id]}]}
    with httpx.Client(base_url=url, timeout=60) as client:
        title = _refused(client.post("/workbench/api/tests", json={**spec, "title": "t" * 41}),
                         "at most 40", "COSYVOICE_MAX_TEST_TITLE_CHARS")
        assert "41 characters" in title
        huge = client.post("/workbench/api/tests", json={**spec, "instructions": "i" * 5_000_000})  # 5 MB
        assert _refused(huge, "at most 300", "COSYVOICE_MAX_TEST_INSTRUCTIONS_CHARS")
        assert huge.json()["error"]["field"] == "instructions"
        many = client.post("/workbench/api/tests", json={**spec, "items": spec["items"] * 6})
        assert _refused(many, "6 items; at most 5", "COSYVOICE_MAX_TEST_ITEMS") and many.json()["error"]["field"] \
            == "items"
        made = client.post("/workbench/api/tests", json={**spec, "title": "t" * 40, "instructions": "i" * 300})
        assert made.status_code == 201
        assert client.get(f"/workbench/api/tests/{made.json()['id']}").json()["title"] == "t" * 40


def test_every_csv_export_neutralises_formulas(served: tuple) -> None:
    url, data_dir, _ = served
    store = TakeStore(data_dir)
    tone = (0.2 * np.sin(np.arange(2400) / 5)).astype(np.float32)  # 0.1 s: listen-gating passes at once
    takes = [store.add_take(tone, 24000, {"text": formula, "seed": -7}, label=formula, owner=ANONYMOUS)
             for formula in FORMULAS[:2]]
    with httpx.Client(base_url=url, timeout=60) as client:
        rows = list(csv.DictReader(io.StringIO(client.get("/workbench/api/takes.csv").text)))
        mine = [r for r in rows if r["take_id"] in {t.id for t in takes}]
        assert [(r["label"], r["text"]) for r in mine] == [("'" + f, "'" + f) for f in FORMULAS[:2]]
        assert {r["seed"] for r in mine} == {"-7"}  # a number stays a number

        # a rater with only the link names themself as a formula; the owner's export must not run it
        test_id = client.post("/workbench/api/tests", json={"kind": "ab", "items": [
            {"takes": [t.id for t in takes]}]}).json()["id"]
        rater = client.post(f"/workbench/api/tests/{test_id}/raters", json={"name": "=1+1"}).json()["rater"]
        for slot in ("A", "B"):
            for event in ("play", "ended"):
                client.post(f"/workbench/api/raters/{rater}/events", json={"position": 0, "slot": slot,
                                                                            "event": event})
        assert client.post(f"/workbench/api/raters/{rater}/answers",
                           json={"position": 0, "answer": {"choice": "A"}}).status_code == 200
        [answer] = csv.DictReader(io.StringIO(client.get(f"/workbench/api/tests/{test_id}/answers.csv").text))
        assert answer["rater"] == "'=1+1" and answer["answer"] == "A"


def test_write_csv_neutralises_every_formula_start(tmp_path: Path) -> None:
    """The one writer every export uses (the batch CLI's takes.csv included: a path, not a StringIO)."""
    path = tmp_path / "takes.csv"
    write_csv(path, [{"cell": f, "n": -1.5} for f in FORMULAS] + [{"cell": "plain - text", "n": 2}], ["cell", "n"])
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["cell"] for r in rows] == ["'" + f for f in FORMULAS] + ["plain - text"]
    assert [r["n"] for r in rows] == ["-1.5"] * len(FORMULAS) + ["2"]


def test_the_batch_cli_says_in_one_line_that_a_file_is_not_utf8(tmp_path: Path) -> None:
    rows = tmp_path / "rows.csv"
    rows.write_bytes("text,voice\nGrüße,Narrator\n".encode("cp1252"))
    proc = subprocess.run([sys.executable, "-m", "cosyvoice.tools.batch", str(rows), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr  # a bad input, as every command line says it
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert "is not UTF-8 text" in proc.stderr and "0xfc" in proc.stderr
