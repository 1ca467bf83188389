"""WebSocket ``/v1/audio/stream``: text pieces in, audio chunks out as soon as they exist (protocol in
docs/servers.md). A socket must send its start message within ``stream_start_seconds`` and real text (not
white space, which keep-alives send) at least every ``stream_idle_seconds``, or its text is ended; either way
a silent client cannot hold a synthesis slot."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from cosyvoice.encoding import AudioEncoder
from cosyvoice.engine import AudioChunk
from cosyvoice.errors import InvalidInputError
from cosyvoice.pipeline import TextStreamClosedError
from cosyvoice.server.common import (
    base64_audio,
    http_error,
    log_error,
    request_owner,
    server_state,
    service_of,
    wire_fields,
)
from cosyvoice.server.http_limits import check_json_shape
from cosyvoice.service import AsyncSynthesisSession, SynthesisRequest
from cosyvoice.settings import ServerSettings

logger = logging.getLogger(__name__)

router = APIRouter(tags=["websocket"])

WEBSOCKET_FIELDS = {"instruction": "instructions"}
START = '{"type": "start", "voice": ...}'


def socket_request(start: Any) -> SynthesisRequest:
    """The start message as a request: ``voice`` (saved) or ``prompt_audio`` (base64) with ``transcript``;
    ``instructions``; ``mode`` (default: instruct with instructions, else sft for a saved voice, zero_shot with a
    transcript, cross_lingual without); ``format`` (default pcm); ``speed``; ``seed``; ``steps`` (the flow's Euler
    steps); ``final`` and ``first_hop`` (the chunk schedule)."""
    if not isinstance(start, dict) or start.get("type") != "start":
        raise InvalidInputError(f"the first message must be {START}", "type")
    voice = start.get("voice")
    voice = voice.get("id") if isinstance(voice, dict) else voice
    audio = start.get("prompt_audio")
    if audio is not None:
        audio = base64_audio(audio, "prompt_audio")
    instructions = start.get("instructions") or ""
    transcript = start.get("transcript") or ""
    default_mode = ("instruct" if isinstance(instructions, str) and instructions.strip() else
                    "sft" if voice is not None else "zero_shot" if transcript else "cross_lingual")
    return SynthesisRequest("", start.get("mode", default_mode), voice=voice, prompt_audio=audio,
                            transcript=transcript, instruction=instructions, speed=start.get("speed", 1.0),
                            seed=start.get("seed"), steps=start.get("steps"), final=start.get("final"),
                            first_hop=start.get("first_hop"), stream=start.get("stream", True),
                            format=start.get("format", "pcm"))


async def receive_json(ws: WebSocket) -> Any:
    """The next text frame as JSON, its nesting and values bounded as a JSON body's are before it is parsed
    (a frame of 100,000 brackets made ``json.loads`` raise RecursionError)."""
    text = await ws.receive_text()
    settings = server_state(ws).settings
    check_json_shape(text.encode(), settings.max_json_depth, settings.max_json_values)
    return json.loads(text)


async def receive_start(ws: WebSocket, seconds: float) -> SynthesisRequest:
    """The start message, within ``seconds`` of the connection."""
    try:
        message = await asyncio.wait_for(receive_json(ws), seconds)
    except asyncio.TimeoutError:
        raise InvalidInputError(f"no start message within {seconds:g} s; send {START} first", "type") from None
    except InvalidInputError:  # too deep, too many values
        raise
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, or not a text frame
        raise InvalidInputError(f"the first message must be JSON: {START}", "type") from exc
    return socket_request(message)


async def read_pieces(ws: WebSocket, session: AsyncSynthesisSession, problems: list[BaseException],
                      idle_seconds: float) -> None:
    """Write ``{"type": "text", "text": ...}`` messages to the session's text until ``{"type": "end"}``, on the
    event loop (no thread); a disconnect or a bad message cancels the session (the bad message is reported once
    the audio loop ends). With no real text for ``idle_seconds`` (white-space pieces do not count), the text is
    ended: what was sent is spoken."""
    loop = asyncio.get_running_loop()
    last_text = loop.time()
    try:
        while True:
            try:
                message = await asyncio.wait_for(receive_json(ws), max(0.0, last_text + idle_seconds - loop.time()))
            except asyncio.TimeoutError:
                logger.info("WebSocket text stream without text for %g s: ending its text", idle_seconds)
                session.writer.close()
                return
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "text" and isinstance(message.get("text"), str):
                session.writer.write(message["text"])  # over the text limit: the synthesis ends with that error
                if message["text"].strip():
                    last_text = loop.time()
            elif kind == "end":
                session.writer.close()
                return
            else:
                raise InvalidInputError('expected {"type": "text", "text": "..."} or {"type": "end"}', "type")
    except (WebSocketDisconnect, TextStreamClosedError):
        pass
    except InvalidInputError as exc:
        if exc.field != "text":  # a text error (the limit) ends the synthesis, which reports it
            problems.append(exc)
    except (ValueError, KeyError, TypeError):  # not JSON, or not a text frame
        problems.append(InvalidInputError("messages must be JSON text frames", "type"))
    else:
        return
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
    log_error(error, exc, "WebSocket synthesis")
    code = 1008 if error.status < 500 else 1013 if error.status == 503 else 1011
    with contextlib.suppress(Exception):  # the client may be gone already
        await ws.send_json({"type": "error", "error": {"message": error.message, "type": error.type,
                                                       "field": error.field}})
        await ws.close(code)


@router.websocket("/v1/audio/stream")
async def audio_stream_socket(ws: WebSocket) -> None:
    """Text pieces in, audio chunks out as soon as they exist."""
    state = server_state(ws)
    await ws.accept()
    session: AsyncSynthesisSession | None = None
    encoder: AudioEncoder | None = None
    reader: asyncio.Task | None = None
    problems: list[BaseException] = []
    try:
        with wire_fields(WEBSOCKET_FIELDS):
            request = await receive_start(ws, state.settings.stream_start_seconds)
            session = await service_of(ws).asynthesize_text_stream(request, owner=request_owner(ws))
        fmt = session.prepared.format
        encoder = AudioEncoder(fmt, session.sample_rate)
        await ws.send_json({"type": "started", "voice": session.prepared.voice_id, "mode": session.prepared.mode,
                            "sample_rate": session.sample_rate, "format": fmt.name, "content_type": fmt.content_type})
        reader = asyncio.create_task(read_pieces(ws, session, problems, state.settings.stream_idle_seconds))
        chunks = samples = 0
        async for chunk in session:
            await send_audio(ws, encoder.encode(chunk.pcm), chunk)
            chunks, samples = chunks + 1, samples + chunk.pcm.numel()
        await send_audio(ws, encoder.finish(), None)
        if problems:
            raise problems[0]
        await ws.send_json({"type": "done", "chunks": chunks, "audio_seconds": samples / session.sample_rate})
        await ws.close(1000)
    except WebSocketDisconnect:
        pass
    except Exception as exc:
        if session is None and state.loaded is not None:  # a session counts its own ending
            state.loaded.report_failure("unknown", exc)
        await socket_error(ws, exc, state.settings)
    finally:
        if reader is not None:
            reader.cancel()
        if session is not None:
            await session.aclose()
        if encoder is not None:
            encoder.close()
