"""The REST server: the official FastAPI endpoints, the bridge contract, OpenAI speech, voices, WebSocket.

    python -m cosyvoice.server.rest --model-dir DIR_OR_ID [--host 127.0.0.1] [--port 50000]

A thin adapter over :class:`cosyvoice.service.TTSService`: each endpoint maps its wire fields onto one
:class:`SynthesisRequest` and the service's errors onto HTTP (bad input 400 naming the field in the wire's
own spelling, unknown voice 404, taken name 409, busy 503 with ``Retry-After``, model failure 500; a JSON
body ``{"error": {"message", "type", "field", "param"}}``, never a traceback). Audio is sent as the engine
produces it; a client that goes away cancels its session. Settings (API keys, CORS, body size, ...) come
from :class:`cosyvoice.settings.ServerSettings`; endpoints and examples are in ``docs/servers.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

import torch
from fastapi import FastAPI, File, Form, Request, UploadFile, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyvoice.encoding import AudioEncoder, audio_format, encode_audio
from cosyvoice.engine import AudioChunk
from cosyvoice.errors import (
    AlreadyExistsError,
    CosyVoiceError,
    InvalidInputError,
    NotFoundError,
    ResourceLimitError,
)
from cosyvoice.server.metrics import ServiceMetrics
from cosyvoice.service import AsyncSynthesisSession, SynthesisRequest, TextPieces, TTSService, allowed_path
from cosyvoice.settings import Limits, ServerSettings, add_server_arguments, settings_from_args
from cosyvoice.voices import VoiceInfo

logger = logging.getLogger(__name__)

BRIDGE_DEFAULT_INSTRUCTION = "Speak naturally in English."  # the bridge contract's instruction without prompt_text
OPEN_PATHS = ("/health", "/ready")  # probes answer without an API key

# service field -> wire field, per API family, so an error names the field the client actually sent
OFFICIAL_FIELDS = {"text": "tts_text", "transcript": "prompt_text", "prompt_audio": "prompt_wav",
                   "instruction": "instruct_text", "voice": "spk_id"}
BRIDGE_FIELDS = {"transcript": "prompt_text", "instruction": "instruct", "voice": "speaker"}
OPENAI_FIELDS = {"text": "input", "instruction": "instructions", "format": "response_format"}
WEBSOCKET_FIELDS = {"instruction": "instructions"}
# synthesis routes and the mode their failures count under before the request is parsed
SYNTHESIS_ROUTES = {"/inference_sft": "sft", "/inference_zero_shot": "zero_shot",
                    "/inference_cross_lingual": "cross_lingual", "/inference_instruct": "instruct",
                    "/inference_instruct2": "instruct", "/synthesize": "unknown", "/v1/audio/speech": "unknown"}


# ----------------------------------------------------------------------------- errors: the one mapping


@dataclass(frozen=True)
class HttpError:
    status: int
    type: str
    message: str
    field: str | None = None
    headers: dict[str, str] | None = None

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "field": self.field, "param": self.field}}
        return JSONResponse(body, self.status, headers=self.headers)


def http_error(exc: BaseException, settings: ServerSettings) -> HttpError:
    """The HTTP form of any exception; only our own errors' messages reach the client."""
    if isinstance(exc, NotFoundError):
        return HttpError(404, "not_found", str(exc), exc.field)
    if isinstance(exc, AlreadyExistsError):
        return HttpError(409, "conflict", str(exc), exc.field)
    if isinstance(exc, InvalidInputError):
        return HttpError(400, "invalid_request_error", str(exc), exc.field)
    if isinstance(exc, ResourceLimitError):
        return HttpError(503, "busy", str(exc), None, {"Retry-After": str(settings.retry_after_seconds)})
    if isinstance(exc, CosyVoiceError):
        return HttpError(500, "model_error", str(exc))
    return HttpError(500, "internal_error", "internal error; the server log has the details")


@contextlib.contextmanager
def wire_fields(names: dict[str, str]) -> Iterator[None]:
    """Rename the service's field names to the wire's in errors raised inside."""
    try:
        yield
    except InvalidInputError as exc:
        exc.field = names.get(exc.field, exc.field)
        raise


