"""Slow and hostile clients against both servers on loopback, with the HTTP bounds set to a second or two:
the Rust ``cosyvoice-server`` (its front, rust/http-front) and the Python REST server (uvicorn with
``uvicorn_options`` and ``BodyGuard``). Slow headers are closed at the header timeout while a normal request
is answered, a slow body is cut with a 408 (the same answer from both) that a client still sending reads
whole, an idle keep-alive connection is closed, connections over the cap get a 503, and SIGTERM ends the
Rust server within the grace with slow clients connected.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cosyvoice.server.http_limits import uvicorn_options
from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings
from cosyvoice.voices import VoiceLibrary
from tests.test_bridge_contract import KEY, LIMITS, RustServer, Served, _rust_flags
from tests.test_rest import Server

HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, MIN_RATE = 2.0, 1.0, 1.0, 100
SLACK = 4.0  # a loaded two-core machine's scheduling, on top of each bound
BOUNDS = {"header_timeout_seconds": HEADER_TIMEOUT, "body_timeout_seconds": BODY_TIMEOUT,
          "keep_alive_timeout_seconds": KEEP_ALIVE, "body_min_bytes_per_second": MIN_RATE}
HALF_HEAD = b"POST /synthesize HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def _flags(bounds: dict[str, float]) -> list[str]:
    return [arg for name, value in bounds.items() for arg in ("--" + name.replace("_", "-"), str(value))]


@pytest.fixture(scope="module")
def python_strict(tts, tmp_path_factory: pytest.TempPathFactory, audio_dir: Path) -> Iterator[Served]:
    library = VoiceLibrary(tmp_path_factory.mktemp("voices"), tts.frontend, model_dir=tts.model_dir)
    settings = ServerSettings(api_keys=(KEY,), allowed_audio_dir=str(audio_dir), **BOUNDS)
    server = Server(create_app(settings, TTSService(tts.model, library, Limits(**LIMITS))),
                    **uvicorn_options(settings))
    yield Served("python", server.url)
    server.stop()


@pytest.fixture(scope="module")
def rust_strict(tiny_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                audio_dir: Path) -> Iterator[RustServer]:
    server = RustServer(tiny_bundle_dir, tmp_path_factory.mktemp("rust"), *_rust_flags(audio_dir), *_flags(BOUNDS))
    yield server
    server.stop()


@pytest.fixture(params=["python", "rust"])
def strict(request: pytest.FixtureRequest) -> Served:
    if request.param == "rust":
        return Served("rust", request.getfixturevalue("rust_strict").url)
    return request.getfixturevalue("python_strict")


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_within(sockets: list[socket.socket], limit: float, trickle: bytes | None = None,
                   since: float | None = None) -> list[float]:
    """Seconds until the server closed each socket, counted from ``since`` (a ``time.monotonic()``; default now),
    sending ``trickle`` on each still open every 0.25 s (a client that is slow, not silent); fails if any is still
    open ``limit`` seconds after ``since``."""
    started = time.monotonic() if since is None else since
    closed: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while len(closed) < len(sockets):
            elapsed = time.monotonic() - started
            assert elapsed < limit, f"{len(sockets) - len(closed)} connection(s) still open after {elapsed:.1f} s"
            for key, _ in selector.select(timeout=0.25):
                try:
                    data = key.fileobj.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed[key.fileobj] = time.monotonic() - started
                    selector.unregister(key.fileobj)
            if trickle is not None:
                for sock in sockets:
                    if sock not in closed:
                        try:
                            sock.send(trickle)
                        except OSError:
                            closed[sock] = time.monotonic() - started
                            selector.unregister(sock)
    return [closed[sock] for sock in sockets]


def test_100_slow_header_clients_are_closed_at_the_header_timeout_while_others_are_answered(
        strict: Served) -> None:
    sockets = [socket.create_connection(_address(strict.url), timeout=10) for _ in range(100)]
    try:
        for sock in sockets:
            sock.sendall(HALF_HEAD)
        sent = time.monotonic()  # the bound runs from here, however long the next request takes on a busy machine
        assert httpx.get(f"{strict.url}/health", timeout=10).status_code == 200  # served meanwhile
        closed = _closed_within(sockets, HEADER_TIMEOUT + SLACK, trickle=b"X", since=sent)
        assert min(closed) > HEADER_TIMEOUT / 4, closed  # held for the bound, not dropped on sight
        assert httpx.get(f"{strict.url}/health", timeout=10).status_code == 200
    finally:
        for sock in sockets:
            sock.close()


def _response(sock: socket.socket, limit: float) -> tuple[int, dict, dict[str, str]]:
    """The one answer the server sends on ``sock`` (read until it closes, within ``limit`` seconds)."""
    sock.settimeout(limit)
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), json.loads(body), headers


@pytest.mark.parametrize("content_type", ["application/json", "text/plain"])
def test_a_slow_body_is_cut_at_the_body_timeout_with_the_same_408_from_both(
        python_strict: Served, rust_strict: RustServer, content_type: str) -> None:
    answers = []
    for url in (python_strict.url, rust_strict.url):
        with socket.create_connection(_address(url), timeout=10) as sock:
            sock.sendall(("POST /synthesize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n"
                          f"Content-Type: {content_type}\r\nAuthorization: Bearer {KEY}\r\n\r\n").encode() + b'{"te')
            started = time.monotonic()
            sock.sendall(b"x")  # then silence: the body timeout, not the rate, ends it
            status, body, headers = _response(sock, BODY_TIMEOUT + SLACK)
            assert BODY_TIMEOUT * 0.8 < time.monotonic() - started < BODY_TIMEOUT + SLACK
            assert headers.get("connection") == "close"
            answers.append((status, body))
    assert answers[0] == answers[1] and answers[0][0] == 408, answers
    assert answers[0][1]["error"]["type"] == "request_timeout"


def test_a_body_trickled_under_the_minimum_rate_is_cut(strict: Served) -> None:
    with socket.create_connection(_address(strict.url), timeout=10) as sock:
        sock.sendall(b"POST /synthesize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n"
                     b"Content-Type: application/json\r\n" + f"Authorization: Bearer {KEY}\r\n\r\n".encode())
        started = time.monotonic()
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            for _ in range(int((BODY_TIMEOUT + SLACK) / 0.2) + 1):  # 5 B/s: never silent for the body timeout
                if selector.select(timeout=0.2):
                    break
                with contextlib.suppress(OSError):
                    sock.sendall(b" ")
        assert _response(sock, SLACK)[0] == 408
        assert time.monotonic() - started < BODY_TIMEOUT + SLACK


def test_a_client_still_sending_its_body_after_the_408_reads_it_and_is_not_reset(strict: Served) -> None:
    """A client that writes its whole body before reading (most do) is answered mid-body: the server reads on
    and drops the rest for a while, so the client's bytes meet no closed socket, whose reset would lose the
    answer it has not read yet."""
    with socket.create_connection(_address(strict.url), timeout=10) as sock:
        sock.sendall(b"POST /synthesize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n"
                     b"Content-Type: application/json\r\n" + f"Authorization: Bearer {KEY}\r\n\r\n".encode())
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            assert selector.select(timeout=BODY_TIMEOUT + SLACK), "no answer to a silent body"
        sock.sendall(b" " * 20000)  # the answer and the server's FIN have arrived; the body goes on
        assert _response(sock, SLACK)[0] == 408
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0  # a reset leaves ECONNRESET or EPIPE


def test_an_idle_keep_alive_connection_is_closed(strict: Served) -> None:
    with socket.create_connection(_address(strict.url), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within([sock], KEEP_ALIVE + SLACK)[0] > KEEP_ALIVE * 0.8


def _two_held_and_a_third(url: str) -> tuple[socket.socket, socket.socket, httpx.Response]:
    """A slow head and a slow body connected to ``url``, then a third connection's answer to /health."""
    slow_head = socket.create_connection(_address(url), timeout=10)
    slow_head.sendall(HALF_HEAD)
    slow_body = socket.create_connection(_address(url), timeout=10)
    slow_body.sendall(b"POST /synthesize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n"
                      b"Content-Type: application/json\r\n" + f"Authorization: Bearer {KEY}\r\n\r\n{{".encode())
    return slow_head, slow_body, httpx.get(f"{url}/health", timeout=10)


