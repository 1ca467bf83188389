"""The REST server over real loopback HTTP (uvicorn in a thread, httpx clients), on the tiny bundle."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import uvicorn

from cosyvoice.encoding import FORMATS
from cosyvoice.server.rest import create_app
from cosyvoice.service import Outcome, TTSService
from cosyvoice.settings import Limits, ServerSettings
from cosyvoice.voices import VoiceLibrary
from tests.test_encoding import SLACK, _decode

TEXT = "Hello there, my friend."
TRANSCRIPT = "Hello, this is a short prompt for testing."
SR = 24000


class Server:
    """A uvicorn server on a free loopback port, in a thread."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def library(tts, tmp_path_factory: pytest.TempPathFactory) -> VoiceLibrary:
    return VoiceLibrary(tmp_path_factory.mktemp("voices"), tts.frontend, model_dir=tts.model_dir)


@pytest.fixture(scope="module")
def service(tts, library: VoiceLibrary) -> TTSService:
    return TTSService(tts.model, library, Limits(max_sessions=4, max_queued_requests=4, queue_timeout_seconds=60))


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory: pytest.TempPathFactory, short_prompt_wav: Path) -> Path:
    folder = tmp_path_factory.mktemp("allowed")
    (folder / "prompt.wav").write_bytes(short_prompt_wav.read_bytes())
    return folder


@pytest.fixture(scope="module")
def url(service: TTSService, audio_dir: Path) -> Iterator[str]:
    server = Server(create_app(ServerSettings(allowed_audio_dir=str(audio_dir)), service))
    yield server.url
    server.stop()


