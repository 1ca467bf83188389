"""The REST server over real loopback HTTP (uvicorn in a thread, httpx clients), on the tiny bundle."""

from __future__ import annotations

import base64
import contextlib
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
from waiting import free_port, until, until_ready

from cosyvoice.encoding import FORMATS
from cosyvoice.server.rest import create_app
from cosyvoice.service import Outcome, TTSService
from cosyvoice.settings import Limits, ServerSettings
from cosyvoice.voices import VoiceLibrary
from tests.test_encoding import SLACK, SOUNDFILE_FORMATS, _decode

TEXT = "Hello there, my friend."
TRANSCRIPT = "Hello, this is a short prompt for testing."
SR = 24000


class Server:
    """A uvicorn server on a free loopback port, in a thread."""

    def __init__(self, app, **options: object) -> None:
        """``options``: more ``uvicorn.Config`` arguments (the HTTP bounds of ``uvicorn_options``)."""
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        until(lambda: self.server.started, 30, "the server's start")

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
    # several chunks: TEXT * 2 once made 1.2 s of audio, one chunk, which ended the utterance 0.4 ms before its
    # first bytes reached the client (CI), so "streamed" could not be told from "whole" (here: 11-38 s, 1.3-5.7 s apart)
    data = {"tts_text": TEXT * 4, "prompt_text": TRANSCRIPT}
    first_bytes = None
    body = b""
    with httpx.Client(timeout=120) as client, \
            client.stream(method, f"{url}/inference_zero_shot", data=data, files=files) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            first_bytes = first_bytes or time.perf_counter()
            body += piece
    until(lambda: outcomes)
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


def test_official_endpoints_take_our_seed_and_schedule_fields(url: str, short_prompt_wav: Path) -> None:
    """Optional form fields beside the official ones: a seed repeats a take, steps and the first hop change it,
    and a bad value is a 400 naming its field."""
    files = {"prompt_wav": ("prompt_wav", short_prompt_wav.read_bytes(), "application/octet-stream")}

    def speak(**fields: object) -> httpx.Response:
        return httpx.post(f"{url}/inference_cross_lingual", data={"tts_text": TEXT, **fields}, files=files,
                          timeout=120)

    seeded = speak(seed=4)
    assert seeded.status_code == 200 and speak(seed=4).content == seeded.content
    assert speak(seed=4, steps=2).content != seeded.content
    assert speak(seed=4, first_hop=6, final="chunked").content != seeded.content
    _error(speak(first_hop=40), 400, "first_hop")
    _error(speak(final="half"), 400, "final")
    _error(speak(seed="soon"), 400, "seed")


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
    # base64 of a non-audio file, too long for a file name (the path lookup must not fail with a 500)
    garbage = base64.b64encode(b"garbage" * 50).decode()
    _error(httpx.post(f"{url}/synthesize", json={"text": TEXT, "prompt_audio": garbage}), 400, "prompt_audio")
    _error(httpx.post(f"{url}/synthesize", json={"prompt_audio": encoded}), 400, "text")