def _answered_busy(sock: socket.socket) -> bool:
    """Whether the server answered ``sock`` with its 503 (within a few seconds; a held connection gets nothing)."""
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        return bool(selector.select(timeout=SLACK)) and sock.recv(65536).startswith(b"HTTP/1.1 503")


CAPPED = {"max_connections": 1, "header_timeout_seconds": 60, "body_timeout_seconds": 60,
          "keep_alive_timeout_seconds": 60, "body_min_bytes_per_second": 0}


@pytest.fixture(params=["python", "rust"])
def capped(request: pytest.FixtureRequest, tmp_path: Path, audio_dir: Path) -> Iterator[str]:
    """A server of each kind serving one connection at a time (its URL)."""
    if request.param == "rust":
        server = RustServer(request.getfixturevalue("tiny_bundle_dir"), tmp_path, *_rust_flags(audio_dir),
                            *_flags(CAPPED))
    else:
        tts = request.getfixturevalue("tts")
        library = VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir)
        settings = ServerSettings(api_keys=(KEY,), allowed_audio_dir=str(audio_dir), **CAPPED)
        server = Server(create_app(settings, TTSService(tts.model, library, Limits(**LIMITS))),
                        **uvicorn_options(settings))
    yield server.url
    server.stop()


def test_a_client_over_the_cap_still_sending_its_body_reads_the_503(capped: str) -> None:
    """The busy answer comes before the request's body is read: a client still sending it reads the 503, not a
    reset."""
    held = sock = None
    try:
        for _ in range(5):
            held = socket.create_connection(_address(capped), timeout=10)
            held.sendall(HALF_HEAD)
            sock = socket.create_connection(_address(capped), timeout=10)
            sock.sendall(b"POST /synthesize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n"
                         b"Content-Type: application/json\r\n" + f"Authorization: Bearer {KEY}\r\n\r\n{{".encode())
            with selectors.DefaultSelector() as selector:
                selector.register(held, selectors.EVENT_READ)
                selector.register(sock, selectors.EVENT_READ)
                answered = {key.fileobj for key, _ in selector.select(timeout=SLACK)}
            if sock in answered:
                break
            # the server's readiness probe still held the one place when ours came: try again
            held.close()
            sock.close()
        assert sock is not None and sock.fileno() != -1, "no busy answer"
        sock.sendall(b" " * 20000)  # the answer has arrived; the body goes on
        sock.settimeout(SLACK)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
        assert raw.startswith(b"HTTP/1.1 503"), raw[:200]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0  # a reset leaves ECONNRESET or EPIPE
    finally:
        for s in (held, sock):
            if s is not None:
                s.close()


