"""The HTTP bounds a hostile client meets, in the Python REST server as in the Rust front (rust/http-front):
a request's head within ``header_timeout_seconds`` (uvicorn has no such bound: :func:`uvicorn_options` adds
one), a body at no fewer than ``body_min_bytes_per_second`` and never silent for ``body_timeout_seconds``
(:class:`BodyGuard`, 408, then a lingering close that a client still sending reads it through), JSON nested
at most ``max_json_depth`` levels and holding at most ``max_json_values`` values, checked before a parser
recurses into it or builds millions of objects (400), idle keep-alive connections closed after
``keep_alive_timeout_seconds`` and at most ``max_connections`` served at once (uvicorn's own options, 503).

The refusals are the same :class:`HttpError` answers the Rust bridge sends (``EmbeddedBridge.config``).
"""

from __future__ import annotations

import asyncio
import email.message
import re
import time
from collections.abc import Callable
from typing import Any

import h11
from fastapi import HTTPException
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from cosyvoice.errors import InvalidInputError
from cosyvoice.server.errors import HttpError, http_error
from cosyvoice.settings import ServerSettings, env_name

_JSON_TOKENS = re.compile(rb'[\[\]{},"\\]')


def json_content(content_type: str | None) -> bool:
    """Whether a body of ``content_type`` is parsed as JSON (as FastAPI decides: ``application/json`` or
    ``application/*+json``; none given: not JSON)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class JsonShape:
    """The nesting and the number of values of a JSON text fed in pieces (brackets and commas inside strings do
    not count; a value is an array or object, or an item after a comma); only brackets, commas, quotes and
    backslashes are looked at, so a body that is mostly one base64 string costs little. Parsed, every value is
    a Python object (a 65 MB body of small ones took 1.4 GB, and failing pydantic on 6 million took 8 GB)."""

    def __init__(self, max_depth: int, max_values: int) -> None:
        self.max_depth, self.max_values, self.depth, self.values, self.in_string = max_depth, max_values, 0, 0, False
        self._escaped_at = -1  # 0: the next piece's first byte is escaped (this one ended in a backslash)

    def feed(self, chunk: bytes) -> InvalidInputError | None:
        """Scan ``chunk``; the refusal once the text so far nests deeper than ``max_depth`` or holds more than
        ``max_values`` values."""
        escaped_at = self._escaped_at
        for match in _JSON_TOKENS.finditer(chunk):
            token, at = match.group(), match.start()
            if self.in_string:
                if at == escaped_at:
                    continue
                if token == b"\\":
                    escaped_at = at + 1
                elif token == b'"':
                    self.in_string = False
            elif token == b'"':
                self.in_string = True
            elif token == b",":
                self.values += 1
                if self.values > self.max_values:
                    return too_many(self.max_values)
            elif token in (b"[", b"{"):
                self.depth, self.values = self.depth + 1, self.values + 1
                if self.depth > self.max_depth:
                    return too_deep(self.max_depth)
            elif token in (b"]", b"}"):
                self.depth = max(0, self.depth - 1)
        self._escaped_at = 0 if escaped_at == len(chunk) else -1
        return None


def too_deep(max_depth: int) -> InvalidInputError:
    return InvalidInputError(f"the body nests JSON deeper than {max_depth} levels")


def too_many(max_values: int) -> InvalidInputError:
    return InvalidInputError(f"the body holds more than {max_values:,} JSON values (array items and object members; "
                             f"{env_name('max_json_values')})")


def check_json_shape(raw: bytes, max_depth: int, max_values: int) -> None:
    """Raise :func:`too_deep` or :func:`too_many` for ``raw`` (before ``json.loads``)."""
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > max_depth or brackets + raw.count(b",") > max_values:
        refused = JsonShape(max_depth, max_values).feed(raw)
        if refused is not None:
            raise refused


def slow_body(settings: ServerSettings) -> HttpError:
    """The 408 of a body sent too slowly (the connection is closed after it)."""
    return HttpError(408, "request_timeout",
                     f"the request body was sent too slowly (no bytes for {settings.body_timeout_seconds:g} s, "
                     f"or under {settings.body_min_bytes_per_second} bytes per second)",
                     headers={"Connection": "close"})


class SlowBody(HTTPException):
    """Raised from ``receive`` inside the app; FastAPI passes an ``HTTPException`` through its body parsing,
    and the error handlers answer it as :func:`slow_body`."""

    def __init__(self, settings: ServerSettings) -> None:
        error = slow_body(settings)
        super().__init__(error.status, error.message, error.headers)


def timed_receive(receive: Receive, settings: ServerSettings) -> Receive:
    """``receive`` raising :class:`SlowBody` when the body's next bytes take over ``body_timeout_seconds``,
    or, once it has been read that long, its average falls under ``body_min_bytes_per_second`` (the Rust
    front's rule). After the last body message it is ``receive`` itself (waiting for a disconnect is not
    timed)."""
    timeout, min_rate = settings.body_timeout_seconds, settings.body_min_bytes_per_second
    started: float | None = None
    received, done = 0, False

    async def timed() -> Message:
        nonlocal started, received, done
        if done:
            return await receive()
        now = time.monotonic()
        started = now if started is None else started
        deadline = now + timeout
        if min_rate:
            deadline = min(deadline, started + max(timeout, received / min_rate))
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - now))
        except asyncio.TimeoutError:
            raise SlowBody(settings) from None
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            done = not message.get("more_body", False)
        else:
            done = True
        return message

    return timed


class BodyGuard:
    """Every HTTP body under :func:`timed_receive`; a JSON body is read whole first (within the body bound,
    so place this inside :class:`~cosyvoice.server.common.BodyLimit`), checked for nesting, then handed on."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        timed = timed_receive(receive, self.settings)
        content_type = dict(scope.get("headers") or []).get(b"content-type", b"").decode("latin-1")
        if not json_content(content_type):
            return await self.app(scope, timed, send)
        try:
            body = await self._read_json(timed)
        except (StarletteHTTPException, InvalidInputError) as exc:  # 413 from the body bound, 408, its shape
            error = slow_body(self.settings) if isinstance(exc, SlowBody) else http_error(exc, self.settings)
            return await error.response()(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read_json(self, receive: Receive) -> bytes:
        shape, parts = JsonShape(self.settings.max_json_depth, self.settings.max_json_values), []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise HTTPException(400, "the client left before sending its body")
            chunk = message.get("body", b"")
            refused = shape.feed(chunk)
            if refused is not None:
                raise refused
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


LINGER_SECONDS = 2.0  # how long a connection answered mid-body still reads (and drops) the client's bytes


class _LingeringTransport:
    """A connection's transport whose ``close`` while the client is still sending its request body (an early
    answer: the 408 of a slow body) sends the answer and a FIN, then reads and drops the client's bytes until it
    closes or ``LINGER_SECONDS`` pass. A socket closed with bytes unread, or receiving bytes after its close,
    answers with a reset, and a client still sending loses the answer it has not read yet."""

    def __init__(self, transport: asyncio.Transport, sending: Callable[[], bool],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._sending, self._loop = transport, sending, loop
        self._timer: asyncio.TimerHandle | None = None
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        if not (self._sending() and self._transport.can_write_eof()):
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()
        self._transport.resume_reading()
        self._timer = self._loop.call_later(LINGER_SECONDS, self._transport.close)

    def lost(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _bounded_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not complete ``header_timeout``
    seconds after it opened or its previous answer ended (uvicorn's keep-alive timeout only closes a
    connection that sends nothing), and closing one answered mid-body as :class:`_LingeringTransport` does."""

    class BoundedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.transport = _LingeringTransport(  # type: ignore[assignment]
                transport, lambda: self.conn.their_state is h11.SEND_BODY, self.loop)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:  # type: ignore[attr-defined]
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self.transport.lost()  # type: ignore[attr-defined]
            super().connection_lost(exc)

    return BoundedH11Protocol


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments of the HTTP bounds."""
    return {"http": _bounded_protocol(settings.header_timeout_seconds),
            "timeout_keep_alive": settings.keep_alive_timeout_seconds,
            "limit_concurrency": settings.max_connections}