def test_bridge_contract_speaker_is_the_instruction_and_prompt_audio_is_required(url: str, short_prompt_wav: Path,
                                                                                  outcomes: list) -> None:
    """The seed contract: ``instruct = request.instruct or request.speaker or "Speak naturally in English."``
    (``speaker`` is no saved voice here), and no ``prompt_audio`` is a 400 with the contract's message."""
    encoded = base64.b64encode(short_prompt_wav.read_bytes()).decode()
    for body in ({"text": TEXT, "prompt_audio": encoded, "speaker": "A calm, deep narrator."},
                 {"text": TEXT, "prompt_audio": encoded, "speaker": "Cheerful.", "prompt_text": TRANSCRIPT}):
        response = httpx.post(f"{url}/synthesize", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert outcomes[-1][1].mode == "instruct"
    for body in ({"text": TEXT}, {"text": TEXT, "prompt_audio": "", "speaker": "Calm."}):
        message = _error(httpx.post(f"{url}/synthesize", json=body), 400, "prompt_audio")
        assert message == "prompt_audio is required for CosyVoice3 synthesis"
    _error(httpx.post(f"{url}/synthesize", json={"text": TEXT, "prompt_audio": encoded, "steps": 0}), 400, "steps")
    for field, bad in (("final", "half"), ("first_hop", 0), ("first_hop", "soon")):  # the chunk schedule
        _error(httpx.post(f"{url}/synthesize", json={"text": TEXT, "prompt_audio": encoded, field: bad}), 400, field)


def test_bridge_client_that_leaves_cancels_its_synthesis(url: str, service: TTSService, short_prompt_wav: Path,
                                                          outcomes: list) -> None:
    """A non-streamed answer: the client's disconnect ends the session at once, not when the WAV is done
    (a ~100 s generation here)."""
    body = {"text": "Hello there, my friend. " * 20, "prompt_audio": "prompt.wav", "instruct": "Speak."}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/synthesize", json=body, timeout=httpx.Timeout(60, read=3))
    left = time.perf_counter()
    until(lambda: outcomes, 30)
    ended, outcome = outcomes[-1]
    assert outcome.reason == "cancelled" and ended - left < 10, (outcome, ended - left)
    until(lambda: service.active_sessions == 0, 10)


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
    if fmt in SOUNDFILE_FORMATS:  # libsndfile too: a FLAC must say its length (STREAMINFO) to be read at all
        samples, rate = sf.read(io.BytesIO(response.content))
        assert rate == SR and abs(samples.size / rate - expected) <= SLACK[fmt] / SR + 1e-9


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
    _error(httpx.post(f"{url}/v1/audio/speech", json={**body, "steps": 33}), 400, "steps")  # our extension
    message = _error(httpx.post(f"{url}/v1/audio/speech", json={**body, "final": "partial"}), 400, "final")
    assert "'full', 'chunked'" in message
    assert "1 to 25" in _error(httpx.post(f"{url}/v1/audio/speech", json={**body, "first_hop": 26}), 400, "first_hop")
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
    """Counters as prometheus-client names them (``_total``) and, for the bridge contract, exactly
    ``tts_requests_success`` / ``tts_requests_error`` (the Rust ``metrics`` exporter's names)."""
    ok, total = 'tts_requests_success_total{mode="sft"}', 'tts_requests_total{mode="sft"}'
    bad = 'tts_requests_error_total{mode="sft",reason="invalid_input"}'
    bare_ok, bare_bad = 'tts_requests_success{mode="sft"}', 'tts_requests_error{mode="sft",reason="invalid_input"}'
    samples = (ok, total, bad, bare_ok, bare_bad)
    before = [_metric(url, s) for s in samples]
    assert httpx.post(f"{url}/inference_sft", data={"tts_text": TEXT, "spk_id": "Ada"}, timeout=120).status_code == 200
    assert httpx.post(f"{url}/inference_sft", data={"tts_text": "", "spk_id": "Ada"}).status_code == 400
    assert httpx.post(f"{url}/inference_sft", data={"spk_id": "Ada"}).status_code == 400  # before the service
    after = [_metric(url, s) for s in samples]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 3, 2, 1, 2]
    assert after[3] == after[0] and after[4] == after[2]
    text = httpx.get(f"{url}/metrics").text
    for family in ("tts_synthesis_duration_seconds_count", "tts_rtf_count", "tts_first_chunk_seconds_count",
                   "tts_active_sessions", "tts_queue_depth"):
        assert family in text


def test_health_and_ready(url: str) -> None:
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{url}/ready").json()
    assert ready["status"] == "ready" and ready["sample_rate"] == SR
    assert (ready["precision"]["requested"], ready["precision"]["llm"], ready["precision"]["flow"]) == ("fp32",) * 3