def test_connections_over_the_cap_get_503_then_sigterm_ends_with_slow_clients_connected(
        tiny_bundle_dir: Path, tmp_path: Path, audio_dir: Path) -> None:
    """Two connections allowed: a slow head and a slow body hold them, a third gets the busy answer; SIGTERM
    with both still connected ends the process within the grace plus a few seconds."""
    grace = 1.0
    server = RustServer(tiny_bundle_dir, tmp_path, *_rust_flags(audio_dir), "--shutdown-grace-seconds", str(grace),
                        *_flags({"max_connections": 2, "header_timeout_seconds": 60, "body_timeout_seconds": 60,
                                 "keep_alive_timeout_seconds": 60, "body_min_bytes_per_second": 0}))
    slow_head = slow_body = None
    try:
        for _ in range(5):
            slow_head, slow_body, busy = _two_held_and_a_third(server.url)
            if busy.status_code != 200:
                break
            # the connection of the server's last readiness probe still held its place when ours came (the server
            # sees the client's close in its own time), so one of ours got the busy answer: both again
            assert any(_answered_busy(s) for s in (slow_head, slow_body)), "a third connection was served"
            slow_head.close()
            slow_body.close()
        assert busy.status_code == 503 and busy.json()["error"]["type"] == "busy", busy.text
        assert busy.headers["retry-after"] == "5"
        server.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert server.process.wait(grace + 10) == 0
        assert time.monotonic() - sent < grace + 5
        assert _closed_within([slow_head, slow_body], 5)
    finally:
        for sock in (slow_head, slow_body):
            if sock is not None:
                sock.close()
        server.stop()