@pytest.fixture()
def outcomes(service: TTSService) -> Iterator[list[tuple[float, Outcome]]]:
    """(time reported, outcome) of every request during a test."""
    seen: list[tuple[float, Outcome]] = []

    def listen(outcome: Outcome) -> None:
        seen.append((time.perf_counter(), outcome))

    service.add_listener(listen)
    yield seen
    service._listeners.remove(listen)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _error(response: httpx.Response, status: int, field: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["param"] == field, error
    assert "Traceback" not in response.text
    return error["message"]


@pytest.fixture(scope="module")
def saved_voice(url: str, short_prompt_wav: Path) -> dict:
    """A voice registered through /v1/voices (multipart: name, transcript, audio)."""
    response = httpx.post(f"{url}/v1/voices", data={"name": "Ada", "transcript": TRANSCRIPT},
                          files={"audio": ("ada.wav", short_prompt_wav.read_bytes(), "audio/wav")}, timeout=60)
    assert response.status_code == 201, response.text
    return response.json()


# ----------------------------------------------------------------------------- the official client's shapes


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_official_zero_shot_streams_pcm_before_generation_ends(url: str, short_prompt_wav: Path, method: str,
                                                               outcomes: list) -> None:
    """The official client: form fields + a file named prompt_wav, GET (as client.py) or POST, streamed."""
    files = [("prompt_wav", ("prompt_wav", short_prompt_wav.read_bytes(), "application/octet-stream"))]
    data = {"tts_text": TEXT * 2, "prompt_text": TRANSCRIPT}
    first_bytes = None
    body = b""
    with httpx.Client(timeout=120) as client, \
            client.stream(method, f"{url}/inference_zero_shot", data=data, files=files) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            first_bytes = first_bytes or time.perf_counter()
            body += piece
    _wait_for(lambda: outcomes)
    finished, outcome = outcomes[-1]
    assert outcome.reason is None and outcome.mode == "zero_shot"
    assert first_bytes < finished, "the first PCM bytes must arrive before the generation ends"
    assert len(body) == 2 * round(outcome.audio_seconds * SR)  # PCM16 mono: all the engine's samples
    pcm = np.frombuffer(body, "<i2")
    assert pcm.size > 0 and np.abs(pcm).max() > 0


def test_official_cross_lingual_and_instruct2(url: str, short_prompt_wav: Path, outcomes: list) -> None:
    files = {"prompt_wav": ("prompt_wav", short_prompt_wav.read_bytes(), "application/octet-stream")}
    a = httpx.post(f"{url}/inference_cross_lingual", data={"tts_text": TEXT}, files=files, timeout=120)
    b = httpx.request("GET", f"{url}/inference_instruct2", data={"tts_text": TEXT, "instruct_text": "Speak slowly."},
                      files=files, timeout=120)
    assert a.status_code == b.status_code == 200
    assert [o.mode for _, o in outcomes] == ["cross_lingual", "instruct"]
    assert [len(r.content) for r in (a, b)] == [2 * round(o.audio_seconds * SR) for _, o in outcomes]


def test_official_sft_and_instruct_speak_a_saved_voice(url: str, saved_voice: dict, outcomes: list) -> None:
    sft = httpx.request("GET", f"{url}/inference_sft", data={"tts_text": TEXT, "spk_id": "Ada"}, timeout=120)
    instruct = httpx.post(f"{url}/inference_instruct",
                          data={"tts_text": TEXT, "spk_id": saved_voice["id"], "instruct_text": "Speak happily."},
                          timeout=120)
    assert sft.status_code == instruct.status_code == 200 and len(sft.content) > 0 and len(instruct.content) > 0
    _error(httpx.post(f"{url}/inference_sft", data={"tts_text": TEXT, "spk_id": "nobody"}), 404, "spk_id")
    assert [o.reason for _, o in outcomes] == [None, None, "not_found"]


def test_official_bad_input_names_the_wire_field(url: str, short_prompt_wav: Path) -> None:
    files = {"prompt_wav": ("prompt_wav", short_prompt_wav.read_bytes(), "application/octet-stream")}
    _error(httpx.post(f"{url}/inference_zero_shot", data={"prompt_text": TRANSCRIPT}, files=files), 400, "tts_text")
    _error(httpx.post(f"{url}/inference_zero_shot", data={"tts_text": " ", "prompt_text": TRANSCRIPT}, files=files),
           400, "tts_text")
    _error(httpx.post(f"{url}/inference_zero_shot", data={"tts_text": TEXT, "prompt_text": TRANSCRIPT},
                      files={"prompt_wav": ("x", b"garbage" * 100, "application/octet-stream")}), 400, "prompt_wav")
    _error(httpx.post(f"{url}/inference_instruct2", data={"tts_text": TEXT, "instruct_text": ""}, files=files),
           400, "instruct_text")


# ----------------------------------------------------------------------------- bridge contract


def test_bridge_synthesize_returns_a_wav_with_its_duration(url: str, short_prompt_wav: Path, outcomes: list) -> None:
    encoded = base64.b64encode(short_prompt_wav.read_bytes()).decode()
    for body, mode in (
        ({"text": TEXT, "prompt_audio": encoded, "prompt_text": TRANSCRIPT, "seed": 1}, "zero_shot"),
        ({"text": TEXT, "prompt_audio": "prompt.wav", "speed": 1.5}, "instruct"),  # no prompt_text: instruct
        ({"text": TEXT, "prompt_audio": f"data:audio/wav;base64,{encoded}", "instruct": "Whisper."}, "instruct"),
    ):
        response = httpx.post(f"{url}/synthesize", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "audio/wav"
        wav, rate = sf.read(io.BytesIO(response.content))
        assert rate == SR and wav.size > 0
        assert float(response.headers["X-Audio-Duration"]) == pytest.approx(wav.size / rate, abs=1e-3)
        assert outcomes[-1][1].mode == mode
    _error(httpx.post(f"{url}/synthesize", json={"text": TEXT, "prompt_audio": "../etc/passwd"}), 400, "prompt_audio")
    _error(httpx.post(f"{url}/synthesize", json={"text": TEXT, "prompt_audio": encoded, "speed": 7}), 400, "speed")
    _error(httpx.post(f"{url}/synthesize", json={"prompt_audio": encoded}), 400, "text")


def test_speakers_lists_saved_voices(url: str, saved_voice: dict) -> None:
    speakers = httpx.get(f"{url}/speakers").json()["speakers"]
    assert {"id": saved_voice["id"], "name": "Ada"}.items() <= speakers[0].items()


# ----------------------------------------------------------------------------- OpenAI speech and voices


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_openai_speech_every_format_decodes(url: str, saved_voice: dict, fmt: str, outcomes: list) -> None:
    voice = saved_voice["id"] if fmt in ("mp3", "wav") else {"id": "Ada"} if fmt == "aac" else "Ada"
    body = {"model": "tts-1", "input": TEXT, "voice": voice, "response_format": fmt}
    response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(FORMATS[fmt].content_type)
    decoded, rate = _decode(response.content, fmt)
    expected = outcomes[-1][1].audio_seconds
    assert expected > 0 and abs(decoded.size / rate - expected) <= SLACK[fmt] / SR + 1e-9


def test_openai_instructions_sse_and_errors(url: str, saved_voice: dict, outcomes: list) -> None:
    body = {"model": "x", "input": TEXT, "voice": "Ada", "instructions": "Speak slowly.", "response_format": "pcm",
            "stream_format": "sse"}
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    import json

    parsed = [json.loads(e[6:]) for e in events]
    assert parsed[-1]["type"] == "speech.audio.done" and all(p["type"] == "speech.audio.delta" for p in parsed[:-1])
    pcm = b"".join(base64.b64decode(p["audio"]) for p in parsed[:-1])
    assert outcomes[-1][1].mode == "instruct" and len(pcm) == 2 * round(outcomes[-1][1].audio_seconds * SR)
    _error(httpx.post(f"{url}/v1/audio/speech", json={**body, "response_format": "ogg"}), 400, "response_format")
    _error(httpx.post(f"{url}/v1/audio/speech", json={**body, "input": ""}), 400, "input")
    _error(httpx.post(f"{url}/v1/audio/speech", json={**body, "voice": "nobody"}), 404, "voice")
    _error(httpx.post(f"{url}/v1/audio/speech", json={"input": TEXT}), 400, "voice")
    _error(httpx.post(f"{url}/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"}),
           400, None)


def test_voice_management(url: str, short_prompt_wav: Path, saved_voice: dict) -> None:
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["object"] == "model"
    names = [v["name"] for v in httpx.get(f"{url}/v1/voices").json()["data"]]
    assert "Ada" in names
    assert httpx.get(f"{url}/v1/voices/Ada").json()["id"] == saved_voice["id"]
    files = {"audio": ("b.wav", short_prompt_wav.read_bytes(), "audio/wav")}
    _error(httpx.post(f"{url}/v1/voices", data={"name": "Ada"}, files=files), 409, "name")
    _error(httpx.post(f"{url}/v1/voices", data={"name": "Bad"}, files={"audio": ("b.wav", b"xx", "audio/wav")}),
           400, "audio")
    created = httpx.post(f"{url}/v1/voices", data={"name": "Cy"}, files=files, timeout=60)  # no transcript
    assert created.status_code == 201 and created.json()["transcript"] == ""
    deleted = httpx.delete(f"{url}/v1/voices/{created.json()['id']}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    _error(httpx.delete(f"{url}/v1/voices/Cy"), 404, "voice")
    _error(httpx.get(f"{url}/v1/voices/Cy"), 404, "voice")


# ----------------------------------------------------------------------------- metrics, probes


def _metric(url: str, sample: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_move_on_success_and_failure(url: str, saved_voice: dict) -> None:
    ok, total = 'tts_requests_success_total{mode="sft"}', 'tts_requests_total{mode="sft"}'
    bad = 'tts_requests_error_total{mode="sft",reason="invalid_input"}'
    before = [_metric(url, s) for s in (ok, total, bad)]
    assert httpx.post(f"{url}/inference_sft", data={"tts_text": TEXT, "spk_id": "Ada"}, timeout=120).status_code == 200
    assert httpx.post(f"{url}/inference_sft", data={"tts_text": "", "spk_id": "Ada"}).status_code == 400
    assert httpx.post(f"{url}/inference_sft", data={"spk_id": "Ada"}).status_code == 400  # before the service
    after = [_metric(url, s) for s in (ok, total, bad)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 3, 2]
    text = httpx.get(f"{url}/metrics").text
    for family in ("tts_synthesis_duration_seconds_count", "tts_rtf_count", "tts_first_chunk_seconds_count",
                   "tts_active_sessions", "tts_queue_depth"):
        assert family in text


def test_health_and_ready(url: str) -> None:
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{url}/ready").json()
    assert ready["status"] == "ready" and ready["sample_rate"] == SR


def test_ready_only_once_the_model_is_loaded(service: TTSService) -> None:
    release = threading.Event()

    def loader() -> TTSService:
        release.wait(30)
        return service

    server = Server(create_app(ServerSettings(), loader=loader))
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/ready").json()["status"] == "loading"
        loading = httpx.post(f"{server.url}/v1/audio/speech", json={"input": TEXT, "voice": "Ada"})
        assert loading.status_code == 503 and loading.headers["Retry-After"] == "5"
        release.set()
        _wait_for(lambda: httpx.get(f"{server.url}/ready").status_code == 200)
    finally:
        release.set()
        server.stop()


# ----------------------------------------------------------------------------- limits, keys, CORS, cancellation


def test_busy_is_503_with_retry_after_and_disconnect_cancels(tts, library: VoiceLibrary, saved_voice: dict) -> None:
    service = TTSService(tts.model, library, Limits(max_sessions=1, max_queued_requests=0))
    seen: list[Outcome] = []
    service.add_listener(seen.append)
    server = Server(create_app(ServerSettings(retry_after_seconds=7), service))
    try:
        body = {"input": TEXT * 4, "voice": "Ada", "response_format": "pcm"}
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", f"{server.url}/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            # audio is flowing: the one slot is taken. The iterator is kept: a dropped one is closed whenever the
            # garbage collector gets to it, and closing it hangs up the connection (the server then cancels)
            audio = response.iter_raw()
            next(audio)
            busy = httpx.post(f"{server.url}/v1/audio/speech", json=body)
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "7", (busy.status_code, seen)
            assert busy.json()["error"]["type"] == "busy"
        # leaving the block closed the connection mid-stream: the session must end, not run to completion
        _wait_for(lambda: service.status().active_sessions == 0, timeout=20)
        assert [o.reason for o in seen] == ["busy", "cancelled"]
    finally:
        server.stop()


def test_api_keys_cors_and_body_limit(service: TTSService, short_prompt_wav: Path) -> None:
    closed = Server(create_app(ServerSettings(), service))
    keyed = Server(create_app(ServerSettings(api_keys=("s3cret",), cors_origins=("https://app.example",),
                                             max_body_bytes=20_000), service))
    try:
        preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
        assert "access-control-allow-origin" not in httpx.options(f"{closed.url}/v1/voices", headers=preflight).headers
        assert "access-control-allow-origin" not in httpx.get(f"{closed.url}/v1/voices",
                                                              headers={"Origin": "https://a.example"}).headers
        assert httpx.get(f"{keyed.url}/health").status_code == 200  # probes stay open
        _error(httpx.get(f"{keyed.url}/v1/voices"), 401)
        _error(httpx.get(f"{keyed.url}/v1/voices", headers={"Authorization": "Bearer wrong"}), 401)
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{keyed.url}/v1/voices", headers=auth).status_code == 200
        allowed = httpx.get(f"{keyed.url}/v1/voices", headers={**auth, "Origin": "https://app.example"})
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        files = {"audio": ("a.wav", short_prompt_wav.read_bytes(), "audio/wav")}  # ~38 KB > 20 KB
        _error(httpx.post(f"{keyed.url}/v1/voices", data={"name": "Big"}, files=files, headers=auth), 413)

        def chunked() -> Iterator[bytes]:  # no Content-Length: the bound holds while reading
            for _ in range(100):
                yield b"x" * 1000

        _error(httpx.post(f"{keyed.url}/synthesize", content=chunked(),
                          headers={**auth, "content-type": "application/json"}), 413)
    finally:
        closed.stop()
        keyed.stop()


# ----------------------------------------------------------------------------- WebSocket


def _ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/audio/stream"


def test_websocket_speaks_before_the_last_piece_is_sent(url: str, saved_voice: dict) -> None:
    import json

    from websockets.sync.client import connect

    with connect(_ws_url(url), open_timeout=30) as ws:
        ws.send(json.dumps({"type": "start", "voice": "Ada", "seed": 3}))
        started = json.loads(ws.recv(timeout=60))
        assert started["type"] == "started" and started["sample_rate"] == SR and started["format"] == "pcm"
        ws.send(json.dumps({"type": "text", "text": "Hello there, my friend. How"}))
        ws.send(json.dumps({"type": "text", "text": " are you? "}))
        meta = json.loads(ws.recv(timeout=120))  # audio of the first sentence, before the last piece is sent
        assert meta["type"] == "audio" and meta["chunk"]["index"] == 0 and meta["chunk"]["sample_offset"] == 0
        received = [ws.recv(timeout=60)]
        assert len(received[0]) == meta["bytes"] == 2 * meta["chunk"]["samples"]
        ws.send(json.dumps({"type": "text", "text": "Goodbye."}))
        ws.send(json.dumps({"type": "end"}))
        metas = [meta]
        while True:
            message = json.loads(ws.recv(timeout=120))
            if message["type"] == "done":
                break
            metas.append(message)
            received.append(ws.recv(timeout=60))
    assert [m["chunk"]["index"] for m in metas] == list(range(len(metas)))
    offsets = [m["chunk"]["sample_offset"] for m in metas]
    assert offsets == [sum(m["chunk"]["samples"] for m in metas[:i]) for i in range(len(metas))]
    total = sum(len(r) for r in received)
    assert total == 2 * round(message["audio_seconds"] * SR) and message["chunks"] == len(metas)
    assert metas[-1]["chunk"]["final"] and started["mode"] == "sft"  # Ada has a transcript: zero-shot text stream


def test_websocket_errors_and_disconnect(url: str, service: TTSService, saved_voice: dict) -> None:
    import json

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    for start, field in (({"type": "start", "voice": "nobody"}, "voice"), ({"type": "hello"}, "type"),
                         ({"type": "start", "voice": "Ada", "format": "ogg"}, "format")):
        with connect(_ws_url(url)) as ws:
            ws.send(json.dumps(start))
            error = json.loads(ws.recv(timeout=60))
            assert error["type"] == "error" and error["error"]["field"] == field
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd.code == 1008
    with connect(_ws_url(url)) as ws:
        ws.send(json.dumps({"type": "start", "voice": "Ada", "format": "mp3"}))
        assert json.loads(ws.recv(timeout=60))["content_type"] == "audio/mpeg"
        ws.send(json.dumps({"type": "text", "text": TEXT * 3 + " "}))
        while json.loads(ws.recv(timeout=120))["bytes"] == 0:
            pass  # until MP3 bytes flow
    _wait_for(lambda: service.status().active_sessions == 0, timeout=20)  # the disconnect ended the session


def test_command_line_serves_the_model_of_cosyvoice_model_dir(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    """``python -m cosyvoice.server.rest`` (the console script's entry point) honours COSYVOICE_MODEL_DIR."""
    import os
    import subprocess
    import sys

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "COSYVOICE_MODEL_DIR": str(tiny_bundle_dir), "COSYVOICE_DEVICE": "cpu",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen([sys.executable, "-m", "cosyvoice.server.rest", "--port", str(port),
                                "--voice-dir", str(tmp_path / "voices"), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert process.poll() is None, "the server exited"
            try:
                return httpx.get(f"{url}/ready").status_code == 200
            except httpx.TransportError:
                return False

        _wait_for(ready, timeout=180)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == tiny_bundle_dir.name
    finally:
        process.terminate()
        process.wait(30)