def test_voices_belong_to_the_key_that_saved_them(tts, tmp_path: Path, short_prompt_wav: Path) -> None:
    """With API keys, the REST voice calls name the key's owner: another key may use a saved voice but not
    delete it (403); its creator may."""
    library = VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir)
    server = Server(create_app(ServerSettings(api_keys=("alice-key", "bob-key")), TTSService(tts.model, library)))
    alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("alice-key", "bob-key"))
    try:
        created = httpx.post(f"{server.url}/v1/voices", data={"name": "Alice", "transcript": TRANSCRIPT}, headers=alice,
                             files={"audio": ("a.wav", short_prompt_wav.read_bytes(), "audio/wav")}, timeout=60)
        assert created.status_code == 201, created.text
        assert [v["name"] for v in httpx.get(f"{server.url}/v1/voices", headers=bob).json()["data"]] == ["Alice"]
        _error(httpx.delete(f"{server.url}/v1/voices/Alice", headers=bob), 403)
        assert httpx.delete(f"{server.url}/v1/voices/Alice", headers=alice).status_code == 200
    finally:
        server.stop()


def test_server_errors_say_no_internals() -> None:
    """A model failure's or an unexpected error's text (paths, internals) stays in the log, never in the answer."""
    from cosyvoice.errors import ModelBundleError
    from cosyvoice.server.common import http_error

    settings = ServerSettings()
    for exc in (ModelBundleError("/srv/models/cv3/flow.pt is corrupt"), OSError("/tmp/cosyvoice-x: disk full"),
                KeyError("llm.model.layers.3")):
        error = http_error(exc, settings)
        assert error.status == 500 and "/srv" not in error.message and "/tmp" not in error.message
        assert "llm." not in error.message and "the server log has the details" in error.message


def test_probe_details_only_with_a_key(service: TTSService) -> None:
    """On a server with keys, the open probes say their status and nothing else: no model folder (a server
    path), no load error; a key holder sees the details."""
    keyed = Server(create_app(ServerSettings(api_keys=("s3cret",)), service))

    def broken() -> TTSService:
        raise FileNotFoundError("/secret/models/cosyvoice3.yaml is missing")

    failed = Server(create_app(ServerSettings(api_keys=("s3cret",)), loader=broken))
    auth = {"Authorization": "Bearer s3cret"}
    try:
        assert httpx.get(f"{keyed.url}/ready").json() == {"status": "ready"}
        detailed = httpx.get(f"{keyed.url}/ready", headers=auth).json()
        assert detailed["model_dir"] == str(service.model_dir) and detailed["max_sessions"] == 4
        until(lambda: httpx.get(f"{failed.url}/health").status_code == 503)
        for path in ("/health", "/ready"):
            assert "/secret" not in httpx.get(f"{failed.url}{path}").text
            assert "/secret" in httpx.get(f"{failed.url}{path}", headers=auth).text
        refused = httpx.post(f"{failed.url}/v1/audio/speech", json={"input": TEXT, "voice": "Ada"}, headers=auth)
        assert refused.status_code == 503 and "/secret" not in refused.text
    finally:
        keyed.stop()
        failed.stop()


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
        until(lambda: httpx.get(f"{server.url}/ready").status_code == 200)
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
        # a seed whose take runs to the length limit (38 s of audio): a drawn one ends within a second about one
        # time in four on the random model, and the slot is free again before the second request comes
        body = {"input": TEXT * 4, "voice": "Ada", "response_format": "pcm", "seed": 0}
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", f"{server.url}/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            # audio is flowing: the one slot is taken. The iterator is kept: a dropped one is closed whenever the
            # garbage collector gets to it, and closing it hangs up the connection (the server then cancels)
            audio = response.iter_raw()
            next(audio)
            busy = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "7", (busy.status_code, seen)
            assert busy.json()["error"]["type"] == "busy"
        # leaving the block closed the connection mid-stream: the session must end, not run to completion
        until(lambda: service.status().active_sessions == 0, 20)
        assert [o.reason for o in seen] == ["busy", "cancelled"]
    finally:
        server.stop()


