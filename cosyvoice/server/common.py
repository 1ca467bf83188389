"""What every HTTP adapter (the REST routers, Ray Serve) shares: the error handlers (over the one mapping,
:mod:`cosyvoice.server.errors`), API keys and owners, the body limit, prompt audio given as base64 or a path,
and the two ways a session's audio leaves (streamed as it is produced, or collected then encoded whole), both
cancelling the session the moment its client goes away.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyvoice.context import StudioContext
from cosyvoice.encoding import AudioEncoder, AudioFormat, audio_format, encode_audio
from cosyvoice.errors import CancelledByShutdown, CosyVoiceError, InvalidInputError
from cosyvoice.owners import Caller, Owners, PublicRoute, no_public_route
from cosyvoice.server.errors import CLIENT_GONE, HttpError, http_error, invalid_request, log_error
from cosyvoice.server.metrics import ServiceMetrics
from cosyvoice.service import AsyncSynthesisSession, TTSService, allowed_path
from cosyvoice.settings import ServerSettings, env_name

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/ready")  # probes answer without an API key (their details need one)
# synthesis routes and the mode their failures count under before the request is parsed
SYNTHESIS_ROUTES = {"/inference_sft": "sft", "/inference_zero_shot": "zero_shot",
                    "/inference_cross_lingual": "cross_lingual", "/inference_instruct": "instruct",
                    "/inference_instruct2": "instruct", "/synthesize": "unknown", "/v1/audio/speech": "unknown"}


# ----------------------------------------------------------------------------- errors: logged and answered once


class ClientGone(Exception):
    """The client disconnected before its answer began (e.g. while it waited for a synthesis slot)."""


@contextlib.contextmanager
def wire_fields(names: dict[str, str]) -> Iterator[None]:
    """Rename the service's field names to the wire's in errors raised inside."""
    try:
        yield
    except InvalidInputError as exc:
        exc.field = names.get(exc.field, exc.field)
        raise


def install_error_handlers(app: FastAPI) -> None:
    """Every error of every router answers through :func:`http_error` (once, here): a JSON body, never a
    traceback; failures of synthesis routes are counted in the metrics under their mode."""

    def respond(request: Request, exc: BaseException) -> JSONResponse:
        state = server_state(request)
        mode = SYNTHESIS_ROUTES.get(request.url.path)
        if mode is not None and state.loaded is not None:
            state.loaded.report_failure(mode, exc)
        error = http_error(exc, state.settings)
        log_error(error, exc, f"{request.method} {request.url.path}")
        return error.response()

    @app.exception_handler(CosyVoiceError)
    async def on_cosyvoice_error(request: Request, exc: CosyVoiceError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, invalid_request(exc))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        invalid = invalid_request(exc)
        if exc.status_code == 413 or invalid is not None:
            return respond(request, invalid or exc)
        kind = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout"}.get(exc.status_code, "error")
        return HttpError(exc.status_code, kind, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_GONE)  # nobody reads it; the access log shows the hang-up

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, exc)


# ----------------------------------------------------------------------------- the app's state


@dataclass
class ServerState:
    """One REST app's settings, metrics and the process's :class:`StudioContext` (its service ``None`` while the
    model loads)."""

    context: StudioContext
    metrics: ServiceMetrics = field(default_factory=ServiceMetrics)

    @property
    def settings(self) -> ServerSettings:
        return self.context.settings

    @property
    def owners(self) -> Owners:
        return self.context.owners

    @property
    def loaded(self) -> TTSService | None:
        return self.context.loaded

    def install(self, service: TTSService) -> None:
        """Serve ``service``: its outcomes feed the metrics."""
        self.metrics.attach(service)
        self.context.install(service)

    def read_only(self) -> dict[str, str]:
        """The folders served read-only (``voices``, ``data``) and what that means for users."""
        reasons = {"voices": self.loaded.voices_read_only if self.loaded else None,
                   "data": self.context.takes.read_only}
        return {folder: why for folder, why in reasons.items() if why}

    def service(self) -> TTSService:
        return self.context.service()


def server_state(conn: HTTPConnection) -> ServerState:
    """The :class:`ServerState` of the app serving ``conn`` (``app.state.server``)."""
    return conn.app.state.server


def service_of(conn: HTTPConnection) -> TTSService:
    return server_state(conn).service()


# ----------------------------------------------------------------------------- callers (cosyvoice.owners)


def identify(owners: Owners, conn: HTTPConnection) -> Caller | None:
    """Who makes this request (:meth:`Owners.caller`; a WebSocket may pass ``?api_key=``: browsers cannot set
    its headers). None: a server with keys, and no valid key."""
    api_key = ""
    if conn.scope["type"] == "websocket":
        api_key = (parse_qs(conn.scope.get("query_string", b"").decode()).get("api_key") or [""])[0]
    return owners.caller(conn, api_key=api_key)


def caller_of(conn: HTTPConnection) -> Caller | None:
    return identify(server_state(conn).owners, conn)


def request_owner(conn: HTTPConnection) -> str | None:
    """The owner string the service records for this request's voices (:mod:`cosyvoice.owners`)."""
    caller = caller_of(conn)
    return None if caller is None else caller.owner