class ModelNotReady(CosyVoiceError):
    """Requests that arrive while the model is still loading (or failed to load)."""


# ----------------------------------------------------------------------------- ASGI middleware


class BodyLimit:
    """Refuse bodies over ``max_bytes`` while reading them: by Content-Length up front, else when the bytes
    received pass the bound (an endpoint never sees more than ``max_bytes``)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        with contextlib.suppress(ValueError):
            if int(headers.get(b"content-length", b"0")) > self.max_bytes:
                return await self._too_large()(scope, receive, send)
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body larger than {self.max_bytes} bytes (COSYVOICE_MAX_BODY_BYTES)"

    def _too_large(self) -> JSONResponse:
        return HttpError(413, "payload_too_large", self._message()).response()


class ApiKeys:
    """Bearer API keys on every path but the probes; WebSockets may pass ``?api_key=`` (browsers cannot set
    headers on them)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, tuple(k.encode() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS or self._allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
        response = HttpError(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             headers={"WWW-Authenticate": "Bearer"}).response()
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        if not token and scope["type"] == "websocket":
            token = (parse_qs(scope.get("query_string", b"").decode()).get("api_key") or [""])[0].encode()
        return bool(token) and any(hmac.compare_digest(token, key) for key in self.keys)


class SessionStream(StreamingResponse):
    """Stream a synthesis session's encoded audio; a client disconnect cancels the session at once (its
    ``http.disconnect`` is watched while audio is produced, not only when the next bytes are sent)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], media_type: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body, 200, headers, media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            await self.on_close()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.body_iterator:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were sending
            pass
        except Exception:  # after the headers: end the connection without completing the body
            logger.exception("synthesis failed mid-stream; closing the response unfinished")
        finally:
            watcher.cancel()
            await self.on_close()


def audio_stream(session: AsyncSynthesisSession, fmt: str, headers: dict[str, str] | None = None,
                 sse: bool = False) -> SessionStream:
    """A session encoded as ``fmt`` (or as OpenAI's server-sent ``speech.audio.delta`` events)."""
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


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _sse_delta(data: bytes) -> bytes:
    return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})


# ----------------------------------------------------------------------------- request bodies

FormText = Annotated[str, Form()]
FormFile = Annotated[UploadFile, File()]


class BridgeSynthesis(BaseModel):
    """The bridge server's ``POST /synthesize`` body."""

    model_config = ConfigDict(extra="ignore")
    text: str
    prompt_audio: str | None = None  # base64 (optionally a data: URL) or a path under the allowed folder
    prompt_text: str | None = None
    instruct: str | None = None
    speaker: str | None = None  # a saved voice's id or name
    speed: float = 1.0
    seed: int | None = None  # negative: random


class OpenAISpeech(BaseModel):
    """OpenAI's ``POST /v1/audio/speech`` body (unknown fields are ignored, as OpenAI clients add new ones)."""

    model_config = ConfigDict(extra="ignore")
    model: str = "cosyvoice3"  # any value: there is one model per server
    input: str
    voice: str | dict[str, str]  # a saved voice's id or name, or OpenAI's {"id": ...} form
    instructions: str | None = None
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: str = "audio"  # "audio" or "sse"
    seed: int | None = None  # our extension


def voice_json(info: VoiceInfo) -> dict[str, Any]:
    return {"id": info.id, "object": "voice", "name": info.name, "transcript": info.transcript,
            "created": int(info.created)}


def bridge_audio(value: str, settings: ServerSettings) -> bytes | Path:
    """The bridge's ``prompt_audio``: a file under the allowed folder, else base64 (a data: URL too)."""
    if settings.allowed_audio_dir is not None and len(value) < 4096:
        with contextlib.suppress(InvalidInputError):
            return allowed_path(value, settings.allowed_audio_dir)
    payload = value.split(",", 1)[1] if value.startswith("data:") else value
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        where = "a file in the allowed audio folder" if settings.allowed_audio_dir else "a path (none are allowed)"
        raise InvalidInputError(f"prompt_audio is neither base64 audio nor {where}", "prompt_audio") from exc