def test_a_client_that_leaves_while_queued_frees_its_place(tts, library: VoiceLibrary, saved_voice: dict,
                                                            audio_dir: Path) -> None:
    """Waiting for a slot, a client that disconnects leaves the queue at once (not when a slot frees up or the
    queue timeout passes)."""
    import json

    from websockets.sync.client import connect

    service = TTSService(tts.model, library, Limits(max_sessions=1, max_queued_requests=1, queue_timeout_seconds=60))
    server = Server(create_app(ServerSettings(allowed_audio_dir=str(audio_dir)), service))
    try:
        with connect(_ws_url(server.url)) as ws:  # an open text stream holds the one slot until it ends
            ws.send(json.dumps({"type": "start", "voice": "Ada"}))
            assert json.loads(ws.recv(timeout=60))["type"] == "started"
            for path, request in (("/synthesize", {"text": TEXT, "prompt_audio": "prompt.wav"}),
                                  ("/v1/audio/speech", {"input": TEXT, "voice": "Ada"})):
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(f"{server.url}{path}", json=request, timeout=httpx.Timeout(30, read=2))
                assert service.active_sessions == 1
                until(lambda: service.queued_requests == 0, 3)
        until(lambda: service.active_sessions == 0, 20)
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
                         ({"type": "start", "voice": "Ada", "format": "ogg"}, "format"),
                         ({"type": "start", "voice": "Ada", "final": "half"}, "final"),
                         ({"type": "start", "voice": "Ada", "first_hop": 99}, "first_hop")):
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
    until(lambda: service.status().active_sessions == 0, 20)  # the disconnect ended the session


def test_websocket_start_deadline_and_idle_limit_ignore_keep_alives(service: TTSService, saved_voice: dict) -> None:
    """A socket that never starts is closed at the start deadline; one that sends only white space every
    0.4 s has its text ended after the idle limit (keep-alives are not text), so its slot is freed."""
    import json

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    server = Server(create_app(ServerSettings(stream_start_seconds=1, stream_idle_seconds=1.5), service))
    try:
        with connect(_ws_url(server.url)) as ws:
            began = time.monotonic()
            error = json.loads(ws.recv(timeout=10))
            assert error["type"] == "error" and error["error"]["field"] == "type"
            assert "start" in error["error"]["message"]
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd.code == 1008 and time.monotonic() - began < 5
        with connect(_ws_url(server.url)) as ws:
            ws.send(json.dumps({"type": "start", "voice": "Ada"}))
            assert json.loads(ws.recv(timeout=60))["type"] == "started"
            ws.send(json.dumps({"type": "text", "text": "Hi."}))
            began, done = time.monotonic(), None
            while done is None and time.monotonic() - began < 30:
                ws.send(json.dumps({"type": "text", "text": " "}))
                with contextlib.suppress(TimeoutError):
                    while True:
                        message = ws.recv(timeout=0.4)
                        if isinstance(message, str) and json.loads(message)["type"] == "done":
                            done = time.monotonic() - began
                            break
            assert done is not None and done < 20, "white-space keep-alives held the stream open"
        until(lambda: service.active_sessions == 0, 10)
    finally:
        server.stop()


def test_each_router_serves_alone(service: TTSService, short_prompt_wav: Path) -> None:
    """An API family is one router: mounted alone on a bare app (with the shared error mapping)."""
    from fastapi import FastAPI

    from cosyvoice.context import StudioContext
    from cosyvoice.server import bridge
    from cosyvoice.server.common import ServerState, install_error_handlers

    app = FastAPI()
    app.state.server = ServerState(StudioContext(ServerSettings()))
    app.state.server.install(service)
    install_error_handlers(app)
    app.include_router(bridge.router)
    server = Server(app)
    try:
        encoded = base64.b64encode(short_prompt_wav.read_bytes()).decode()
        response = httpx.post(f"{server.url}/synthesize", json={"text": TEXT, "prompt_audio": encoded}, timeout=120)
        assert response.status_code == 200 and sf.read(io.BytesIO(response.content))[0].size > 0
        _error(httpx.post(f"{server.url}/synthesize", json={"text": TEXT}), 400, "prompt_audio")
        assert httpx.get(f"{server.url}/v1/voices").status_code == 404  # the voices router is not mounted
    finally:
        server.stop()