def key_holder(conn: HTTPConnection) -> bool:
    """Whether the request carries a valid key (on a server with keys): it may see server details."""
    return server_state(conn).owners.keyed and caller_of(conn) is not None


class ApiKeys:
    """API keys on every path but the probes and the ``public`` routes (a listening test's rater pages, which
    that feature names: the gate imports no feature)."""

    def __init__(self, app: ASGIApp, owners: Owners, public: PublicRoute = no_public_route) -> None:
        self.app, self.owners, self.public = app, owners, public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))  # as routed behind a proxy's path prefix
        if (path in OPEN_PATHS or (scope["type"] == "http" and self.public(scope["method"], path))
                or identify(self.owners, HTTPConnection(scope)) is not None):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
        response = HttpError(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             headers={"WWW-Authenticate": "Bearer"}).response()
        await response(scope, receive, send)


def cors_options(settings: ServerSettings) -> dict[str, Any] | None:
    """The CORS policy of ``settings`` as :class:`CORSMiddleware` arguments (``None``: CORS closed)."""
    if not settings.cors_origins:
        return None
    return {"allow_origins": list(settings.cors_origins), "allow_methods": ["*"], "allow_headers": ["*"],
            "expose_headers": ["X-Audio-Duration", "X-Sample-Rate"],
            "allow_credentials": "*" not in settings.cors_origins}


def add_cors(app: FastAPI, settings: ServerSettings) -> None:
    """CORS for the configured origins (none: closed); preflights are answered."""
    options = cors_options(settings)
    if options is not None:
        app.add_middleware(CORSMiddleware, **options)


# ----------------------------------------------------------------------------- the body limit


def too_large(max_bytes: int) -> HTTPException:
    return HTTPException(413, f"request body larger than {max_bytes} bytes")


def limit_receive(scope: Scope, receive: Receive, max_bytes: int) -> Receive:
    """``receive`` refusing a body over ``max_bytes``: by Content-Length up front, else once the bytes received
    pass the bound (a handler never sees more than ``max_bytes``). Raises a 413 ``HTTPException``."""
    with contextlib.suppress(ValueError):
        if int(dict(scope.get("headers") or []).get(b"content-length", b"0")) > max_bytes:
            raise too_large(max_bytes)
    received = 0

    async def limited() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise too_large(max_bytes)
        return message

    return limited


class BodyLimit:
    """:func:`limit_receive` for every HTTP request of an app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            limited = limit_receive(scope, receive, self.max_bytes)
        except HTTPException as exc:
            return await HttpError(413, "payload_too_large", str(exc.detail)).response()(scope, receive, send)
        await self.app(scope, limited, send)


# ----------------------------------------------------------------------------- prompt audio on the wire


def base64_audio(value: object, name: str) -> bytes:
    """Base64 audio (a ``data:audio/...;base64,`` URL too) -> its bytes."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a base64 string of an audio file", name)
    payload = value.split(",", 1)[1] if value.startswith("data:") else value
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInputError(f"{name} is not valid base64 audio", name) from exc


def audio_argument(value: object, settings: ServerSettings, name: str) -> bytes | Path:
    """Prompt audio given as a string: a file under the allowed folder, else base64."""
    if isinstance(value, str) and settings.allowed_audio_dir is not None and len(value) < 4096:
        with contextlib.suppress(InvalidInputError, OSError):  # OSError: base64 too long for a file name
            return allowed_path(value, settings.allowed_audio_dir, name)
    try:
        return base64_audio(value, name)
    except InvalidInputError as exc:
        where = ("a file in the allowed audio folder" if settings.allowed_audio_dir else
                 f"a server path (refused unless {env_name('allowed_audio_dir')}, --allowed-audio-dir, names "
                 "their folder)")
        raise InvalidInputError(f"{name} is neither base64 audio nor {where}", name) from exc