def socket_request(start: Any) -> SynthesisRequest:
    """The WebSocket's start message as a request: ``voice`` (saved) or ``prompt_audio`` (base64) with
    ``transcript``; ``instructions``; ``mode`` (default: instruct with instructions, else sft for a saved voice,
    zero_shot with a transcript, cross_lingual without); ``format`` (default pcm); ``speed``; ``seed``."""
    if not isinstance(start, dict) or start.get("type") != "start":
        raise InvalidInputError('the first message must be {"type": "start", "voice": ...}', "type")
    voice = start.get("voice")
    voice = voice.get("id") if isinstance(voice, dict) else voice
    audio = start.get("prompt_audio")
    if audio is not None:
        if not isinstance(audio, str):
            raise InvalidInputError("prompt_audio must be base64 audio", "prompt_audio")
        try:
            audio = base64.b64decode(audio.split(",", 1)[1] if audio.startswith("data:") else audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidInputError("prompt_audio is not valid base64", "prompt_audio") from exc
    instructions = start.get("instructions") or ""
    transcript = start.get("transcript") or ""
    default_mode = ("instruct" if isinstance(instructions, str) and instructions.strip() else
                    "sft" if voice is not None else "zero_shot" if transcript else "cross_lingual")
    return SynthesisRequest("", start.get("mode", default_mode), voice=voice, prompt_audio=audio,
                            transcript=transcript, instruction=instructions, speed=start.get("speed", 1.0),
                            seed=start.get("seed"), stream=start.get("stream", True), format=start.get("format", "pcm"))


async def read_pieces(ws: WebSocket, pieces: TextPieces, session: AsyncSynthesisSession,
                      problems: list[BaseException], idle_seconds: float) -> None:
    """Feed ``{"type": "text", "text": ...}`` messages to the session until ``{"type": "end"}``; a disconnect or a
    bad message cancels it (the bad message is reported once the audio loop ends). A client silent for
    ``idle_seconds`` gets its text ended (what it sent is spoken), so it cannot hold a slot forever."""
    try:
        while True:
            try:
                message = await asyncio.wait_for(ws.receive_json(), idle_seconds)
            except asyncio.TimeoutError:
                logger.info("WebSocket text stream idle for %g s: ending its text", idle_seconds)
                pieces.end()
                return
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "text" and isinstance(message.get("text"), str):
                pieces.put(message["text"])
            elif kind == "end":
                pieces.end()
                return
            else:
                raise InvalidInputError('expected {"type": "text", "text": "..."} or {"type": "end"}', "type")
    except WebSocketDisconnect:
        pass
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, or a wrong message
        problems.append(exc if isinstance(exc, InvalidInputError) else
                        InvalidInputError("messages must be JSON text frames", "type"))
    pieces.abort()
    await session.aclose()


async def send_audio(ws: WebSocket, data: bytes, chunk: AudioChunk | None) -> None:
    """One audio message: JSON metadata (``chunk`` null for the encoder's tail), then the bytes as a binary frame."""
    if not data and chunk is None:
        return
    meta = None if chunk is None else {
        "index": chunk.index, "sample_offset": chunk.sample_offset, "samples": chunk.pcm.numel(),
        "final": chunk.final, "seconds_to_produce": round(chunk.seconds_to_produce, 4)}
    await ws.send_json({"type": "audio", "bytes": len(data), "chunk": meta})
    if data:
        await ws.send_bytes(data)


async def socket_error(ws: WebSocket, exc: BaseException, settings: ServerSettings) -> None:
    """Report an error on the socket, then close it (1008 bad input, 1013 busy/loading, 1011 otherwise)."""
    error = http_error(exc, settings)
    if isinstance(exc, ModelNotReady):
        error = HttpError(503, "loading", str(exc))
    if error.status >= 500 and error.status != 503:
        logger.error("WebSocket synthesis failed", exc_info=exc)
    code = 1008 if error.status < 500 else 1013 if error.status == 503 else 1011
    with contextlib.suppress(Exception):  # the client may be gone already
        await ws.send_json({"type": "error", "error": {"message": error.message, "type": error.type,
                                                       "field": error.field}})
        await ws.close(code)


# ----------------------------------------------------------------------------- the app


def create_app(settings: ServerSettings | None = None, service: TTSService | None = None,
               loader: Callable[[], TTSService] | None = None) -> FastAPI:
    """The REST app over a ready ``service``, or one that ``loader`` makes in the background after start-up
    (``/health`` answers at once, ``/ready`` once the model is loaded)."""
    settings = settings or ServerSettings.from_env()
    metrics = ServiceMetrics()
    state: dict[str, Any] = {"service": None, "error": None}

    def install(svc: TTSService) -> None:
        metrics.attach(svc)
        state["service"] = svc

    def load() -> None:
        try:
            install(loader())
            logger.info("model loaded; serving")
        except BaseException as exc:  # the server keeps answering: /ready and requests say what failed
            logger.exception("loading the model failed")
            state["error"] = f"{type(exc).__name__}: {exc}"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state["service"] is None and loader is not None:
            threading.Thread(target=load, daemon=True, name="cosyvoice-load").start()
        yield

    app = FastAPI(title="CosyVoice3 Studio", lifespan=lifespan)
    app.state.settings, app.state.metrics = settings, metrics
    if service is not None:
        install(service)

    def svc() -> TTSService:
        if state["service"] is None:
            raise ModelNotReady(f"the model failed to load: {state['error']}" if state["error"] else
                                "the model is still loading; retry shortly")
        return state["service"]

    # -------------------------------------------------------------- error handlers

    def respond(request: Request, exc: BaseException) -> JSONResponse:
        mode = SYNTHESIS_ROUTES.get(request.url.path)
        if mode is not None and state["service"] is not None:
            state["service"].report_failure(mode, exc)
        if isinstance(exc, ModelNotReady):
            return HttpError(503, "loading", str(exc), None,
                             {"Retry-After": str(settings.retry_after_seconds)}).response()
        error = http_error(exc, settings)
        if error.status == 503:  # busy: a declared, expected answer under load, not a failure to trace
            logger.info("%s %s: busy (503)", request.method, request.url.path)
        elif error.status >= 500:
            logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error.response()

    @app.exception_handler(CosyVoiceError)
    async def on_cosyvoice_error(request: Request, exc: CosyVoiceError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return respond(request, InvalidInputError(f"the body is not valid JSON: {reason}"))
        loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
        field = ".".join(loc) or None
        message = f"{field}: {first.get('msg', 'invalid')}" if field else str(first.get("msg", "invalid request"))
        return respond(request, InvalidInputError(message, field))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 413:
            mode = SYNTHESIS_ROUTES.get(request.url.path)
            if mode is not None and state["service"] is not None:
                state["service"].report_failure(mode, InvalidInputError(str(exc.detail)))
        kind = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(exc.status_code, "error")
        return HttpError(exc.status_code, kind, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, exc)

    # -------------------------------------------------------------- probes and metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: the process serves (503 only when the model failed to load)."""
        if state["error"]:
            return JSONResponse({"status": "failed", "error": state["error"]}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: the model is loaded; with the current load."""
        if state["service"] is None:
            status = "failed" if state["error"] else "loading"
            return JSONResponse({"status": status, "error": state["error"]}, 503)
        s = state["service"].status()
        return JSONResponse({"status": "ready", "model_dir": s.model_dir, "sample_rate": s.sample_rate,
                             "active_sessions": s.active_sessions, "queued_requests": s.queued_requests,
                             "max_sessions": s.max_sessions, "max_queued_requests": s.max_queued_requests,
                             "saved_voices": s.saved_voices})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=metrics.content_type)

    # -------------------------------------------------------------- the official FastAPI endpoints

    async def official(request: SynthesisRequest) -> SessionStream:
        with wire_fields(OFFICIAL_FIELDS):
            session = await svc().asynthesize(request)
        return audio_stream(session, "pcm")

    @app.api_route("/inference_sft", methods=["GET", "POST"])
    async def inference_sft(tts_text: FormText, spk_id: FormText) -> SessionStream:
        return await official(SynthesisRequest(tts_text, "sft", voice=spk_id, format="pcm"))

    @app.api_route("/inference_zero_shot", methods=["GET", "POST"])
    async def inference_zero_shot(tts_text: FormText, prompt_text: FormText,
                                  prompt_wav: FormFile) -> SessionStream:
        return await official(SynthesisRequest(tts_text, "zero_shot", prompt_audio=await prompt_wav.read(),
                                               transcript=prompt_text, format="pcm"))

    @app.api_route("/inference_cross_lingual", methods=["GET", "POST"])
    async def inference_cross_lingual(tts_text: FormText, prompt_wav: FormFile) -> SessionStream:
        return await official(SynthesisRequest(tts_text, "cross_lingual", prompt_audio=await prompt_wav.read(),
                                               format="pcm"))

    @app.api_route("/inference_instruct", methods=["GET", "POST"])
    async def inference_instruct(tts_text: FormText, spk_id: FormText,
                                 instruct_text: FormText) -> SessionStream:
        return await official(SynthesisRequest(tts_text, "instruct", voice=spk_id, instruction=instruct_text,
                                               format="pcm"))

    @app.api_route("/inference_instruct2", methods=["GET", "POST"])
    async def inference_instruct2(tts_text: FormText, instruct_text: FormText,
                                  prompt_wav: FormFile) -> SessionStream:
        return await official(SynthesisRequest(tts_text, "instruct", prompt_audio=await prompt_wav.read(),
                                               instruction=instruct_text, format="pcm"))

    # -------------------------------------------------------------- the bridge contract

    @app.post("/synthesize")
    async def synthesize(body: BridgeSynthesis) -> Response:
        """A complete WAV; ``X-Audio-Duration`` is its length in seconds."""
        with wire_fields(BRIDGE_FIELDS):
            audio = None if not body.prompt_audio else bridge_audio(body.prompt_audio, settings)
            if body.instruct and body.instruct.strip():
                mode, instruction = "instruct", body.instruct
            elif body.prompt_text and body.prompt_text.strip():
                mode, instruction = "zero_shot", ""
            else:
                mode, instruction = "instruct", BRIDGE_DEFAULT_INSTRUCTION
            seed = body.seed if body.seed is None or body.seed >= 0 else None
            request = SynthesisRequest(body.text, mode, voice=body.speaker or None, prompt_audio=audio,
                                       transcript=body.prompt_text or "", instruction=instruction, speed=body.speed,
                                       seed=seed, stream=False, format="wav")
            session = await svc().asynthesize(request)
        try:
            pieces = [chunk.pcm async for chunk in session]
        finally:
            await session.aclose()
        pcm = torch.cat(pieces) if pieces else torch.zeros(0)
        seconds = pcm.numel() / session.sample_rate
        return Response(encode_audio(pcm, "wav", session.sample_rate), media_type=audio_format("wav").content_type,
                        headers={"X-Audio-Duration": f"{seconds:.3f}", "X-Sample-Rate": str(session.sample_rate)})

    @app.get("/speakers")
    async def speakers() -> JSONResponse:
        return JSONResponse({"speakers": [voice_json(v) for v in svc().list_voices()]})

    # -------------------------------------------------------------- OpenAI speech and models

    @app.post("/v1/audio/speech")
    async def openai_speech(body: OpenAISpeech) -> SessionStream:
        """Audio in ``response_format``, streamed as it is produced (``stream_format: sse`` for events)."""
        with wire_fields(OPENAI_FIELDS):
            voice = body.voice.get("id", "") if isinstance(body.voice, dict) else body.voice
            if body.stream_format not in ("audio", "sse"):
                raise InvalidInputError("stream_format must be 'audio' or 'sse'", "stream_format")
            instructed = bool(body.instructions and body.instructions.strip())
            request = SynthesisRequest(body.input, "instruct" if instructed else "sft", voice=voice,
                                       instruction=body.instructions or "", speed=body.speed, seed=body.seed,
                                       stream=True, format=body.response_format)
            session = await svc().asynthesize(request)
        return audio_stream(session, session.prepared.format.name, sse=body.stream_format == "sse")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        model_id = Path(svc().model_dir).name
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "cosyvoice"}]})

    # -------------------------------------------------------------- voices

    @app.post("/v1/voices", status_code=201)
    async def create_voice(name: FormText, audio: FormFile, transcript: FormText = "") -> JSONResponse:
        data = await audio.read()
        info = await asyncio.to_thread(svc().create_voice, name, data, transcript)
        return JSONResponse(voice_json(info), 201)

    @app.get("/v1/voices")
    async def list_voices() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [voice_json(v) for v in svc().list_voices()]})

    @app.get("/v1/voices/{voice}")
    async def get_voice(voice: str) -> JSONResponse:
        return JSONResponse(voice_json(svc().get_voice(voice)))

    @app.delete("/v1/voices/{voice}")
    async def delete_voice(voice: str) -> JSONResponse:
        info = await asyncio.to_thread(svc().delete_voice, voice)
        return JSONResponse({**voice_json(info), "deleted": True})

    # -------------------------------------------------------------- WebSocket: text in, audio out

    @app.websocket("/v1/audio/stream")
    async def audio_stream_socket(ws: WebSocket) -> None:
        """Text pieces in, audio chunks out as soon as they exist (protocol in docs/servers.md)."""
        await ws.accept()
        pieces = TextPieces()
        session: AsyncSynthesisSession | None = None
        encoder: AudioEncoder | None = None
        reader: asyncio.Task | None = None
        problems: list[BaseException] = []
        try:
            with wire_fields(WEBSOCKET_FIELDS):
                try:
                    request = socket_request(await ws.receive_json())
                except (ValueError, KeyError, TypeError) as exc:  # not JSON, or not the start message
                    if isinstance(exc, InvalidInputError):
                        raise
                    raise InvalidInputError('the first message must be JSON: {"type": "start", "voice": ...}',
                                            "type") from exc
                session = await svc().asynthesize_text_stream(request, pieces)
            fmt = session.prepared.format
            encoder = AudioEncoder(fmt, session.sample_rate)
            await ws.send_json({"type": "started", "voice": session.prepared.voice_id, "mode": session.prepared.mode,
                                "sample_rate": session.sample_rate, "format": fmt.name,
                                "content_type": fmt.content_type})
            reader = asyncio.create_task(read_pieces(ws, pieces, session, problems, settings.stream_idle_seconds))
            chunks = 0
            async for chunk in session:
                await send_audio(ws, encoder.encode(chunk.pcm), chunk)
                chunks += 1
            await send_audio(ws, encoder.finish(), None)
            if problems:
                raise problems[0]
            await ws.send_json({"type": "done", "chunks": chunks, "audio_seconds": session.session.audio_seconds})
            await ws.close(1000)
        except WebSocketDisconnect:
            pass
        except Exception as exc:
            if session is None and state["service"] is not None:  # a session counts its own ending
                state["service"].report_failure("unknown", exc)
            await socket_error(ws, exc, settings)
        finally:
            pieces.abort()
            if reader is not None:
                reader.cancel()
            if session is not None:
                await session.aclose()
            if encoder is not None:
                encoder.close()

    # -------------------------------------------------------------- middleware (outermost last)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_keys:
        app.add_middleware(ApiKeys, keys=settings.api_keys)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Audio-Duration", "X-Sample-Rate"],
                           allow_credentials="*" not in settings.cors_origins)
    return app


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="CosyVoice3 REST server (official, bridge, OpenAI, WebSocket)")
    add_server_arguments(parser)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    settings, limits = settings_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings, loader=lambda: _load(settings, limits))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level)


def _load(settings: ServerSettings, limits: Limits) -> TTSService:
    started = time.perf_counter()
    service = TTSService.load(settings.model_dir, settings.voice_dir, device=settings.device, limits=limits)
    logger.info("loaded %s in %.1f s", settings.model_dir, time.perf_counter() - started)
    return service


if __name__ == "__main__":
    main()