def test_sigterm_drains_then_cancels_within_the_grace(tiny_bundle_dir: Path, tmp_path: Path,
                                                     short_prompt_wav: Path) -> None:
    """SIGTERM: running requests get ``--shutdown-grace-seconds``, then are cancelled; the server exits (uvicorn
    alone would wait for these ~100 s requests to finish). A cancelled request is never answered as if it were
    whole: a stream's body stays unfinished, a whole file is a 503 that says why, a socket never says done."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    port = free_port()
    env = {**os.environ, "COSYVOICE_DEVICE": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen([sys.executable, "-m", "cosyvoice.server.rest", "--model-dir", str(tiny_bundle_dir),
                                "--port", str(port), "--voice-dir", str(tmp_path / "voices"), "--log-level",
                                "warning", "--shutdown-grace-seconds", "2"], env=env)
    url = f"http://127.0.0.1:{port}"
    text = "Hello there, my friend. " * 20
    try:
        until_ready(process, url)
        voice = httpx.post(f"{url}/v1/voices", data={"name": "Ada", "transcript": TRANSCRIPT}, timeout=60,
                           files={"audio": ("a.wav", short_prompt_wav.read_bytes(), "audio/wav")})
        assert voice.status_code == 201, voice.text
        whole: list[httpx.Response | Exception] = []

        def synthesize() -> None:
            body = {"text": text, "prompt_audio": base64.b64encode(short_prompt_wav.read_bytes()).decode()}
            try:
                whole.append(httpx.post(f"{url}/synthesize", json=body, timeout=120))
            except httpx.HTTPError as exc:
                whole.append(exc)

        worker = threading.Thread(target=synthesize, daemon=True)
        worker.start()
        with connect(url.replace("http://", "ws://") + "/v1/audio/stream", open_timeout=30) as socket:
            for message in ({"type": "start", "voice": "Ada"}, {"type": "text", "text": text}, {"type": "end"}):
                socket.send(json.dumps(message))
            body = {"input": text, "voice": "Ada", "response_format": "pcm"}
            with httpx.Client(timeout=120) as client, \
                    client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
                audio = response.iter_raw()
                next(audio)
                until(lambda: httpx.get(f"{url}/ready", timeout=5).json()["active_sessions"] == 3, 30,
                      "the three requests running")
                process.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                with pytest.raises(httpx.RemoteProtocolError):  # the chunked body never completes
                    for _ in audio:
                        pass
            events = []
            with contextlib.suppress(ConnectionClosed):
                while True:
                    message = socket.recv(timeout=30)
                    if isinstance(message, str):
                        events.append(json.loads(message)["type"])
            assert "done" not in events and socket.close_code in (1012, 1013), (events, socket.close_code)
        worker.join(30)
        assert process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        assert time.monotonic() - sent < 2 + 6, "the drain did not end the requests at the grace"
        assert isinstance(whole[0], httpx.Response) and whole[0].status_code == 503, whole
        error = whole[0].json()["error"]
        assert (error["type"], error["message"]) == ("busy", "shutting down: this request was cancelled; retry on "
                                                             "another server")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_command_line_serves_the_model_of_cosyvoice_model_dir(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    """``python -m cosyvoice.server.rest`` (the console script's entry point) honours COSYVOICE_MODEL_DIR."""
    import os
    import subprocess
    import sys

    port = free_port()
    env = {**os.environ, "COSYVOICE_MODEL_DIR": str(tiny_bundle_dir), "COSYVOICE_DEVICE": "cpu",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen([sys.executable, "-m", "cosyvoice.server.rest", "--port", str(port),
                                "--voice-dir", str(tmp_path / "voices"), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        until_ready(process, url)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == tiny_bundle_dir.name
    finally:
        process.terminate()
        process.wait(30)
