"""The bridge contract, one suite for the three servers that serve it: the Python REST server's bridge router
(uvicorn in a thread), the Rust ``cosyvoice-server`` (rust/bridge-server, Python embedded) and the native
``cosyvoice-native-server`` (rust/native-server, no Python), the two Rust ones as subprocesses, over real HTTP
on loopback, on the tiny bundle, configured alike (API key, CORS origin, body bound, limits, allowed folder).

A Rust server is skipped only when its binary has not been built (``bash scripts/build_rust.sh``); CI builds
them and sets ``COSYVOICE_REQUIRE_RUST=1``, which turns that skip into a failure. The native server finds ONNX
Runtime through ``ORT_DYLIB_PATH`` or the project's venv (the onnxruntime wheel's library).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from waiting import free_port

from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings
from cosyvoice.voices import VoiceLibrary
from tests.test_rest import Server

ROOT = Path(__file__).resolve().parents[1]
RUST_BINARY = ROOT / "rust" / "target" / "release" / "cosyvoice-server"
NATIVE_BINARY = ROOT / "rust" / "target" / "release" / "cosyvoice-native-server"
KEY = "contract-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
MAX_BODY = 200_000
LIMITS = {"max_sessions": 4, "max_queued_requests": 4, "queue_timeout_seconds": 60}
TEXT = "Hello there, my friend."
LONG_TEXT = "Hello there, my friend. " * 20  # ~100 s of generation on the tiny bundle: it never ends in a test
TRANSCRIPT = "Hello, this is a short prompt for testing."
DEEP_ARRAYS = b"[" * 100_000 + b"]" * 100_000  # 100,000 levels: a recursive parser's stack overflows
DEEP_OBJECTS = b'{"a":' * 39_000  # as deep as MAX_BODY allows


@dataclass
class Served:
    name: str
    url: str
    pid: int | None = None  # a subprocess's

    def ready(self) -> dict:
        return httpx.get(f"{self.url}/ready", headers=AUTH, timeout=30).json()



def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def require_rust_binary(binary: Path = RUST_BINARY) -> Path:
    if not binary.is_file():
        reason = f"the Rust server is not built ({binary.relative_to(ROOT)}; bash scripts/build_rust.sh)"
        if os.environ.get("COSYVOICE_REQUIRE_RUST") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


class RustServer:
    """A Rust server (``binary``) as a process, started from another folder (it finds the project's venv
    itself: the bridge its Python, the native server ONNX Runtime)."""

    def __init__(self, model_dir: Path, workdir: Path, *flags: str, binary: Path = RUST_BINARY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "COSYVOICE_DEVICE": "cpu", "RUST_LOG": "warn"}
        self.process = subprocess.Popen(
            [str(require_rust_binary(binary)), "--model-dir", str(model_dir), "--host", "127.0.0.1", "--port",
             str(self.port), "--voice-dir", str(workdir / "voices"), "--log-level", "warning", *flags],
            cwd=workdir, env=env)

        def ready() -> bool:
            assert self.process.poll() is None, f"{binary.name} exited with {self.process.returncode}"
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{self.url}/ready", headers=AUTH).status_code == 200
            return False

        _wait_for(ready, timeout=180)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture(scope="module")
def python_server(tts, tmp_path_factory: pytest.TempPathFactory, audio_dir: Path) -> Iterator[Served]:
    library = VoiceLibrary(tmp_path_factory.mktemp("voices"), tts.frontend, model_dir=tts.model_dir)
    service = TTSService(tts.model, library, Limits(**LIMITS))
    settings = ServerSettings(api_keys=(KEY,), cors_origins=(ORIGIN,), max_body_bytes=MAX_BODY,
                              allowed_audio_dir=str(audio_dir))
    server = Server(create_app(settings, service))
    yield Served("python", server.url)
    server.stop()


def _rust_flags(audio_dir: Path) -> list[str]:
    flags = ["--api-key", KEY, "--cors-origin", ORIGIN, "--max-body-bytes", str(MAX_BODY),
             "--allowed-audio-dir", str(audio_dir)]
    for name, value in LIMITS.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


@pytest.fixture(scope="module")
def rust_server(tiny_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory, audio_dir: Path) -> Iterator[Served]:
    server = RustServer(tiny_bundle_dir, tmp_path_factory.mktemp("rust"), *_rust_flags(audio_dir))
    yield Served("rust", server.url)
    server.stop()


@pytest.fixture(scope="module")
def native_server(tiny_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory, audio_dir: Path) -> Iterator[Served]:
    server = RustServer(tiny_bundle_dir, tmp_path_factory.mktemp("native"), *_rust_flags(audio_dir),
                        binary=NATIVE_BINARY)
    yield Served("native", server.url, server.process.pid)
    server.stop()


@pytest.fixture(params=["python", "rust", "native"])
def served(request: pytest.FixtureRequest) -> Served:
    return request.getfixturevalue(f"{request.param}_server")


def _encoded(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


# ----------------------------------------------------------------------------- the contract, on each server


def test_synthesize_answers_a_whole_wav_with_its_duration(served: Served, short_prompt_wav: Path) -> None:
    encoded = _encoded(short_prompt_wav)
    for body in ({"text": TEXT, "prompt_audio": encoded, "prompt_text": TRANSCRIPT, "seed": 1},
                 {"text": TEXT, "prompt_audio": "prompt.wav", "speaker": "A calm narrator.", "seed": 2}):
        response = httpx.post(f"{served.url}/synthesize", json=body, headers=AUTH, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "audio/wav"
        assert response.headers["x-sample-rate"] == "24000"
        wav, rate = sf.read(io.BytesIO(response.content), dtype="int16")
        assert rate == 24000 and wav.ndim == 1 and wav.size > 0  # 16-bit mono
        assert float(response.headers["x-audio-duration"]) == pytest.approx(wav.size / rate, abs=1e-3)
    assert httpx.post(f"{served.url}/synthesize", json={"text": TEXT}, headers=AUTH).status_code == 400
    metrics = httpx.get(f"{served.url}/metrics", headers=AUTH).text
    for sample in ('tts_requests_total{mode="zero_shot"}', 'tts_requests_success{mode="zero_shot"}',
                   'tts_requests_success{mode="instruct"}', 'tts_requests_error{mode="unknown",reason="invalid_input"}',
                   'tts_synthesis_duration_seconds_count{mode="instruct"}', 'tts_rtf_count{mode="zero_shot"}'):
        assert f"\n{sample} " in metrics, sample


def test_probes_and_speakers(served: Served) -> None:
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}  # open without a key
    ready = httpx.get(f"{served.url}/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}  # no details without a key
    details = served.ready()
    assert details["max_sessions"] == LIMITS["max_sessions"] and details["sample_rate"] == 24000
    speakers = httpx.get(f"{served.url}/speakers", headers=AUTH)
    assert speakers.status_code == 200 and speakers.json() == {"speakers": []}


def test_a_client_that_leaves_frees_the_engine(served: Served) -> None:
    """The client hangs up during a ~100 s generation: its slot is free again within seconds."""
    with synthesis_running(served):
        time.sleep(1)


@contextlib.contextmanager
def synthesis_running(served: Served) -> Iterator[None]:
    """A long synthesis from a raw socket, running while the block runs; closing the socket ends it."""
    body = json.dumps({"text": LONG_TEXT, "prompt_audio": "prompt.wav", "instruct": "Speak."}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    head = (f"POST /synthesize HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        _wait_for(lambda: served.ready()["active_sessions"] == 1, timeout=30)
        yield
    left = time.monotonic()
    _wait_for(lambda: served.ready()["active_sessions"] == 0, timeout=15)
    assert time.monotonic() - left < 15


def test_200_concurrent_health_checks_answer_during_synthesis(served: Served) -> None:
    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            answers = await asyncio.gather(*(client.get(f"{served.url}/health") for _ in range(200)))
        return [a.status_code for a in answers]

    with synthesis_running(served):
        assert asyncio.run(burst()) == [200] * 200
        assert served.ready()["active_sessions"] == 1  # the synthesis ran throughout


# ----------------------------------------------------------------------------- both servers answer alike


def _chunked(size: int) -> Iterator[bytes]:  # no Content-Length: the bound holds while reading
    for _ in range(size // 1000):
        yield b"x" * 1000


def _answer(response: httpx.Response) -> tuple[int, object, dict[str, str]]:
    """What the contract fixes of an answer: status, body (JSON parsed), and its contract headers."""
    kept = ("content-type", "allow", "www-authenticate", "retry-after", "vary")
    headers = {k: v for k, v in response.headers.items() if k in kept or k.startswith("access-control-")}
    json_body = response.headers.get("content-type") == "application/json"
    return response.status_code, response.json() if json_body else response.text, headers


@pytest.mark.parametrize("other", ["rust", "native"])
def test_bad_requests_get_the_same_answer_from_each(python_server: Served, other: str, short_prompt_wav: Path,
                                                    request: pytest.FixtureRequest) -> None:
    rust_server: Served = request.getfixturevalue(f"{other}_server")
    encoded = _encoded(short_prompt_wav)
    garbage = base64.b64encode(b"garbage" * 50).decode()
    as_json = {**AUTH, "content-type": "application/json"}
    cases: list[tuple[str, str, Callable[[], dict]]] = [
        ("POST", "/synthesize", lambda: {"content": b"", "headers": as_json}),
        ("POST", "/synthesize", lambda: {"content": b"{", "headers": as_json}),
        ("POST", "/synthesize", lambda: {"content": b"\xff\xfe{", "headers": as_json}),
        # UTF-32, as json.loads detects it: with a BOM, without one (big-endian), a truncated last unit
        ("POST", "/synthesize", lambda: {"content": json.dumps({"text": TEXT}).encode("utf-32"), "headers": as_json}),
        ("POST", "/synthesize", lambda: {"content": b'{"text": "a"}'.decode().encode("utf-32-be"),
                                         "headers": as_json}),
        ("POST", "/synthesize", lambda: {"content": b"\xff\xfe\x00\x00{\x00\x00", "headers": as_json}),
        ("POST", "/synthesize", lambda: {"content": b"[]", "headers": as_json}),
        ("POST", "/synthesize", lambda: {"content": b'{"text": "a"}',
                                         "headers": {**AUTH, "content-type": "text/plain"}}),
        ("POST", "/synthesize", lambda: {"json": {"text": 5}, "headers": AUTH}),
        ("POST", "/synthesize", lambda: {"json": {"prompt_audio": encoded}, "headers": AUTH}),
        ("POST", "/synthesize", lambda: {"json": {"text": TEXT}, "headers": AUTH}),
        ("POST", "/synthesize", lambda: {"json": {"text": TEXT, "prompt_audio": "", "speaker": "Calm."},
                                         "headers": AUTH}),
        ("POST", "/synthesize", lambda: {"json": {"text": TEXT, "prompt_audio": "../etc/passwd"}, "headers": AUTH}),
        ("POST", "/synthesize", lambda: {"json": {"text": TEXT, "prompt_audio": garbage}, "headers": AUTH}),
        ("POST", "/synthesize", lambda: {"json": {"text": TEXT, "prompt_audio": encoded, "speed": 7},
                                         "headers": AUTH}),
        ("POST", "/synthesize", lambda: {"json": {"text": "", "prompt_audio": encoded}, "headers": AUTH}),
        ("POST", "/synthesize", lambda: {"json": {"text": TEXT, "prompt_audio": encoded}}),  # no key
        ("POST", "/synthesize", lambda: {"json": {"text": TEXT}, "headers": {"Authorization": "Bearer wrong"}}),
        ("POST", "/synthesize", lambda: {"content": DEEP_ARRAYS, "headers": as_json}),
        ("POST", "/synthesize", lambda: {"content": DEEP_OBJECTS, "headers": as_json}),
        ("POST", "/synthesize", lambda: {"content": DEEP_ARRAYS, "headers": {**AUTH, "content-type": "text/plain"}}),
        ("POST", "/synthesize", lambda: {"content": b"x" * (MAX_BODY + 1), "headers": as_json}),
        ("POST", "/synthesize", lambda: {"content": _chunked(MAX_BODY + 1000), "headers": as_json}),
        ("GET", "/synthesize", lambda: {"headers": AUTH}),
        ("POST", "/health", lambda: {"headers": AUTH}),
        ("GET", "/nowhere", lambda: {"headers": AUTH}),
        ("GET", "/nowhere", lambda: {}),
        ("GET", "/speakers", lambda: {}),
        ("GET", "/metrics", lambda: {}),
        ("GET", "/health", lambda: {"headers": {"Origin": ORIGIN}}),
        ("GET", "/health", lambda: {"headers": {"Origin": "https://evil.example"}}),
        ("OPTIONS", "/synthesize", lambda: {"headers": {
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"}}),
        ("OPTIONS", "/synthesize", lambda: {"headers": {"Origin": "https://evil.example",
                                                        "Access-Control-Request-Method": "POST"}}),
    ]
    for method, path, request in cases:
        answers = [_answer(httpx.request(method, f"{server.url}{path}", timeout=60, **request()))
                   for server in (python_server, rust_server)]
        assert answers[0] == answers[1], (method, path, request().get("json"), answers)
        assert answers[0][0] in (200, 400, 401, 404, 405, 413), answers[0]


def test_json_nested_100000_deep_is_a_400_naming_the_nesting(served: Served) -> None:
    for body in (DEEP_ARRAYS, DEEP_OBJECTS):
        answer = httpx.post(f"{served.url}/synthesize", content=body, timeout=60,
                            headers={**AUTH, "content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"] == "the body nests JSON deeper than 64 levels"


@pytest.mark.parametrize("binary", [RUST_BINARY, NATIVE_BINARY], ids=["rust", "native"])
def test_sigterm_drains_a_rust_server_then_cancels_within_the_grace(tiny_bundle_dir: Path, tmp_path: Path,
                                                                     audio_dir: Path, binary: Path) -> None:
    """SIGTERM: the running synthesis gets ``--shutdown-grace-seconds``, then is cancelled; the server exits."""
    server = RustServer(tiny_bundle_dir, tmp_path, *_rust_flags(audio_dir), "--shutdown-grace-seconds", "2",
                        binary=binary)
    try:
        body = {"text": LONG_TEXT, "prompt_audio": "prompt.wav", "instruct": "Speak."}
        answer: list[httpx.Response | Exception] = []

        def synthesize() -> None:
            try:
                answer.append(httpx.post(f"{server.url}/synthesize", json=body, headers=AUTH, timeout=120))
            except httpx.HTTPError as exc:
                answer.append(exc)

        worker = threading.Thread(target=synthesize, daemon=True)
        worker.start()
        _wait_for(lambda: Served("rust", server.url).ready()["active_sessions"] == 1, timeout=30)
        server.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert server.process.wait(30) == 0
        assert time.monotonic() - sent < 2 + 6, "the drain did not end the request at the grace"
        worker.join(10)
        assert isinstance(answer[0], httpx.Response) and answer[0].status_code == 503, answer
        assert answer[0].json()["error"]["type"] == "busy"
    finally:
        server.stop()



def test_the_native_server_runs_without_python(native_server: Served) -> None:
    """No libpython is mapped into the native server's process, with its model (ONNX Runtime included) loaded."""
    assert native_server.ready()["status"] == "ready"
    maps = Path(f"/proc/{native_server.pid}/maps").read_text()
    assert "libonnxruntime" in maps  # the prompt networks' runtime is loaded...
    assert "libpython" not in maps  # ...and no interpreter


def test_the_native_server_says_what_it_does_not_do(native_server: Served, short_prompt_wav: Path) -> None:
    """Where the native engine differs (docs/servers.md, "Native server"): a prompt that is not WAV and flow
    steps other than the model's are refused, naming why; the Python server takes both."""
    mp3 = base64.b64encode(b"ID3\x04\x00" + b"\x00" * 400).decode()
    answer = httpx.post(f"{native_server.url}/synthesize", headers=AUTH, timeout=60,
                        json={"text": TEXT, "prompt_audio": mp3, "prompt_text": TRANSCRIPT})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == ("the uploaded audio looks like MP3; this server (cosyvoice-native-"
                                                 "server) reads WAV prompts only: convert it to WAV, or use the "
                                                 "Python server")
    answer = httpx.post(f"{native_server.url}/synthesize", headers=AUTH, timeout=60,
                        json={"text": TEXT, "prompt_audio": _encoded(short_prompt_wav), "steps": 5})
    assert answer.status_code == 400 and answer.json()["error"]["field"] == "steps"