# ----------------------------------------------------------------------------- audio out


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


Session = TypeVar("Session", bound=AsyncSynthesisSession)


async def while_connected(receive: Receive, start: Coroutine[Any, Any, Session]) -> Session:
    """``await start`` (a service call: validation, a wait for a slot, featurising an upload), abandoned the
    moment the client disconnects: its place in the queue or its slot goes back at once, and :class:`ClientGone`
    is raised. Call once the request body has been read."""
    call = asyncio.ensure_future(start)
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait((call, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not call.done():
        call.cancel()  # the service's wait ends; a cancelled wait leaves no slot
    with contextlib.suppress(asyncio.CancelledError):
        session = await call
        if not watcher.cancelled() and watcher.done():  # started, but nobody is left to hear it
            await session.aclose()
            raise ClientGone
        return session
    raise ClientGone


class SessionStream(StreamingResponse):
    """Stream a synthesis session's encoded audio; a client disconnect cancels the session at once (its
    ``http.disconnect`` is watched while audio is produced, not only when the next bytes are sent)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], media_type: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body, 200, headers, media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:
            await _until_disconnect(receive)
            await self.on_close()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.body_iterator:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were sending
            pass
        except CancelledByShutdown:  # the client sees a body that never completes, not a short file
            logger.warning("shutting down: a stream was cancelled; closing its response unfinished")
        except Exception:  # after the headers: end the connection without completing the body
            logger.exception("synthesis failed mid-stream; closing the response unfinished")
        finally:
            watcher.cancel()
            await self.on_close()


def audio_stream(session: AsyncSynthesisSession, fmt: str | AudioFormat, headers: dict[str, str] | None = None,
                 sse: bool = False) -> SessionStream:
    """A session encoded as ``fmt``, sent as it is produced (or as OpenAI's ``speech.audio.delta`` events)."""
    encoder = AudioEncoder(fmt, session.sample_rate)

    async def body() -> AsyncIterator[bytes]:
        async for chunk in session:
            data = encoder.encode(chunk.pcm)
            if data:
                yield _sse_delta(data) if sse else data
        tail = encoder.finish()
        if tail:
            yield _sse_delta(tail) if sse else tail
        if sse:
            yield _sse({"type": "speech.audio.done", "usage": {"input_tokens": 0, "output_tokens": 0,
                                                               "total_tokens": 0}})

    async def close() -> None:
        await session.aclose()
        encoder.close()

    media_type = "text/event-stream" if sse else encoder.format.content_type
    return SessionStream(body(), close, media_type,
                         {"X-Sample-Rate": str(session.sample_rate), "Cache-Control": "no-store", **(headers or {})})


async def collect(session: AsyncSynthesisSession, receive: Receive) -> torch.Tensor | None:
    """All of a session's samples, or ``None`` when the client went away first: its disconnect cancels the
    session at once (the LLM stops within one step), not when the audio would have been sent. Raises
    :class:`~cosyvoice.errors.CancelledByShutdown` (503) when the server's shutdown cancelled it."""
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _until_disconnect(receive)
        gone = True
        await session.aclose()

    watcher = asyncio.create_task(watch())
    try:
        pieces = [chunk.pcm async for chunk in session]
    finally:
        watcher.cancel()
        await session.aclose()
    if gone:
        return None
    return torch.cat(pieces) if pieces else torch.zeros(0)


async def whole_file(session: AsyncSynthesisSession, fmt: str | AudioFormat, receive: Receive) -> Response:
    """Collect the session, then encode it as one complete file (exact sizes, ``X-Audio-Duration``)."""
    fmt = fmt if isinstance(fmt, AudioFormat) else audio_format(fmt)
    pcm = await collect(session, receive)
    if pcm is None:
        return Response(status_code=CLIENT_GONE)  # nobody reads it; the access log shows the hang-up
    encoded, headers = encoded_whole(pcm, fmt, session.sample_rate)
    return Response(encoded, media_type=fmt.content_type, headers=headers)


def encoded_whole(pcm: torch.Tensor, fmt: AudioFormat, sample_rate: int) -> tuple[bytes, dict[str, str]]:
    """One complete file of ``pcm`` and its headers (``X-Audio-Duration`` in seconds, ``X-Sample-Rate``)."""
    seconds = pcm.numel() / sample_rate
    return (encode_audio(pcm, fmt, sample_rate),
            {"X-Audio-Duration": f"{seconds:.3f}", "X-Sample-Rate": str(sample_rate)})


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _sse_delta(data: bytes) -> bytes:
    return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
