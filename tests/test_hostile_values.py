"""Hostile numbers on every API that takes them (issue 31): ``steps``, ``speed``, ``seed`` and the long-form
project's settings given as negative, huge, fractional, NaN, infinite, strings or booleans are each a 400 (a
WebSocket's error message and close 1008) naming the field, never a 500 and never a synthesis; the server answers
a normal request afterwards. A real REST server on loopback over the tiny bundle."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator

import httpx
import pytest
from test_rest import Server, _ws_url
from waiting import until

from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import ServerSettings, env_name
from cosyvoice.voices import VoiceLibrary

NAN, INF = float("nan"), float("inf")
STEPS = [-1, 0, 33, 10**12, "ten", 1.5, NAN, INF, [10]]  # (pydantic's bodies read JSON true as 1, as Python does)
SPEEDS = [-1, 0, 100, 1e308, "fast", NAN, INF, -INF, [1.0]]
SEEDS = [2**64, "x", 1.5, NAN, [1]]
DEEP_ROW = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"  # a JSONL line: no body bound sees inside a file


@pytest.fixture(scope="module")
def service(tts, prompt_wav, tmp_path_factory: pytest.TempPathFactory) -> TTSService:
    root = tmp_path_factory.mktemp("hostile-values")
    service = TTSService(tts.model, VoiceLibrary(root / "voices", tts.frontend, model_dir=tts.model_dir))
    service.create_voice("Narrator", prompt_wav.read_bytes(), "Hello there.")
    return service


@pytest.fixture(scope="module")
def url(service: TTSService) -> Iterator[str]:
    server = Server(create_app(ServerSettings(voice_dir=str(service.voices.dir)), service))
    yield server.url
    server.stop()


def _body(value: object) -> bytes:
    """JSON as Python writes it: NaN and Infinity as the bare words many clients send."""
    return json.dumps(value).encode()


def _refused(answer: httpx.Response, field: str) -> None:
    assert answer.status_code == 400, (answer.status_code, answer.text[:300])
    error = answer.json()["error"]
    assert error["field"] == field or field in error["message"], error


def _post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(path, content=_body(body), headers={"content-type": "application/json"})


def test_hostile_numbers_are_400s_naming_the_field(url: str, prompt_wav, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    speech = {"input": "Hi there.", "voice": "Narrator", "response_format": "wav"}
    bridge = {"text": "Hi there.", "prompt_text": "Hello there.",
              "prompt_audio": base64.b64encode(prompt_wav.read_bytes()).decode()}
    with httpx.Client(base_url=url, timeout=60) as client:
        for steps in STEPS:
            _refused(_post(client, "/v1/audio/speech", {**speech, "steps": steps}), "steps")
            _refused(_post(client, "/synthesize", {**bridge, "steps": steps}), "steps")
            _refused(_post(client, "/v1/longform/projects", {"text": "Hi.", "voice": "Narrator", "steps": steps}),
                     "steps")
        for speed in SPEEDS:
            _refused(_post(client, "/v1/audio/speech", {**speech, "speed": speed}), "speed")
        for seed in SEEDS:
            _refused(_post(client, "/v1/audio/speech", {**speech, "seed": seed}), "seed")
        projects = "/v1/longform/projects"
        for settings, field in (({"margin": NAN}, "margin"), ({"margin": -1}, "margin"), ({"retries": -1}, "retries"),
                                ({"retries": 10**9}, "retries"), ({"pauses": {"sentence": NAN}}, "pauses"),
                                ({"pauses": {"sentence": INF}}, "pauses"),
                                ({"pauses": {"evil": 1}}, "pauses"), ({"preset": "loud"}, "preset")):
            _refused(_post(client, projects, {"text": "Hi.", "voice": "Narrator", **settings}), field)
        _refused(_post(client, projects, {"text": "Hi.", "voice": "Narrator", "name": "n" * 1_000_000}),
                 "COSYVOICE_MAX_PROJECT_NAME_CHARS")
        made = client.post(projects, json={"text": "Hi there. Good day to you.", "voice": "Narrator"})
        assert made.status_code == 201, made.text
        project, segment = made.json()["id"], made.json()["segments"][0]
        where = f"{projects}/{project}/segments/{segment['id']}"
        for speed in SPEEDS:
            _refused(client.patch(where, content=_body({"speed": speed}),
                                  headers={"content-type": "application/json"}), "speed")
        for pause in (NAN, -1, INF, 10**9, "long"):
            _refused(client.patch(where, content=_body({"pause": pause}),
                                  headers={"content-type": "application/json"}), "pause")
        for at in (-1, 0, 10**12, NAN, 1.5, "three"):
            _refused(_post(client, f"{where}/split", {"at": at}), "at")
        for steps in STEPS:
            _refused(client.patch(f"{projects}/{project}", content=_body({"steps": steps}),
                                  headers={"content-type": "application/json"}), "steps")
        _refused(_post(client, f"{projects}/{project}/generate", {"segments": [segment["id"]] * 3}), "segments")
        _refused(client.patch(f"{projects}/{project}", json={"name": "n" * 201}), "name")
        assert client.get(f"{projects}/{project}").json()["segments"][0]["text"] == segment["text"]  # unchanged
        spoken = client.post("/v1/audio/speech", json={**speech, "steps": 2, "seed": 1})
        assert spoken.status_code == 200 and spoken.content[:4] == b"RIFF"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_websocket_start_with_hostile_numbers_is_an_error_naming_the_field(url: str) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    for field, values in (("steps", [*STEPS, True]), ("speed", [*SPEEDS, False]), ("seed", [*SEEDS, True])):
        for value in values:
            with connect(_ws_url(url)) as ws:
                ws.send(json.dumps({"type": "start", "voice": "Narrator", field: value}))
                error = json.loads(ws.recv(timeout=60))
                assert error["type"] == "error" and error["error"]["field"] == field, (value, error)
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=10)
                assert closed.value.rcvd.code == 1008


def test_a_batch_row_with_hostile_numbers_fails_naming_its_field(url: str) -> None:
    """A batch's rows are checked as they run (a bad row never stops the others): each hostile value fails its
    row with the field named, and nothing is made."""
    rows = [{"text": "Hi.", "voice": "Narrator", field: value}
            for field, values in (("steps", STEPS), ("speed", SPEEDS), ("seed", SEEDS)) for value in values]
    with httpx.Client(base_url=url, timeout=60) as client:
        started = _post(client, "/workbench/api/batches", {"rows": rows})
        assert started.status_code == 202, started.text
        where = f"/workbench/api/batches/{started.json()['id']}"
        status = until(lambda: (s := client.get(where).json())["state"] not in ("queued", "running") and s, 120,
                       "the batch's end")
    assert (status["done"], status["failed"]) == (0, len(rows)), status
    assert [e["field"] for e in sorted(status["errors"], key=lambda e: e["row"])] == [row_field(r) for r in rows]
    with httpx.Client(base_url=url, timeout=60) as client:
        deep = client.post("/workbench/api/batches", content=DEEP_ROW, headers={"content-type": "application/x-ndjson"})
    _refused(deep, "input")
    assert "line 1 nests JSON too deeply" in deep.json()["error"]["message"]


def row_field(row: dict) -> str:
    return next(k for k in ("steps", "speed", "seed", "first_hop") if k in row)


def test_grpc_hostile_numbers_are_invalid_argument_naming_the_field(service: TTSService) -> None:
    """The proto's types already refuse strings, lists and negative whole numbers on the wire; what they let
    through (NaN, infinities, zero, huge values, a word where a choice is named) is INVALID_ARGUMENT naming the
    field, and a message that is not a Request at all is INVALID_ARGUMENT too. The server answers afterwards."""
    import grpc

    from cosyvoice.server.grpc import GrpcServer, synthesis_request
    from cosyvoice.server.proto import cosyvoice_pb2 as pb
    from cosyvoice.server.proto import cosyvoice_pb2_grpc as pb_grpc

    server = GrpcServer("127.0.0.1", 0, max_streams=2)
    server.serve(service)
    payload = {"sft_request": pb.sftRequest(spk_id="Narrator", tts_text="Hi there.")}
    hostile = [("steps", v) for v in (0, 33, 2**32 - 1)] + [("speed", v) for v in (-1, 0, 100, NAN, INF, -INF)]
    hostile += [("first_hop", v) for v in (0, 26, 2**32 - 1)] + [("final", v) for v in ("half", "x" * 100_000)]
    hostile += [("seed", 2**63), ("seed", 2**64 - 1)]
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.CosyVoiceStub(channel)
            for field, value in hostile:
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.Inference(pb.Request(**payload, **{field: value}), timeout=60))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, value, refused.value)
                assert refused.value.details().startswith(f"{field}: "), (field, value, refused.value.details())
            garbage = channel.unary_stream("/cosyvoice.CosyVoice/Inference")
            with pytest.raises(grpc.RpcError) as refused:
                list(garbage(b"\xff\xff\xff\xff", timeout=60))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert synthesis_request(pb.Request(**payload, steps=2)).steps == 2  # the field reaches the service
            made = list(stub.Inference(pb.Request(**payload, steps=2, seed=1), timeout=120))
            assert sum(len(m.tts_audio) for m in made) > 0
    finally:
        server.stop(0)


def test_the_batch_cli_names_each_hostile_row_and_exits_2(tiny_bundle_dir, tmp_path) -> None:
    """The batch command line on a JSONL file of hostile numbers: every bad row is one line naming its number and
    field, the good row is made, exit 2; a bad precision (in a row, or the flag) is one line before any model."""
    import subprocess
    import sys

    hostile = [{"steps": v} for v in (-1, 0, 33, 10**12, "ten", 1.5, NAN, INF, [10], True)]
    hostile += [{"speed": v} for v in (-1, 100, "fast", NAN, INF)] + [{"seed": v} for v in (2**64, "x", NAN)]
    hostile += [{"first_hop": v} for v in (0, 26, NAN)]
    rows = [{"text": "Hi.", "voice": "en-allison", **row} for row in [*hostile, {"steps": 2, "seed": 1}]]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    (tmp_path / "precision.csv").write_text("text,voice,precision\nHi.,en-allison,NaN\n", encoding="utf-8")
    (tmp_path / "deep.jsonl").write_text(DEEP_ROW, encoding="utf-8")

    def batch(name: str, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cosyvoice.tools.batch", str(tmp_path / name), "--out",
                               str(tmp_path / "out"), "--model-dir", str(tiny_bundle_dir), "--data-dir",
                               str(tmp_path / "data"), "--voice-dir", str(tmp_path / "voices"), *flags],
                              capture_output=True, text=True, timeout=600)

    done = batch("rows.jsonl")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: row ")]
    assert errors == [f"error: row {i} ({row_field(row)}): {errors[i - 1].split(': ', 2)[2]}"
                      for i, row in enumerate(hostile, 1)], done.stderr[-3000:]
    assert "1 takes in" in done.stderr
    for flags, words in ((("precision.csv",), ("row 1: precision must be one of", "'NaN'")),
                         (("rows.jsonl", "--precision", "NaN"), ("argument --precision: invalid choice: 'NaN'",)),
                         (("deep.jsonl",), ("line 1 nests JSON too deeply",))):
        refused = batch(*flags)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert all(w in refused.stderr.strip().splitlines()[-1] for w in words), refused.stderr[-3000:]
        assert "loading the model" not in refused.stderr


def test_a_websocket_message_too_deep_or_of_millions_of_values_is_refused_before_it_is_parsed(url: str) -> None:
    """A frame is JSON as a body is, bounded the same way before ``json.loads`` recurses into it or builds its
    values: as the start message, or as a text message mid-stream."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    settings = ServerSettings()
    deep, many = "[" * 100_000, "[" + ",".join(["{}"] * 2_000_000) + "]"
    for start, frame, words in ((deep, None, f"deeper than {settings.max_json_depth}"),
                                (many, None, env_name("max_json_values")),
                                (None, many, env_name("max_json_values"))):
        with connect(_ws_url(url), max_size=None) as ws:
            if start is None:
                ws.send(json.dumps({"type": "start", "voice": "Narrator"}))
                assert json.loads(ws.recv(timeout=60))["type"] == "started"
            ws.send(start or frame)
            error = {"type": "audio"}
            while error["type"] == "audio":  # what was said before the frame may still come
                message = ws.recv(timeout=60)
                error = {"type": "audio"} if isinstance(message, bytes) else json.loads(message)
            assert error["type"] == "error" and words in error["error"]["message"], error
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd.code == 1008
    with connect(_ws_url(url)) as ws:
        ws.send(json.dumps({"type": "start", "voice": "Narrator", "steps": 2}))
        assert json.loads(ws.recv(timeout=60))["type"] == "started"
